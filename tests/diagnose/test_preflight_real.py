"""Pre-flight checks against real (sim) hosts for faults that need a host changed for real: the
Debian 127.0.1.1 trap (the master's /etc/hosts maps its own name to loopback) and a host whose
Python finds another torch version. Nothing may start on the cluster in either case."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from ddplaunch.hostside.probe import torch_facts
from tests.ssh_util import ddplaunch, run_processes, sim_spec

QUICK_HC = {"sizes": ["64K"], "iterations": 2}


def failed_checks(summary, host):
    (row,) = [h for h in summary["preflight"]["hosts"] if h["host"] == host]
    return {name: c for name, c in row["checks"].items() if c["ok"] is False}


def checks_of(summary, host):
    (row,) = [h for h in summary["preflight"]["hosts"] if h["host"] == host]
    return row["checks"]


def resolve_in(sshd_pid: int, name: str) -> str:
    """`getent hosts NAME` as the sessions of the sshd with this PID see it (its mount namespace)."""
    out = subprocess.run(["nsenter", f"--target={sshd_pid}", "--mount", "--net", "getent", "hosts", name],
                         capture_output=True, text=True, timeout=15)
    return out.stdout.split()[0] if out.stdout.split() else ""


@contextlib.contextmanager
def own_name_on_loopback(cluster, host):
    """Debian's installer line `127.0.1.1 HOSTNAME` in `host`'s /etc/hosts only: a file bind-mounted
    over /etc/hosts in the mount namespace of that host's sshd (every SSH session on the host gets
    it; the sim's shared hosts file and the other hosts are untouched), unmounted afterwards."""
    pid = int((cluster.host_dir(host) / "sshd.pid").read_text().split()[0])
    trap = cluster.state_dir / f"hosts.{host.name}.loopback-trap"
    lines = [x for x in cluster.hosts_file.read_text().splitlines() if not x.endswith(f"\t{host.name}")]
    trap.write_text("\n".join(lines[:2] + [f"127.0.1.1\t{host.name}"] + lines[2:]) + "\n")
    mount = ["nsenter", f"--target={pid}", "--mount"]
    subprocess.run(mount + ["mount", "--bind", str(trap), "/etc/hosts"], check=True, timeout=15)
    try:
        assert resolve_in(pid, host.name) == "127.0.1.1"
        yield
    finally:
        subprocess.run(mount + ["umount", "/etc/hosts"], check=True, timeout=15)
        trap.unlink()
        assert resolve_in(pid, host.name) == host.addr  # the host is as it was


def test_master_name_on_loopback_is_named_before_anything_starts(sim_cluster, tmp_path):
    master, others = sim_cluster.hosts[0], sim_cluster.hosts[1:3]
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=3, master={"addr": master.name}, healthcheck=QUICK_HC)
    with own_name_on_loopback(sim_cluster, master):
        t0 = time.time()
        proc = ddplaunch(["check", str(spec), "--json"], tmp_path, timeout=120)
        took = time.time() - t0
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["blocked"] == "pre-flight" and summary["stages"] == []  # nothing was started
    assert summary["preflight"]["bad_hosts"] == [master.name]
    dns = failed_checks(summary, master.name)["master_dns"]
    assert "127.0.1.1" in dns["seen"] and "loopback" in dns["seen"] and master.name in dns["seen"]
    assert "master.addr" in dns["fix"]
    for host in others:  # resolved right there: the same name, the master's cluster address
        assert checks_of(summary, host.name)["master_dns"] == {"ok": True, "seen": master.addr, "fix": ""}
    assert run_processes(summary["run_id"]) == {}
    # the same line on the screen for people (without --json)
    with own_name_on_loopback(sim_cluster, master):
        proc = ddplaunch(["check", str(spec)], tmp_path, timeout=120)
    assert proc.returncode == 1
    line = next((x for x in proc.stdout.splitlines() if ": master_dns: " in x), "")
    assert line.startswith(f"{master.name} ({master.addr}): master_dns: {master.name} -> 127.0.1.1"), proc.stdout
    assert "-> fix: set master.addr to the cluster IP" in line
    print(f"127.0.1.1 trap named in {took:.1f}s")


FAKE_TORCH_VERSION = '''\
from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.12.0'
debug = False
cuda: Optional[str] = None
git_version = '0000000000000000000000000000000000000000'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
'''


def other_torch_python(base: Path) -> Path:
    """An interpreter that finds torch 2.12.0: the real one with PYTHONPATH on a torch package
    that holds only its version file (probe.py reads torch/version.py, never imports torch)."""
    pkg = base / "torch212" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('a torch 2.12.0 stand-in for version checks only')\n")
    (pkg / "version.py").write_text(FAKE_TORCH_VERSION)
    wrapper = base / "python-torch212"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={pkg.parent} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def test_other_torch_version_on_one_host_is_named(sim_cluster, tmp_path):
    real = torch_facts()["torch"]
    assert real and real != "2.12.0"
    python = other_torch_python(tmp_path)
    found = subprocess.run([str(python), "-c", "from ddplaunch.hostside.probe import torch_facts; "
                            "print(torch_facts()['torch'])"], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[2])
    assert found.stdout.strip() == "2.12.0", found.stderr  # the stand-in is what a host would see
    hosts = [{"addr": h.addr, "name": h.name} for h in sim_cluster.hosts]
    odd = sim_cluster.hosts[2]
    hosts[2]["python"] = str(python)
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=4, hosts=hosts, healthcheck=QUICK_HC)
    t0 = time.time()
    proc = ddplaunch(["check", str(spec), "--json"], tmp_path, timeout=120)
    took = time.time() - t0
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["blocked"] == "pre-flight" and summary["stages"] == []
    assert summary["preflight"]["bad_hosts"] == [odd.name]
    bad = failed_checks(summary, odd.name)
    assert set(bad) == {"versions"}, bad
    assert bad["versions"]["seen"].startswith(f"torch 2.12.0 vs {real} (")
    assert f"{odd.name}=2.12.0" in bad["versions"]["seen"]
    assert bad["versions"]["fix"] == f"install torch {real} on {odd.name}"
    assert checks_of(summary, odd.name)["torch"] == {"ok": True, "seen": "2.12.0", "fix": ""}
    for host in sim_cluster.hosts:
        if host is not odd:
            assert checks_of(summary, host.name)["versions"]["ok"] is True
            assert failed_checks(summary, host.name) == {}
    assert run_processes(summary["run_id"]) == {}
    print(f"torch version mismatch named in {took:.1f}s")
