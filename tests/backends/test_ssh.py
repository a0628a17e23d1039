"""The SSH backend on real hosts: network namespaces with their own sshd (`ddplaunch sim`),
real Fabric connections, real torchrun with Gloo across hosts."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddplaunch.backends.shell import lease_every
from ddplaunch.sim.faults import sim_fault
from tests.doc_examples import check_doc_example
from tests.ssh_util import (ddplaunch, popen_ddplaunch, ranks_showing, read_until, run_processes, run_pythons,
                            sim_spec, supervisor_pid, wait_for, write_env_files)
from tests.timing import no_hang

TOY = {"healthcheck": {"enabled": False}, "job": {"script": "jobs/toy_ddp.py"}}


def train_job(tmp_path, *args):
    return {"healthcheck": {"enabled": False},
            "env": {"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")},
            "job": {"script": "jobs/train.py", "args": list(args)}}


def test_healthcheck_and_toy_job_on_three_hosts(sim_cluster, tmp_path):
    spec = sim_spec(sim_cluster, tmp_path, healthcheck={"sizes": ["4K", "1M"], "iterations": 3},
                    job={"script": "jobs/toy_ddp.py"})
    proc = ddplaunch(["up", str(spec), "--run-id", "ssh-toy"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr
    assert "HEALTHCHECK OK world=6 backend=gloo" in out
    # global ranks 0-5, two per host in node order, each computed the same update
    for rank in range(6):
        host = f"{sim_cluster.prefix}{rank // 2 + 1}"
        assert re.search(rf"^\[{host}:{rank}\] rank={rank} host={host} ", out, re.M), out[-3000:]
        assert f"[{host}:{rank}] rank={rank} mean_grad=4.0 updated_weight=0.6" in out
    hc = json.loads((tmp_path / "state/runs/ssh-toy/healthcheck.json").read_text())
    assert sorted(r["host"] for r in hc["ranks"]) == sorted(h.name for h in sim_cluster.hosts[:3] for _ in "ab")
    assert {r["ip"] for r in hc["ranks"]} == set(sim_cluster.addrs[:3])
    assert run_processes("ssh-toy") == {}


def test_dry_run_lines_are_what_runs(sim_cluster, tmp_path):
    """The per-host lines of --dry-run, run by hand with plain ssh, make a working 3-host job."""
    spec = sim_spec(sim_cluster, tmp_path, **TOY)
    dry = ddplaunch(["up", str(spec), "--dry-run", "--run-id", "ssh-dry"], tmp_path)
    assert dry.returncode == 0
    lines = [x for x in dry.stdout.splitlines() if not x.startswith("#")]
    assert len(lines) == 3 and "--node-rank 2" in lines[2]
    write_env_files(dry.stdout, Path.home())  # the sim's hosts share this file system and $HOME
    ssh = ["ssh", "-i", str(sim_cluster.key), "-o", f"UserKnownHostsFile={sim_cluster.known_hosts}",
           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
    def by_hand(i):
        cmd = ssh + [f"root@{sim_cluster.hosts[i].addr}", "bash -c " + shlex.quote(lines[i])]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(by_hand, range(3)))
    assert f"[{sim_cluster.hosts[2].name}:5] rank=5 mean_grad=4.0 updated_weight=0.6" in outs[2]
    assert f"[{sim_cluster.hosts[0].name}:0] rank=0 mean_grad=4.0 updated_weight=0.6" in outs[0]


def test_a_killed_supervisor_leaves_no_process(sim_cluster, tmp_path):
    """SIGKILL to the run's supervisor (a SIGKILLed `up` leaves the run going: test_supervisor.py):
    no cleanup by ddplaunch at all, yet every process of the run ends — the pty hang-up ends
    torchrun and its workers. (Ctrl-C to `up`: test_fault_matrix.py's test_ctrl_c_ends_everything.)"""
    run_id = "ssh-sigkill"
    spec = sim_spec(sim_cluster, tmp_path, **train_job(tmp_path, "--epochs", "50", "--step-sleep", "0.2"))
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    read_until(proc, "step=", timeout=180)
    assert len(run_pythons(run_id)) == 9  # 3 torchrun + 6 workers
    t0 = time.monotonic()
    os.kill(supervisor_pid(tmp_path, run_id), signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "ended without ending the run" in out, out[-3000:]
    wait_for(lambda: run_processes(run_id) == {}, timeout=30)
    no_hang(time.monotonic() - t0, 30, "after SIGKILL to the supervisor every process of the run ends")
    down = ddplaunch(["down", run_id], tmp_path)
    assert down.returncode == 0 and down.stdout.count("nothing left") == 3, down.stdout


def test_down_ends_leftovers_by_tag(sim_cluster, tmp_path):
    """A run whose supervisor froze (its sessions open, nothing hung up): `down` ends it on the
    hosts by the run's tag, then the frozen supervisor."""
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=2, **train_job(tmp_path, "--epochs", "500", "--step-sleep", "0.2"))
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "ssh-down"], tmp_path)
    read_until(proc, "step=", timeout=180)
    frozen = supervisor_pid(tmp_path, "ssh-down")
    os.kill(frozen, signal.SIGSTOP)  # the run's supervisor frozen: connections stay open, nothing hangs up
    try:
        assert len(run_pythons("ssh-down")) == 6
        down = ddplaunch(["down", "ssh-down"], tmp_path, timeout=60)
        assert down.returncode == 0
        *hosts, last = down.stdout.splitlines()
        assert len(hosts) == 2 and all("ended pids" in line for line in hosts), down.stdout
        assert last.startswith(f"supervisor (pid {frozen}): frozen")
        assert run_processes("ssh-down") == {}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_frozen_supervisors_ranks_stop_when_their_lease_runs_out(sim_cluster, tmp_path):
    """While the supervisor renews the nodes' leases the run lives past them; the supervisor then
    frozen (SIGSTOP: its sessions stay open, nothing hangs up, nothing renews): every process of
    the run on every host ends by itself within supervisor.lease + 10 s, no sooner than the lease
    less one renewal interval."""
    lease = 8
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=2, supervisor={"lease": lease},
                    **train_job(tmp_path, "--epochs", "500", "--step-sleep", "0.2"))
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "ssh-lease"], tmp_path)
    read_until(proc, "step=", timeout=180)
    frozen = supervisor_pid(tmp_path, "ssh-lease")
    try:
        # renewed with a line into each node's own session, the run lives on past two leases
        since = time.monotonic()
        while time.monotonic() - since < 2 * lease:
            assert len(run_pythons("ssh-lease")) == 6, "the ranks stopped while their lease was renewed"
            time.sleep(0.5)
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        assert wait_for(lambda: not run_processes("ssh-lease"), timeout=3 * (lease + 10)) is True
        took = time.monotonic() - t0
    finally:
        os.kill(frozen, signal.SIGKILL)
        proc.wait(timeout=60)
    print(f"supervisor frozen -> every process of the run gone: {took:.1f}s (lease {lease}s)")
    assert lease - lease_every(lease) <= took <= lease + 10, took
    assert proc.returncode == 1


def test_dead_host_without_preflight_named_by_the_connect_step_and_nothing_started(sim_cluster, tmp_path):
    """Without pre-flight the backend's own connect step refuses to start, naming the host within
    the connect timeout. With it (the ssh default) the pre-flight gate does: test_fault_matrix.py's
    test_dead_host_named_before_anything_starts (`up`, host down) and test_preflight.py's
    test_dead_host_named_by_preflight (`check`, host down or its sshd stopped)."""
    bad = sim_cluster.hosts[1]
    run_id = "ssh-dead-sshd_stop"
    spec = sim_spec(sim_cluster, tmp_path, preflight={"enabled": False}, **TOY)
    sim_fault(sim_cluster, bad.name, sshd_stop=True)
    try:
        t0 = time.monotonic()
        proc = ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
        took = time.monotonic() - t0
    finally:
        sim_fault(sim_cluster, bad.name, clear=True)
    out = proc.stdout
    assert proc.returncode == 1, out[-2000:]
    assert f"{bad.name} ({bad.addr}:22): cannot connect" in out
    assert f"first failure: {bad.name} (node 1): unreachable" in out and "not starting" in out
    assert "updated_weight" not in out
    no_hang(took, 30, "a dead host is named within ssh.connect_timeout=5, nothing waits longer")
    assert run_processes(run_id) == {}


def test_host_key_mismatch_refused_and_named(sim_cluster, tmp_path):
    # known_hosts where host 2's entry carries host 1's key
    lines = sim_cluster.known_hosts.read_text().splitlines()
    keys = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.strip()}
    h1, h2 = sim_cluster.hosts[0], sim_cluster.hosts[1]
    keys[h2.addr] = keys[h1.addr]
    known = tmp_path / "known_hosts"
    known.write_text("".join(f"{a} {k}\n" for a, k in keys.items()))
    spec = sim_spec(sim_cluster, tmp_path, ssh={**_ssh(sim_cluster), "known_hosts": str(known)}, **TOY)
    proc = ddplaunch(["up", str(spec)], tmp_path)
    assert proc.returncode == 1
    assert f"{h2.name} ({h2.addr}): reach: host key MISMATCH" in proc.stdout
    assert "updated_weight" not in proc.stdout
    check_doc_example("hostkey", proc.stdout, [h.name for h in sim_cluster.hosts],
                      [r"\S+ \(\S+\): reach: host key", r"stopped by the pre-flight", r"run \S+: "])
    # strict: a host missing from known_hosts is refused too, and named
    known.write_text("".join(f"{a} {k}\n" for a, k in keys.items() if a != h1.addr))
    proc = ddplaunch(["up", str(spec)], tmp_path)
    assert f"{h1.name} ({h1.addr}): reach: host key unknown" in proc.stdout and proc.returncode == 1


def test_env_value_arrives_literally(sim_cluster, tmp_path):
    marker = tmp_path / "pwned"
    script = tmp_path / "show_env.py"
    script.write_text("import os\nprint('NOTE=' + os.environ['NOTE'], flush=True)\n")
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=2, nproc_per_node=1, healthcheck={"enabled": False},
                    env={"NOTE": f"$(touch {marker}); echo"}, job={"script": str(script)})
    proc = ddplaunch(["up", str(spec)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    h0, h1 = (h.name for h in sim_cluster.hosts[:2])
    assert ranks_showing(proc.stdout, f"] NOTE=$(touch {marker}); echo") == 2, proc.stdout  # literally, each rank
    assert not marker.exists()


def _ssh(cluster):
    import yaml

    return yaml.safe_load(cluster.spec_path.read_text())["ssh"]
