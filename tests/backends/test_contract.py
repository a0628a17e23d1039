"""Every backend fills the same contract: what `up --dry-run` prints is exactly the request `up`
executes (byte for byte; values only known at launch are marked in both), and the Slurm backend
runs inside an existing allocation as its steps — no second job, and Ctrl-C ends the steps only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.ssh_util import ROOT, ddplaunch, launcher_env, read_until, run_processes, run_view, wait_for


def _executed(tmp_path: Path, run_id: str) -> str:
    return run_view(tmp_path, run_id).plan_text


def _ports_marked(text: str) -> str:
    """The master ports are the values probed at launch (a derived port that is busy is replaced):
    the dry run marks them as such; compare everything else byte for byte."""
    import re

    for port in set(re.findall(r"^# run .* master \S+:(\d+) \(port derived from the run id, checked free", text, re.M)):
        text = re.sub(rf"\b{port}\b", "<PORT>", text)
    return text


def _same_request(spec: Path, tmp_path: Path, run_id: str, *extra: str) -> None:
    dry = ddplaunch(["up", str(spec), "--dry-run", "--run-id", run_id, *extra], tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "state" / "runs" / run_id).exists()  # a dry run writes nothing
    run = ddplaunch(["up", str(spec), "--run-id", run_id, *extra], tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert _ports_marked(_executed(tmp_path, run_id)) == _ports_marked(dry.stdout)
    assert "<PORT>" in _ports_marked(dry.stdout)


def test_local_executes_its_dry_run(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: t\nworkdir: {ROOT}\nnproc_per_node: 1\nhealthcheck: {{enabled: false}}\n"
                    "env: {HF_TOKEN: {from_env: TEST_TOKEN}}\n")
    os.environ["TEST_TOKEN"] = "tok-value-123"
    try:
        _same_request(spec, tmp_path, "same-local")
    finally:
        del os.environ["TEST_TOKEN"]
    assert "tok-value-123" not in _executed(tmp_path, "same-local")


@pytest.mark.root
def test_ssh_executes_its_dry_run(sim_cluster, tmp_path):
    data = yaml.safe_load(sim_cluster.spec_path.read_text())
    data.update(hosts=data["hosts"][:2], workdir=str(ROOT), healthcheck={"enabled": False}, nproc_per_node=1)
    spec = tmp_path / "ssh.yaml"
    spec.write_text(yaml.safe_dump(data))
    _same_request(spec, tmp_path, "same-ssh")


def _slurm_spec(cluster, tmp_path: Path, hosts: list[str] | None, **extra) -> Path:
    data = yaml.safe_load(cluster.slurm.spec_path.read_text())
    data["hosts"] = hosts
    if hosts is None:
        data.pop("hosts")
    data["slurm"].pop("nodes", None)
    data["slurm"]["output_dir"] = str(tmp_path / "out")
    data.update(workdir=str(ROOT), nproc_per_node=1, **extra)
    spec = tmp_path / "slurm.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


@pytest.mark.root
def test_slurm_executes_its_dry_run(slurm_cluster, tmp_path):
    hosts = [h.name for h in slurm_cluster.hosts[:2]]
    _same_request(_slurm_spec(slurm_cluster, tmp_path, hosts), tmp_path, "same-slurm")


def _jobs(cluster) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=30,
                         env=cluster.slurm.env())
    return [line for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.root
def test_inside_an_allocation_stages_are_its_steps(slurm_cluster, tmp_path):
    """`ddplaunch up` inside `salloc -N 2` (SLURM_JOB_ID set): health check and job run as steps of
    that allocation — no second job; Ctrl-C ends the steps and keeps the allocation."""
    alloc = subprocess.run(["salloc", "--no-shell", "-N", "2", "--job-name=outer-alloc"], capture_output=True,
                           text=True, timeout=60, env=slurm_cluster.slurm.env())
    job = next(w for w in (alloc.stderr + alloc.stdout).split() if w.isdigit())
    try:
        nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True,
                               timeout=30, env=slurm_cluster.slurm.env()).stdout.strip()
        env = dict(launcher_env(tmp_path), SLURM_JOB_ID=job, SLURM_JOB_NODELIST=nodes,
                   SLURM_CONF=str(slurm_cluster.slurm.conf))
        spec = _slurm_spec(slurm_cluster, tmp_path, None, job={"script": "jobs/toy_ddp.py"},
                           healthcheck={"sizes": ["64K"], "iterations": 2})
        seen_jobs: list[list[str]] = []
        proc = subprocess.Popen([os.sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", "in-alloc"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        while proc.poll() is None:
            seen_jobs.append(_jobs(slurm_cluster))
            time.sleep(0.5)
        out = proc.stdout.read()
        assert proc.returncode == 0, out[-3000:]
        assert "HEALTHCHECK OK world=2" in out and out.count("updated_weight=0.6") == 2
        assert all(len(q) == 1 and q[0].startswith(job) for q in seen_jobs), seen_jobs  # no second job
        # Ctrl-C during a long job: the steps end, the allocation stays
        spec = _slurm_spec(slurm_cluster, tmp_path, None, healthcheck={"enabled": False},
                           env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")},
                           job={"script": "jobs/train.py", "args": ["--epochs", "50", "--step-sleep", "0.2"]})
        proc = subprocess.Popen([os.sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", "in-alloc-int"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        try:
            read_until(proc, "step=", timeout=180)
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, rest[-2000:]
        wait_for(lambda: run_processes("in-alloc-int") == {}, timeout=15)
        assert [q.split()[2] for q in _jobs(slurm_cluster) if q.startswith(job)] == ["RUNNING"]
    finally:
        subprocess.run(["scancel", job], timeout=30, env=slurm_cluster.slurm.env())


@pytest.mark.parametrize("name, text", [
    ("local", "backend: local\n"),
    ("ssh", "backend: ssh\nhosts: [10.0.0.1, 10.0.0.2]\n"),
    ("slurm", "backend: slurm\nslurm: {nodes: 2}\n")])
def test_every_registered_backend_is_made_by_an_import_the_layer_test_sees(tmp_path, name, text):
    """spec/registry.py says which backends exist; backends/__init__.py makes each shipped one
    through a real import (no "module:attribute" string), and connects to nothing doing it."""
    from ddplaunch.backends import SHIPPED, make_backend
    from ddplaunch.backends.contract import RunContext, StopEvent
    from ddplaunch.backends.local import LocalBackend
    from ddplaunch.backends.slurm import SlurmBackend
    from ddplaunch.backends.ssh import SshBackend
    from ddplaunch.spec import registry
    from ddplaunch.spec.load import load_spec

    assert sorted(SHIPPED) == sorted(registry.names())
    path = tmp_path / "c.yaml"
    path.write_text(f"name: t\nworkdir: {ROOT}\njob: {{script: example:toy_ddp.py}}\n{text}")
    backend = make_backend(load_spec(path), RunContext("t-1", tmp_path, StopEvent()))
    assert type(backend) is {"local": LocalBackend, "ssh": SshBackend, "slurm": SlurmBackend}[name]
