"""SSH as users configure it, on real sim hosts: hosts named by aliases of a test-only ssh config
(a test HOME), one reachable only through another (`ProxyJump`; the launcher has no route to it:
a blackhole route in this machine's namespace), a `Port` from the config honoured, and a dead
bastion named in one line. The rendezvous uses the hosts' real addresses, never an alias."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from ddplaunch.sim.sshd import SSHD
from tests.doc_examples import check_doc_example
from tests.ssh_util import ROOT, launcher_env, read_until, run_processes, wait_for

pytestmark = pytest.mark.slow

#: Every rank says where it runs and what MASTER_ADDR torchrun gave it; rank 0 prints them all.
WHERE_JOB = """\
import json, os, socket
import torch.distributed as dist
dist.init_process_group("gloo")
me = {"host": socket.gethostname(), "rank": dist.get_rank(), "master": os.environ["MASTER_ADDR"]}
every = [None] * dist.get_world_size()
dist.all_gather_object(every, me)
if dist.get_rank() == 0:
    print("WHERE " + json.dumps(every), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@contextlib.contextmanager
def unroutable(*addrs: str) -> Iterator[None]:
    """This machine (the launcher) cannot reach `addrs`; the sim hosts still reach each other."""
    for addr in addrs:
        subprocess.run(["ip", "route", "del", "blackhole", f"{addr}/32"], capture_output=True, timeout=10)
        subprocess.run(["ip", "route", "add", "blackhole", f"{addr}/32"], check=True, timeout=10)
    try:
        yield
    finally:
        for addr in addrs:
            subprocess.run(["ip", "route", "del", "blackhole", f"{addr}/32"], capture_output=True, timeout=10)


def ssh_home(cluster, tmp_path: Path, entries: dict[str, dict[str, str]]) -> Path:
    """A HOME whose ~/.ssh/config names the sim hosts by aliases (`gpu-N` -> host N)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    text = ""
    for alias, options in entries.items():
        text += f"Host {alias}\n" + "".join(f"  {k} {v}\n" for k, v in options.items())
    text += f"Host *\n  User root\n  IdentityFile {cluster.key}\n"
    (home / ".ssh" / "config").write_text(text)
    return home


def alias_spec(cluster, tmp_path: Path, hosts: list[str], **overrides) -> Path:
    data = {"name": "bastion", "backend": "ssh", "hosts": hosts, "nproc_per_node": 1, "workdir": str(ROOT),
            "healthcheck": {"sizes": ["4K"], "pair_parallelism": 1},
            "ssh": {"known_hosts": str(cluster.known_hosts), "connect_timeout": 5}, **overrides}
    path = tmp_path / "aliases.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(args: list[str], tmp_path: Path, home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(launcher_env(tmp_path), HOME=str(home)))


def _three(cluster) -> dict[str, dict[str, str]]:
    h = cluster.hosts
    return {"gpu-1": {"HostName": h[0].addr}, "gpu-2": {"HostName": h[1].addr},
            "gpu-3": {"HostName": h[2].addr, "ProxyJump": "gpu-1"}}


def test_aliases_and_a_jumped_host_run_with_real_addresses(sim_cluster, tmp_path):
    home = ssh_home(sim_cluster, tmp_path, _three(sim_cluster))
    (tmp_path / "where.py").write_text(WHERE_JOB)
    spec = alias_spec(sim_cluster, tmp_path, ["gpu-1", "gpu-2", "gpu-3"], job={"script": str(tmp_path / "where.py")})
    master = sim_cluster.hosts[0].addr
    dry = run(["up", str(spec), "--dry-run"], tmp_path, home)
    assert f"# master address: {master} (gpu-1's HostName in your ssh config)" in dry.stdout, dry.stdout + dry.stderr
    assert f"--master-addr {master} " in dry.stdout and "via gpu-1" in dry.stdout
    with unroutable(sim_cluster.hosts[2].addr):
        out = run(["up", str(spec), "--run-id", "jump-ok"], tmp_path, home)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "HEALTHCHECK OK world=3" in out.stdout
    (line,) = [ln for ln in out.stdout.splitlines() if "WHERE " in ln]
    where = json.loads(line.split("WHERE ", 1)[1])
    assert [(w["host"], w["rank"]) for w in where] == [(h.name, i) for i, h in enumerate(sim_cluster.hosts[:3])]
    assert {w["master"] for w in where} == {master}  # the real address everywhere, never the alias


def test_ctrl_c_through_the_jump_leaves_nothing_behind_the_bastion(sim_cluster, tmp_path):
    import sys

    home = ssh_home(sim_cluster, tmp_path, _three(sim_cluster))
    spec = alias_spec(sim_cluster, tmp_path, ["gpu-1", "gpu-2", "gpu-3"], healthcheck={"enabled": False},
                      env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")},
                      job={"script": "jobs/train.py", "args": ["--epochs", "50", "--step-sleep", "0.2"]})
    with unroutable(sim_cluster.hosts[2].addr):
        proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", "jump-int"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=dict(launcher_env(tmp_path), HOME=str(home)))
        read_until(proc, "step=", timeout=180)
        behind = sim_cluster.hosts[2].name
        assert any(e.get("DDPLAUNCH_HOST") == "gpu-3" for e in run_processes("jump-int").values()), behind
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, rest[-3000:]
        wait_for(lambda: run_processes("jump-int") == {}, timeout=15)


def test_a_dead_bastion_is_named_in_one_line(sim_cluster, tmp_path):
    h = sim_cluster.hosts
    # the bastion's sshd is down: nothing listens where the config says it does
    entries = {"bastion": {"HostName": h[0].addr, "Port": "2299"},
               "gpu-2": {"HostName": h[1].addr, "ProxyJump": "bastion"},
               "gpu-3": {"HostName": h[2].addr, "ProxyJump": "bastion"}, "gpu-4": {"HostName": h[3].addr}}
    home = ssh_home(sim_cluster, tmp_path, entries)
    spec = alias_spec(sim_cluster, tmp_path, ["gpu-4", "gpu-2", "gpu-3"])
    with unroutable(h[1].addr, h[2].addr):  # only the bastion reaches them
        out = run(["check", str(spec)], tmp_path, home, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    named = [ln for ln in out.stdout.splitlines() if "jump host bastion" in ln]
    assert len(named) == 1, out.stdout
    assert named[0].startswith(f"jump host bastion ({h[0].addr}:2299): cannot connect: ")
    assert "(hosts behind it: gpu-2, gpu-3) -> fix: check that jump host bastion is up" in named[0]
    assert "gpu-4" not in named[0] and not any(ln.startswith(("gpu-2", "gpu-3")) for ln in out.stdout.splitlines())
    check_doc_example("dead-jump", out.stdout, [x.name for x in h], [r"jump host ", r"\[ddplaunch\] pre-flight failed"])


def test_a_port_from_the_ssh_config_is_honoured(sim_cluster, tmp_path):
    """A second sshd of host 2 on port 2222; only the config says so (`ssh.port` unset)."""
    host = sim_cluster.hosts[1]
    host_dir = sim_cluster.host_dir(host)
    pid_file = tmp_path / "sshd2.pid"
    sshd = subprocess.Popen([*sim_cluster.enter_prefix(host), SSHD, "-D", "-f", str(host_dir / "sshd_config"),
                             "-o", "Port=2222", "-o", f"PidFile={pid_file}", "-E", str(tmp_path / "sshd2.log")])
    try:
        from ddplaunch.sim.testing import wait_listening

        wait_listening(sim_cluster, host.name, 2222)
        entries = {"gpu-2": {"HostName": host.addr, "Port": "2222"}}
        home = ssh_home(sim_cluster, tmp_path, entries)
        known = tmp_path / "known_hosts"  # the key, also for [addr]:2222
        key = next(ln.split(" ", 1)[1] for ln in Path(sim_cluster.known_hosts).read_text().splitlines()
                   if ln.startswith(host.addr + " "))
        known.write_text(f"[{host.addr}]:2222 {key}\n")
        spec = alias_spec(sim_cluster, tmp_path, ["gpu-2"], healthcheck={"enabled": False},
                          ssh={"known_hosts": str(known), "connect_timeout": 5})
        valid = run(["validate", str(spec)], tmp_path, home)
        assert f"#   gpu-2: root@{host.addr}:2222 key {sim_cluster.key} (" in valid.stdout, valid.stdout
        out = run(["up", str(spec), "--run-id", "port-2222"], tmp_path, home)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
        assert "Accepted publickey for root" in (tmp_path / "sshd2.log").read_text()  # it was this sshd
    finally:
        sshd.terminate()
        sshd.wait(timeout=10)



def test_a_master_known_only_inside_the_cluster_says_its_own_address(sim_cluster, tmp_path):
    """gpu-3's HostName is the cluster's own name for it (only the hosts resolve it), reached
    through the bastion: the launcher asks gpu-3 which address its sshd was reached on."""
    h = sim_cluster.hosts
    entries = {"gpu-1": {"HostName": h[0].addr}, "gpu-3": {"HostName": h[2].name, "ProxyJump": "gpu-1"}}
    home = ssh_home(sim_cluster, tmp_path, entries)
    known = tmp_path / "known_hosts"  # the cluster's keys, gpu-3's also under its cluster name
    lines = Path(sim_cluster.known_hosts).read_text().splitlines()
    key = next(ln.split(" ", 1)[1] for ln in lines if ln.startswith(h[2].addr + " "))
    known.write_text("\n".join(lines) + f"\n{h[2].name} {key}\n")
    (tmp_path / "where.py").write_text(WHERE_JOB)
    spec = alias_spec(sim_cluster, tmp_path, ["gpu-3", "gpu-1"], healthcheck={"enabled": False},
                      ssh={"known_hosts": str(known), "connect_timeout": 5}, job={"script": str(tmp_path / "where.py")})
    dry = run(["up", str(spec), "--dry-run"], tmp_path, home)
    assert "# master address: <gpu-3's address, asked at launch> (gpu-3 is an alias" in dry.stdout, dry.stdout
    with unroutable(h[2].addr):
        out = run(["up", str(spec), "--run-id", "jump-ask"], tmp_path, home)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    (line,) = [ln for ln in out.stdout.splitlines() if "WHERE " in ln]
    assert {w["master"] for w in json.loads(line.split("WHERE ", 1)[1])} == {h[2].addr}
