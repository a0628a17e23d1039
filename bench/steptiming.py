"""What the ranks' step timing costs: the same job with it on and off, interleaved, on this machine.

torchrun on localhost, 2 ranks (one per core on a 2-core machine, so neither waits for a core),
each rank through ddplaunch's entry (hostside/entry.py, as every launch runs it) with the health
check off. The job: jobs/{train,fsdp_train}.py, every step spending `--burn-ms` of CPU, printing
each step. Runs alternate on, off, off, on, ... (`--pairs` of each); a run's step time is the
median interval between rank 0's step lines after a warm-up, stamped as they arrive here.
DDPLAUNCH_STEP_TIMING=0 turns the timing off (entry.py then does not load it).

Prints the step time of every run, the median of each side, and the median of the pairwise
ratios (each `on` run against the `off` run beside it), which cancels a machine's slow drift.
Usage: .venv/bin/python bench/steptiming.py [--pairs 6] [--steps 600] [--burn-ms 20] [--job ddp|fsdp2]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "ddplaunch" / "hostside" / "entry.py"
STEP_RE = re.compile(r"^step=(\d+) ")
WARMUP = 50


def job_argv(job: str, steps: int, burn_ms: float) -> list[str]:
    if job == "ddp":
        return [str(ROOT / "jobs" / "train.py"), "--epochs", "1", "--samples", str(steps * 16), "--batch-size", "8",
                "--ckpt-every", "0", "--log-every", "1", "--burn-ms", str(burn_ms)]
    return [str(ROOT / "jobs" / "fsdp_train.py"), "--steps", str(steps), "--global-batch", "16", "--samples", "4096",
            "--ckpt-every", "0", "--log-every", "1", "--burn-ms", str(burn_ms)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(job: str, steps: int, burn_ms: float, timing: bool) -> float:
    """Median seconds between rank 0's step lines after the warm-up (a fresh checkpoint directory:
    the job must not resume the run before it)."""
    with tempfile.TemporaryDirectory(prefix="ddpl-steptiming-") as ckpt:
        return _median_step(job, steps, burn_ms, timing, ckpt)


def _median_step(job: str, steps: int, burn_ms: float, timing: bool, ckpt: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DDPLAUNCH_STEP_TIMING="1" if timing else "0",
               DDPLAUNCH_CKPT_DIR=ckpt)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--local-ranks-filter", "0",
            str(ENTRY), "--no-healthcheck", "--", *job_argv(job, steps, burn_ms)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    stamps: list[tuple[int, float]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        m = STEP_RE.match(line)
        if m:
            stamps.append((int(m.group(1)), time.monotonic()))
    if proc.wait(timeout=600) != 0:
        raise SystemExit(f"the job failed (exit {proc.returncode}); rerun with fewer steps or look at its output")
    late = [(s, t) for s, t in stamps if s >= WARMUP]
    gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(late, late[1:]) if s1 > s0]
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--burn-ms", type=float, default=20.0)
    ap.add_argument("--job", choices=("ddp", "fsdp2"), default="ddp")
    args = ap.parse_args()
    runs: list[tuple[bool, float]] = []
    for n in range(args.pairs):
        for timing in ((True, False) if n % 2 == 0 else (False, True)):
            s = one_run(args.job, args.steps, args.burn_ms, timing)
            runs.append((timing, s))
            print(f"  pair {n}: timing {'on ' if timing else 'off'} {s * 1e3:.2f} ms/step", flush=True)
    on = [s for t, s in runs if t]
    off = [s for t, s in runs if not t]
    ratios = [a / b for a, b in zip(on, off)]
    print(f"\n| job | steps x runs | step time, timing on | timing off | on/off (median of pairs) |")
    print("|---|---|---|---|---|")
    print(f"| {args.job}, {args.burn_ms:.0f} ms CPU a step, 2 ranks | {args.steps} x {len(on)}+{len(off)} | "
          f"{statistics.median(on) * 1e3:.2f} ms | {statistics.median(off) * 1e3:.2f} ms | "
          f"{statistics.median(ratios) - 1:+.2%} (pairs from {min(ratios) - 1:+.2%} to {max(ratios) - 1:+.2%}) |")


if __name__ == "__main__":
    main()
