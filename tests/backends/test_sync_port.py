"""`sync:`, the master-port retry and the detected socket interface on real (sim) hosts, over SSH.

The sim hosts share this machine's file system, so sync is tested where it shows: into a workdir
of the test's own that nothing but the hosts' sshd writes to (files, modes, mtimes, no staging
left behind), onto the very files synced (workdir = the spec's directory, as with an NFS home),
and each rank reading the synced files from its own host."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import stat
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ddplaunch.plan.launch import derive_port
from ddplaunch.record.events import PreflightChecked, Requested, Shown, StageStarted, read_events
from tests.ssh_util import ddplaunch, run_processes, run_view, sim_spec
from tests.timing import no_hang

NO_HC = {"enabled": False}
OLD_MTIME = 1_000_000_000  # 2001: a synced file keeping it was not written "now"

JOB = """\
import hashlib, os, socket
def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
print(f"SYNCED rank={os.environ['RANK']} host={socket.gethostname()} cwd={os.getcwd()} "
      f"nested={sha('payload/data/nested.txt')} job={sha('payload/job.py')}", flush=True)
"""

ENV_JOB = """\
import os, socket
print("ENVJOB " + " ".join(f"{k}={os.environ.get(k)}" for k in
      ("RANK", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")) + f" host={socket.gethostname()}",
      flush=True)
"""

#: Holds a port inside a sim host until killed (or 300 s, so it can never outlive a test by much).
HOLD = ("import socket, sys, time; s = socket.socket(); s.bind(('', int(sys.argv[1]))); s.listen(); "
        "print('held', flush=True); time.sleep(300)")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_payload(base: Path) -> dict[str, int]:
    """payload/ with a job, a nested file, an executable and a private file; rel path -> mode."""
    files = {"job.py": (JOB, 0o644), "data/nested.txt": ("nested content 1\n", 0o640),
             "run.sh": ("#!/bin/sh\necho hi\n", 0o750), "secret.txt": ("not for others\n", 0o600)}
    for rel, (text, mode) in files.items():
        path = base / "payload" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        os.utime(path, (OLD_MTIME, OLD_MTIME))
    return {rel: mode for rel, (_, mode) in files.items()}


def synced_lines(out: str) -> dict[str, dict[str, str]]:
    """host -> the fields its rank printed (one rank per host here)."""
    found = {}
    for m in re.finditer(r"SYNCED (rank=\S+ host=(\S+) cwd=\S+ nested=\S+ job=\S+)", out):
        found[m.group(2)] = dict(kv.split("=", 1) for kv in m.group(1).split())
    return found


def sync_spec(cluster, tmp_path: Path, workdir: Path, n_hosts: int = 3) -> Path:
    return sim_spec(cluster, tmp_path, n_hosts=n_hosts, nproc_per_node=1, workdir=str(workdir),
                    sync=["payload"], healthcheck=NO_HC, job={"script": "payload/job.py"})


def test_sync_delivers_files_with_modes_and_mtimes_to_every_host(sim_cluster, tmp_path):
    modes = make_payload(tmp_path)
    workdir = tmp_path / "remote"  # the hosts' workdir: only their sshd writes here
    workdir.mkdir()
    spec = sync_spec(sim_cluster, tmp_path, workdir)
    hosts = [h.name for h in sim_cluster.hosts[:3]]

    proc = ddplaunch(["up", str(spec), "--run-id", "sync-1"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ranks = synced_lines(proc.stdout)
    assert sorted(ranks) == sorted(hosts), proc.stdout[-3000:]
    for host, fields in ranks.items():  # every rank read the synced files on its own host
        assert fields["cwd"] == str(workdir)
        assert fields["nested"] == sha(tmp_path / "payload/data/nested.txt"), host
        assert fields["job"] == sha(tmp_path / "payload/job.py"), host
    for rel, mode in modes.items():
        local, remote = tmp_path / "payload" / rel, workdir / "payload" / rel
        assert remote.read_bytes() == local.read_bytes(), rel
        st = remote.stat()
        assert stat.S_IMODE(st.st_mode) == mode, f"{rel}: {oct(stat.S_IMODE(st.st_mode))}, want {oct(mode)}"
        assert int(st.st_mtime) == OLD_MTIME, rel
    assert [p.name for p in workdir.iterdir()] == ["payload"]  # no staging directory left behind

    # a changed file is delivered again, replacing the copy there (a rank never sees the old one)
    nested = tmp_path / "payload/data/nested.txt"
    nested.write_text("nested content 2, longer than before\n")
    proc = ddplaunch(["up", str(spec), "--run-id", "sync-2"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ranks = synced_lines(proc.stdout)
    assert sorted(ranks) == sorted(hosts)
    assert {f["nested"] for f in ranks.values()} == {sha(nested)}
    assert (workdir / "payload/data/nested.txt").read_bytes() == nested.read_bytes()
    assert int((workdir / "payload/data/nested.txt").stat().st_mtime) == int(nested.stat().st_mtime)


def test_sync_onto_the_synced_files_themselves_keeps_them(sim_cluster, tmp_path):
    """workdir is the spec's directory and the hosts share it (an NFS home, or the launcher being
    one of the hosts): each host's copy lands on the source itself. It must stay whole."""
    modes = make_payload(tmp_path)
    before = {rel: (tmp_path / "payload" / rel).read_bytes() for rel in modes}
    spec = sync_spec(sim_cluster, tmp_path, tmp_path)

    proc = ddplaunch(["up", str(spec), "--run-id", "sync-self"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for rel, data in before.items():
        path = tmp_path / "payload" / rel
        assert path.read_bytes() == data, f"{rel} changed by syncing it onto itself"
        assert stat.S_IMODE(path.stat().st_mode) == modes[rel] and int(path.stat().st_mtime) == OLD_MTIME
    ranks = synced_lines(proc.stdout)
    assert len(ranks) == 3 and {f["nested"] for f in ranks.values()} == {sha(tmp_path / "payload/data/nested.txt")}
    assert not list(tmp_path.glob(".ddplaunch-sync-*"))


def test_sync_path_that_does_not_exist_is_a_spec_error(tmp_path):
    (tmp_path / "payload").mkdir()
    spec = tmp_path / "cluster.yaml"
    spec.write_text("name: t\nbackend: ssh\nhosts: [10.0.0.1, 10.0.0.2]\n"
                    "job:\n  script: payload/job.py\nsync:\n  - payload\n  - data/missing.bin\n")
    for command in (["validate", str(spec)], ["up", str(spec), "--dry-run"]):
        proc = ddplaunch(command, tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        err = proc.stderr.strip()
        assert f"{spec}:8: sync.1: 'data/missing.bin': no such file or directory" in err, err
        assert str(tmp_path / "data/missing.bin") in err
        assert "Traceback" not in err


def test_synced_says_where_sync_puts_files(tmp_path):
    """The pre-flight does not look for a job script that `sync:` delivers at launch (after it)."""
    from ddplaunch.spec.load import load_spec

    make_payload(tmp_path)
    (tmp_path / "one.py").write_text("")
    spec_path = tmp_path / "cluster.yaml"
    spec_path.write_text("name: t\nbackend: ssh\nhosts: [10.0.0.1]\nsync: [payload, one.py]\n")
    spec = load_spec(spec_path)
    assert spec.synced("payload/job.py") and spec.synced("payload/data/nested.txt") and spec.synced("one.py")
    assert not spec.synced("payload/nothere.py") and not spec.synced("job.py") and not spec.synced("other/one.py")
    spec_path.write_text("name: t\nbackend: ssh\nhosts: [10.0.0.1]\nsync: [.]\n")  # the directory's contents
    assert load_spec(spec_path).synced("payload/job.py") and not load_spec(spec_path).synced("x/job.py")


@contextlib.contextmanager
def port_held(cluster, host, port: int):
    """A listener on `port` inside sim host `host` for the block; ended by its PID afterwards."""
    holder = subprocess.Popen(cluster.exec_argv(host, [sys.executable, "-c", HOLD, str(port)]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        line = holder.stdout.readline() if ready else ""
        assert line.strip() == "held", f"listener on {host.name}:{port} did not start: {line!r}"
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=10)


def env_job(tmp_path: Path) -> str:
    (tmp_path / "envjob.py").write_text(ENV_JOB)
    return "envjob.py"


def test_busy_derived_master_port_is_moved_and_named(sim_cluster, tmp_path):
    run_id = "port-retry"
    busy = derive_port(f"{run_id}:job")  # the port `up` derives first for this run's only stage
    spec = sim_spec(sim_cluster, tmp_path, nproc_per_node=1, workdir=str(tmp_path), healthcheck=NO_HC,
                    job={"script": env_job(tmp_path)})
    master = sim_cluster.hosts[0]
    with port_held(sim_cluster, master, busy):
        t0 = time.monotonic()
        proc = ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
        took = time.monotonic() - t0
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    m = re.search(rf"master port {busy} is in use on {re.escape(master.addr)}: using port (\d+)", out)
    assert m, out[-3000:]
    used = int(m.group(1))
    assert used != busy and used in {derive_port(f"{run_id}:job", a) for a in range(1, 20)}
    # the pre-flight tested that port (its event says so), the launch used it, every rank got it
    logged = run_view(tmp_path, run_id)
    assert logged.preflight is not None and f"reached {master.addr}:{used}" in json.dumps(logged.preflight.to_dict())
    log = (tmp_path / f"state/runs/{run_id}/output.log").read_text()
    assert f"stage job: master {master.addr}:{used}" in log and f"using port {used}" in log
    ports = re.findall(r"ENVJOB RANK=\d+ MASTER_PORT=(\d+)", out)
    assert ports and set(ports) == {str(used)} and len(ports) == 3, out[-3000:]
    assert f"--master-port {used} " in logged.plan_text and f"--master-port {busy} " not in logged.plan_text
    assert logged.state == "ok"
    print(f"busy derived port {busy} -> {used}, up in {took:.1f}s")


def test_busy_explicit_master_port_is_a_clear_error(sim_cluster, tmp_path):
    port = 29437
    master = sim_cluster.hosts[0]
    spec = sim_spec(sim_cluster, tmp_path, nproc_per_node=1, workdir=str(tmp_path), healthcheck=NO_HC,
                    master={"port": port}, job={"script": env_job(tmp_path)})
    with port_held(sim_cluster, master, port):
        t0 = time.monotonic()
        proc = ddplaunch(["up", str(spec), "--run-id", "port-explicit"], tmp_path, timeout=120)
        took = time.monotonic() - t0
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    line = next((x for x in out.splitlines() if ": port: " in x), "")
    assert line.startswith(f"{master.name} ({master.addr}): port: {port} busy on the master"), out[-3000:]
    assert "leave master.port unset" in line
    assert "ENVJOB" not in out and "stage job" not in out  # nothing was started
    assert run_processes("port-explicit") == {}
    logged = run_view(tmp_path, "port-explicit")
    assert logged.state == "failed" and logged.stages == []
    no_hang(took, 60, "a busy explicit master port is named by the pre-flight before anything starts")


def test_detected_interface_is_set_on_every_rank(sim_cluster, tmp_path):
    """socket_ifname unset: the pre-flight finds the one interface every host reaches the master
    through, and every rank runs with GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME set to it."""
    spec = sim_spec(sim_cluster, tmp_path, nproc_per_node=1, workdir=str(tmp_path), healthcheck=NO_HC,
                    job={"script": env_job(tmp_path)})
    data = yaml.safe_load(spec.read_text())
    del data["socket_ifname"]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = ddplaunch(["up", str(spec), "--run-id", "ifname"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    assert f"every host reaches the master through {sim_cluster.ifname}: using it for Gloo/NCCL" in out
    ranks = re.findall(r"ENVJOB RANK=(\d+) MASTER_PORT=\d+ GLOO_SOCKET_IFNAME=(\S+) NCCL_SOCKET_IFNAME=(\S+) "
                       r"host=(\S+)", out)
    assert sorted(r[0] for r in ranks) == ["0", "1", "2"], out[-3000:]
    assert {(g, n) for _, g, n, _ in ranks} == {(sim_cluster.ifname, sim_cluster.ifname)}
    assert sorted(h for *_, h in ranks) == sorted(h.name for h in sim_cluster.hosts[:3])
    # the probe rode in the stage's own sessions (one SSH round per host): the verdict came after
    # the stage's request was sent, before it started
    events = [e for e in read_events(tmp_path / "state/runs/ifname") if not isinstance(e, Shown)]
    checked = next(i for i, e in enumerate(events) if isinstance(e, PreflightChecked))
    assert any(isinstance(e, Requested) and " stage job:" in e.text for e in events[:checked])
    assert isinstance(events[checked + 1], StageStarted), events[checked + 1]
