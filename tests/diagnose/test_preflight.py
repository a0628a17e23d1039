"""Pre-flight, health gate and bad-node localization on a 4-host sim cluster with injected faults:
each fault is found before any job starts, in seconds, naming the host and the cause."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from ddplaunch.diagnose.preflight import Check, evaluate
from ddplaunch.sim.faults import sim_fault
from ddplaunch.spec.load import load_spec
from tests.doc_examples import check_doc_example
from tests.ssh_util import ddplaunch, run_processes, sim_spec, wait_for
from tests.timing import no_hang

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "check-schema.json").read_text())
QUICK_HC = {"sizes": ["64K"], "iterations": 2}


def check(cluster, tmp_path, *extra, **overrides):
    overrides.setdefault("healthcheck", QUICK_HC)
    spec = sim_spec(cluster, tmp_path, n_hosts=4, **overrides)
    t0 = time.monotonic()
    proc = ddplaunch(["check", str(spec), "--json", *extra], tmp_path)
    took = time.monotonic() - t0
    summary = json.loads(proc.stdout)
    jsonschema.validate(summary, SCHEMA)
    return proc, summary, took


def failed_checks(summary, host):
    (row,) = [h for h in summary["preflight"]["hosts"] if h["host"] == host]
    return {name: c for name, c in row["checks"].items() if c["ok"] is False}


@pytest.mark.parametrize("fault", ["down", "sshd_stop"])
def test_dead_host_named_by_preflight(sim_cluster, tmp_path, fault):
    bad = sim_cluster.hosts[2]
    sim_fault(sim_cluster, bad.name, **{fault: True})
    try:
        proc, summary, took = check(sim_cluster, tmp_path)
    finally:
        sim_fault(sim_cluster, bad.name, clear=True)
    assert proc.returncode == 1 and summary["blocked"] == "pre-flight"
    assert summary["preflight"]["bad_hosts"] == [bad.name]
    seen = failed_checks(summary, bad.name)["reach"]["seen"]
    assert ("no answer within" if fault == "down" else "cannot connect") in seen
    assert summary["stages"] == []  # nothing was started
    no_hang(took, 30, "a bad host is named by the pre-flight, within its connect timeout")


def test_python_without_torch_named(sim_cluster, tmp_path):
    spec_hosts = [{"addr": h.addr, "name": h.name} for h in sim_cluster.hosts]
    spec_hosts[1]["python"] = "/usr/bin/python3"  # Debian's python: no torch there
    proc, summary, took = check(sim_cluster, tmp_path, hosts=spec_hosts)
    assert proc.returncode == 1
    bad = failed_checks(summary, sim_cluster.hosts[1].name)
    assert "No module named 'torch'" in bad["torch"]["seen"] and "/usr/bin/python3" in bad["torch"]["fix"]
    assert summary["preflight"]["bad_hosts"] == [sim_cluster.hosts[1].name]
    no_hang(took, 30, "a bad host is named by the pre-flight, within its connect timeout")
    check_doc_example("preflight", proc.stderr, [h.name for h in sim_cluster.hosts],
                      [r"pre-flight: FAILED", r"  gpus ", r"\S+ \(\S+\): torch: ", r"    pip install",
                       r"  every check ok", r"\[ddplaunch\] pre-flight failed", r"stopped by the pre-flight"])


def test_master_port_taken_named(sim_cluster, tmp_path):
    master = sim_cluster.hosts[0]
    port = 29431
    holder = subprocess.Popen(sim_cluster.exec_argv(master, [
        sys.executable, "-c", f"import socket,time; s=socket.socket(); s.bind(('', {port})); s.listen(); "
                              "print('held', flush=True); time.sleep(120)"]), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc, summary, took = check(sim_cluster, tmp_path, master={"port": port})
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert proc.returncode == 1
    port_check = failed_checks(summary, master.name)["port"]
    assert f"{port} busy on the master" in port_check["seen"] and "master.port" in port_check["fix"]
    no_hang(took, 30, "a bad host is named by the pre-flight, within its connect timeout")


def test_leftover_processes_of_an_earlier_run_named(sim_cluster, tmp_path):
    host = sim_cluster.hosts[3]
    stray = subprocess.Popen(sim_cluster.exec_argv(host, [
        "env", "DDPLAUNCH_RUN_ID=old-run-7", "sleep", "120"]))
    try:
        wait_for(lambda: run_processes("old-run-7"), timeout=10)
        proc, summary, _ = check(sim_cluster, tmp_path)
    finally:
        stray.kill()
        stray.wait(timeout=10)
    bad = failed_checks(summary, host.name)
    assert "run old-run-7" in bad["leftovers"]["seen"] and "ddplaunch down old-run-7" in bad["leftovers"]["fix"]
    assert summary["preflight"]["bad_hosts"] == [host.name]


def test_on_fail_exclude_runs_job_without_bad_host(sim_cluster, tmp_path):
    hosts = [{"addr": h.addr, "name": h.name} for h in sim_cluster.hosts]
    hosts[2]["python"] = "/usr/bin/python3"
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=4, hosts=hosts,
                    healthcheck={**QUICK_HC, "on_fail": "exclude"}, job={"script": "jobs/toy_ddp.py"})
    proc = ddplaunch(["up", str(spec)], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    bad = sim_cluster.hosts[2].name
    assert f"pre-flight failed on {bad}: EXCLUDED" in out
    assert "HEALTHCHECK OK world=6" in out
    assert out.count("updated_weight=0.6") == 6 and f"[{bad}:" not in out


def test_exclude_option(sim_cluster, tmp_path):
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=3, healthcheck={"enabled": False},
                    job={"script": "jobs/toy_ddp.py"})
    proc = ddplaunch(["up", str(spec), "--exclude", sim_cluster.hosts[0].name], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    # ranks re-planned: the second host is node 0 now
    assert f"[{sim_cluster.hosts[1].name}:0] rank=0 mean_grad=4.0" in proc.stdout
    bad = ddplaunch(["up", str(spec), "--exclude", "nohost"], tmp_path)
    assert bad.returncode == 2 and "--exclude nohost: not a host of the spec" in bad.stderr


# ---------------------------------------------------------------- pure evaluation, fake facts

def facts(**kw):
    base = {"hostname": "h", "python": "3.11.7", "executable": "/venv/bin/python", "torch": "2.13.0",
            "cuda": None, "nccl": None, "gpus": None, "gpu_procs": [], "leftovers": {},
            "master_ips": ["10.0.0.1"], "route_ip": "10.0.0.2", "route_iface": "eth1", "workdir_ok": True,
            "script_ok": True, "disk_free_gb": 50.0, "port_busy": None, "port_error": None, "time": 1000.0}
    base.update(kw)
    return base


def test_evaluate_version_mismatch_loopback_and_clock(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: ssh\nhosts: [a, b, c]\n")
    spec = load_spec(path)
    raw = {"a": facts(), "b": facts(torch="2.12.0", time=1030.0), "c": facts(master_ips=["127.0.1.1"])}
    report = evaluate(spec, raw, launcher_time=1000.0, port=25000)
    b = {k: v for k, v in report.hosts[1].checks.items() if v.ok is False}
    assert "torch 2.12.0 vs 2.13.0 (a=2.13.0, b=2.12.0, c=2.13.0)" in b["versions"].seen
    assert "+30.0s" in b["clock"].seen
    c = report.hosts[2].checks["master_dns"]
    assert c.ok is False and "127.0.1.1" in c.seen and "/etc/hosts trap" in c.seen
    assert report.bad_hosts == ["b", "c"]
    assert report.socket_ifname == "eth1"
    assert report.hosts[0].checks["port"] == Check(True, "reached a:25000")


def test_evaluate_gpus_disk_workdir_and_unreachable_port(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: ssh\nhosts: [a, b, c, d]\nnproc_per_node: 2\ndist_backend: nccl\n")
    spec = load_spec(path)
    raw = {"a": facts(gpus=1),                                        # fewer GPUs than nproc_per_node
           "b": facts(gpus=2, gpu_procs=["4242, python"]),            # GPUs held by another process
           "c": facts(gpus=2, disk_free_gb=0.2, workdir_ok=False, script_ok=False),
           "d": facts(gpus=2, port_error="cannot reach a:25000 over TCP: Connection refused")}
    report = evaluate(spec, raw, launcher_time=1000.0, port=25000)
    bad = {h.host: {name: c for name, c in h.failures()} for h in report.hosts}
    assert "1 GPU(s)" in bad["a"]["gpus"].seen and "nproc_per_node is 2" in bad["a"]["gpus"].fix
    assert "busy: 4242, python" in bad["b"]["gpus"].seen
    assert "0.20 GB free" in bad["c"]["disk"].seen and "missing" in bad["c"]["workdir"].seen
    assert "Connection refused" in bad["d"]["port"].seen and "firewall" in bad["d"]["port"].fix
    assert report.bad_hosts == ["a", "b", "c", "d"]
    table = __import__("ddplaunch.diagnose.preflight", fromlist=["render_table"]).render_table(report)
    verdict = [line for line in table.splitlines() if not line.startswith(("a: ", "b: ", "c: ", "d: "))]
    assert all(len(line) <= 80 for line in verdict) and "FAILED on 4 of 4" in table
    # a host named by its address is named once (`a`, not `a (a)`)
    assert "a: gpus: 1 GPU(s) -> fix: nproc_per_node is 2: lower it or fix the driver" in table.splitlines()


def test_a_torch_older_than_the_oldest_supported_is_named_with_its_fix(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: ssh\nhosts: [a, b, c]\n")
    report = evaluate(load_spec(path), {"a": facts(torch="2.9.1"), "b": facts(torch="2.10.0"),
                                        "c": facts(torch="2.10.0")}, launcher_time=1000.0, port=25000)
    torch_a, torch_b = report.hosts[0].checks["torch"], report.hosts[1].checks["torch"]
    assert torch_a.ok is False and torch_a.seen.startswith("2.9.1 is older than 2.10")
    assert torch_a.fix == "pip install 'torch>=2.10' into /venv/bin/python"
    assert torch_b.ok is True and report.bad_hosts == ["a"]


def test_container_checks_name_a_missing_image_and_a_small_dev_shm(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: ssh\nhosts: [a, b, c]\ncontainer: {image: img:1, runtime: docker, pull: never}\n")
    spec = load_spec(path)
    raw = {"a": {"image_error": "image img:1 is not on the host (container.pull: never)"},
           "b": facts(shm_bytes=16 << 20, workdir_writable=True),
           "c": facts(shm_bytes=64 << 30, workdir_writable=False)}
    report = evaluate(spec, raw, launcher_time=1000.0, port=25000)
    a, b, c = report.hosts
    assert a.checks["image"].ok is False and "docker pull img:1" in a.checks["image"].fix and "python" not in a.checks
    assert b.checks["shm"].ok is True and b.checks["shm"].warn and "16 MB" in b.checks["shm"].seen  # Gloo: a warning
    assert c.checks["workdir"].ok is False and "not writable as uid" in c.checks["workdir"].seen
    table = __import__("ddplaunch.diagnose.preflight", fromlist=["render_table"]).render_table(report)
    assert "b: shm: warning: /dev/shm is 16 MB inside the container" in table
    nccl = load_spec(path).model_copy(update={"dist_backend": "nccl"})
    assert evaluate(nccl, {"b": raw["b"]} | {k: facts(shm_bytes=64 << 30) for k in "ac"}, launcher_time=1000.0,
                    port=25000).hosts[1].checks["shm"].ok is False


@pytest.mark.parametrize("cuda, nccl", [("12.4", "2.21.5"), (None, None)])
def test_the_probe_reads_torchs_versions_and_nccls_only_beside_a_cuda_build(tmp_path, monkeypatch, cuda, nccl):
    """torch's version and CUDA from its version.py (torch not imported); NCCL's pip package is
    looked up for a CUDA build only (a CPU build's NCCL is no fact: none is used)."""
    from ddplaunch.hostside.probe import torch_facts

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('the probe must not import torch')\n")
    (tmp_path / "torch" / "version.py").write_text(f"__version__ = '2.13.0'\ncuda = {cuda!r}\n")
    meta = tmp_path / "nvidia_nccl_cu12-2.21.5.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-nccl-cu12\nVersion: 2.21.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # imported by an earlier test: found first
    assert torch_facts() == {"torch": "2.13.0", "cuda": cuda, "nccl": nccl}
