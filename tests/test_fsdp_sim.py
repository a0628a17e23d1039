"""FSDP2 through ddplaunch on the Slurm sim: the time-limit warning checkpoints, requeues and resumes
the job. Over SSH, a 6-rank run that loses a host resumed on 2 hosts x 2 from its sharded checkpoint
(resharded 6 -> 4, every rank with the same full-parameter hash) is test_recovery.py's
test_without_a_spare_fsdp_goes_on_resharded_on_fewer_hosts; the exact hash across a 4 -> 2 reshard
is test_fsdp.py's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.ssh_util import ROOT, popen_ddplaunch, read_until, wait_for

HASH_RE = re.compile(r"rank=(\d+) full_params_sha256=([0-9a-f]{64})")


def _fsdp(tmp_path: Path, *args: str) -> dict:
    return {"healthcheck": {"enabled": False}, "env": {"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")},
            "job": {"script": "jobs/fsdp_train.py",
                    "args": ["--steps", "40", "--ckpt-every", "4", "--global-batch", "24", *args]}}


def test_fsdp_preempted_on_slurm_requeues_and_resumes(slurm_cluster, tmp_path):
    data = yaml.safe_load(slurm_cluster.slurm.spec_path.read_text())
    data.pop("hosts", None)
    data["workdir"] = str(ROOT)
    data["slurm"].update(output_dir=str(tmp_path / "out"), requeue=True, nodes=2)
    data.update(_fsdp(tmp_path, "--step-sleep", "0.4", "--ckpt-every", "0"))
    spec = tmp_path / "slurm.yaml"
    spec.write_text(yaml.safe_dump(data))
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "fsdp-pre"], tmp_path)
    try:
        read_until(proc, "step=", timeout=240)
        job = next(line.split()[0] for line in subprocess.run(
            ["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=30,
            env=slurm_cluster.slurm.env()).stdout.splitlines() if line.split()[1] == "fsdp-pre")
        warn = subprocess.run(["scancel", "--batch", "--signal=USR2", job], capture_output=True, text=True,
                              timeout=30, env=slurm_cluster.slurm.env())
        assert warn.returncode == 0, warn.stderr
        lines = read_until(proc, "preempted (SIGUSR2): checkpoint at step", timeout=120)
        step = re.search(r"checkpoint at step (\d+)", lines[-1]).group(1)
        wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                                        timeout=30, env=slurm_cluster.slurm.env()).stdout.strip() == "PENDING",
                 timeout=90)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], capture_output=True, timeout=30,
                       env=slurm_cluster.slurm.env())
        rest, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest[-3000:]
    assert "requeued (restart 1)" in rest, rest[-3000:]
    assert re.search(rf"resumed from \S+step_{step} at step {step}", rest), rest[-3000:]
    hashes = dict(HASH_RE.findall(rest))
    assert len(hashes) == 4 and len(set(hashes.values())) == 1, hashes
