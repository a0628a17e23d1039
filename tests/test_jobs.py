"""Runs jobs/ scripts under a real 2-rank torchrun: the toy, training, resume, mismatches."""

import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # torchrun_util sits beside us, whatever the import mode
from torchrun_util import JOBS, poll, run_torchrun, start_torchrun, stop_torchrun  # noqa: E402

TRAIN = JOBS / "train.py"


def final_hash(output: str) -> str:
    found = re.findall(r"final_weights_sha256=([0-9a-f]{64})", output)
    assert len(found) == 1, output
    return found[0]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One uninterrupted default training run, shared by the tests that compare with it."""
    ckpt_dir = tmp_path_factory.mktemp("baseline")
    run = run_torchrun(TRAIN, "--ckpt-dir", ckpt_dir, timeout=120)
    return run, ckpt_dir


def test_toy_ddp_every_rank_gets_the_mean_gradient():
    run = run_torchrun(JOBS / "toy_ddp.py", timeout=90)
    assert run.returncode == 0, run.stdout
    for rank in (0, 1):
        assert f"rank={rank} mean_grad=4.0 updated_weight=0.6" in run.stdout


def test_train_learns_and_replicas_agree(baseline):
    run, ckpt_dir = baseline
    assert run.returncode == 0, run.stdout
    final, start = map(float, re.search(r"final loss=([\d.]+) \(start ([\d.]+)\)", run.stdout).groups())
    assert final < start / 4
    assert re.search(r"replicas identical: [0-9a-f]{16} on 2 ranks", run.stdout)
    final_hash(run.stdout)
    assert (ckpt_dir / "latest").read_text().strip() == "ckpt_step48.pt"
    assert (ckpt_dir / "ckpt_step48.pt").exists()
    assert not list(ckpt_dir.glob("*.tmp.*"))


def test_train_detects_a_diverged_replica(tmp_path):
    run = run_torchrun(TRAIN, "--ckpt-dir", tmp_path, "--epochs", "1", "--corrupt-rank", "1", timeout=120)
    assert run.returncode != 0, run.stdout
    assert "replicas DIFFER: 2 distinct weight hashes" in run.stdout
    assert "final_weights_sha256" not in run.stdout


def test_train_killed_midway_resumes_to_identical_weights(tmp_path, baseline):
    proc = start_torchrun(TRAIN, "--ckpt-dir", tmp_path, "--ckpt-every", "5", "--step-sleep", "0.1")
    try:
        assert poll(lambda: list(tmp_path.glob("ckpt_step*.pt")), timeout=90), "no checkpoint appeared"
    finally:
        out = stop_torchrun(proc)
    assert "final_weights_sha256" not in out and not (tmp_path / "ckpt_step48.pt").exists(), out

    run = run_torchrun(TRAIN, "--ckpt-dir", tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout
    assert re.search(r"resumed from \S+ckpt_step\d+\.pt at step \d+", run.stdout), run.stdout
    assert final_hash(run.stdout) == final_hash(baseline[0].stdout)


def test_train_checkpoints_on_preemption_signal_and_resumes(tmp_path, baseline):
    """SIGUSR2 (Slurm's warning before the time limit) to torchrun, forwarded to the workers
    via --signals-to-handle: every rank stops at the same step after a checkpoint, exit 75."""
    proc = start_torchrun(TRAIN, "--ckpt-dir", tmp_path, "--ckpt-every", "0", "--step-sleep", "0.1",
                          torchrun_args=["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"])
    try:
        lines = []
        for line in proc.stdout:  # training is under way once rank 0 logs a step
            lines.append(line)
            if "step=" in line:
                break
        os.kill(proc.pid, signal.SIGUSR2)
        out = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            stop_torchrun(proc)
    assert proc.returncode != 0, out
    saved = re.search(r"preempted \(SIGUSR2\): checkpoint at step (\d+); exiting 75", out)
    assert saved, out
    assert (tmp_path / f"ckpt_step{saved.group(1)}.pt").exists()
    run = run_torchrun(TRAIN, "--ckpt-dir", tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout
    assert f"resumed from {tmp_path}/ckpt_step{saved.group(1)}.pt at step {saved.group(1)}" in run.stdout
    assert final_hash(run.stdout) == final_hash(baseline[0].stdout)


def test_train_rank_failure_is_restarted_by_torchrun_and_resumes(tmp_path, baseline):
    run = run_torchrun(TRAIN, "--ckpt-dir", tmp_path, "--fail-at-step", "20", "--fail-rank", "1",
                       torchrun_args=["--max-restarts", "1"], timeout=150)
    assert run.returncode == 0, run.stdout
    assert "rank=1 failing on purpose at step 20" in run.stdout
    assert re.search(r"resumed from \S+ckpt_step20\.pt at step 20", run.stdout), run.stdout
    assert final_hash(run.stdout) == final_hash(baseline[0].stdout)


def test_mismatched_collectives_fail_instead_of_passing():
    run = run_torchrun(JOBS / "mismatch_demo.py", "--mode", "error", env={"DDPLAUNCH_DIST_TIMEOUT": "20"},
                       timeout=90)
    assert run.returncode != 0, run.stdout
    assert "passed the mismatched collective" not in run.stdout
