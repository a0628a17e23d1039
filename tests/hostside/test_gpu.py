"""NCCL on a real GPU: the health check, the pre-flight GPU count and FSDP checkpoints on CUDA.

These run only where torch sees a CUDA device and nvidia-smi is on PATH (they skip elsewhere, with
the reason; they are not real-system tests in conftest's sense, so CI on a machine without GPUs
stays green). One GPU is enough: NCCL refuses two ranks on one device, so world size is the
number of GPUs of this machine, one process each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchrun_util import JOBS, run_torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPUS or not shutil.which("nvidia-smi"),
                                 reason="needs a CUDA device and nvidia-smi (NCCL checks)")]


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"), HOME=str(tmp_path))


def ddplaunch(args, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def nccl_spec(tmp_path, nproc: int) -> Path:
    path = tmp_path / "gpu.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: gpu
        workdir: {ROOT}
        nproc_per_node: {nproc}
        dist_backend: nccl
        healthcheck:
          collectives: [all_reduce, all_gather, reduce_scatter]
          sizes: [1M, 64M]
    """))
    return path


def test_nccl_health_check_then_job_in_one_launch(env, tmp_path):
    proc = ddplaunch(["up", str(nccl_spec(tmp_path, GPUS))], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"HEALTHCHECK OK world={GPUS}" in out
    assert "Warning" not in proc.stdout, proc.stdout  # quiet: the group is bound to the rank's GPU
    (run_dir,) = (tmp_path / "state" / "runs").iterdir()
    hc = json.loads((run_dir / "healthcheck.json").read_text())
    assert hc["ok"] and hc["backend"] == "nccl", hc
    assert sorted(r["local_rank"] for r in hc["ranks"]) == list(range(GPUS))
    assert all(r["device"].startswith(f"cuda:{r['local_rank']} (") for r in hc["ranks"]), hc["ranks"]
    measured = {row["collective"] for row in hc["bandwidth"]}
    assert measured == {"all_reduce", "all_gather", "reduce_scatter"}, hc["bandwidth"]
    assert all(row["algbw_gbps"] > 0 for row in hc["bandwidth"]), hc["bandwidth"]
    for rank in range(GPUS):
        assert re.search(rf"\[localhost:{rank}\] rank={rank} .*updated_weight=", out), out


def test_preflight_counts_the_gpus_of_a_real_host(env, tmp_path):
    ok = ddplaunch(["check", "--json", str(nccl_spec(tmp_path, GPUS))], env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (host,) = json.loads(ok.stdout)["preflight"]["hosts"]
    assert host["checks"]["gpus"] == {"ok": True, "seen": f"{GPUS} free", "fix": ""}, host
    too_many = ddplaunch(["check", str(nccl_spec(tmp_path, GPUS + 1))], env)
    out = too_many.stdout + too_many.stderr
    assert too_many.returncode != 0, out
    assert f"{GPUS} GPU(s)" in out and f"nproc_per_node is {GPUS + 1}" in out, out
    assert "HEALTHCHECK" not in out, out  # refused before anything started


def test_fsdp_on_nccl_checkpoints_and_resumes(tmp_path):
    """FSDP2 + DCP on CUDA: 8 steps straight vs 4 steps, checkpoint, resume to 8: same losses."""
    def run(ckpt, steps):
        r = run_torchrun(JOBS / "fsdp_train.py", "--ckpt-dir", ckpt, "--steps", steps, "--log-every", "1",
                         "--ckpt-every", "4", nproc=GPUS, timeout=240)
        assert r.returncode == 0, r.stdout
        assert "backend=nccl" in r.stdout, r.stdout
        return {int(s): float(v) for s, v in re.findall(r"^step=(\d+) loss=([\d.]+)$", r.stdout, re.M)}

    straight = run(tmp_path / "a", 8)
    run(tmp_path / "b", 4)
    resumed = run(tmp_path / "b", 8)
    assert set(range(5, 9)) <= set(resumed), resumed
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-4), (step, resumed, straight)


def test_a_ddp_job_on_nccl_reports_every_ranks_step_timing(env, tmp_path):
    """jobs/train.py on NCCL through `up`: the ranks' step timing (the DDP comm hook on CUDA)
    reaches the event log — a step time and a wait within it for every rank — and the job's group
    is bound to its GPU (NCCL's barrier does not warn that it guesses the device)."""
    spec = tmp_path / "ddp.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: gpu-ddp
        workdir: {ROOT}
        nproc_per_node: {GPUS}
        dist_backend: nccl
        job:
          script: jobs/train.py
          args: [--epochs, "1", --samples, "2048", --batch-size, "16", --log-every, "50", --ckpt-dir, {tmp_path / "ckpt"}]
    """))
    proc = ddplaunch(["up", str(spec), "--run-id", "gpu-ddp"], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "using the device under current context" not in out, out
    events = [json.loads(line) for line in (tmp_path / "state" / "runs" / "gpu-ddp" / "events.jsonl").open()]
    steps = [e for e in events if e["kind"] == "rank-steps"]
    assert sorted({e["rank"] for e in steps}) == list(range(GPUS)), steps[:5]
    assert all(0 < e["step_s"] < 5 and 0 <= e["wait_s"] <= e["step_s"] for e in steps), steps[:5]
    assert any(e["wait_s"] > 0 for e in steps), steps[:5]  # the GPU's time in the collective (CUDA events)
