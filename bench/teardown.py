"""Aborts at exit after a finished script: bare torchrun vs torchrun + ddplaunch's entry.py.

Runs jobs/teardown_repro.py N times each way, interleaved (bare, entry, bare, entry, ...), 3 ranks
on localhost, and counts per way: runs, ranks that aborted (a worker killed by SIGABRT, or
"terminate called" in the output) and runs torchrun reported failed (non-zero exit).

    .venv/bin/python bench/teardown.py [--runs 10] [--nproc 3] [--steps 20]
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPRO = ROOT / "jobs" / "teardown_repro.py"
ENTRY = ROOT / "ddplaunch" / "hostside" / "entry.py"
# torchrun's failure report names each failed rank with its exit code (-6 is SIGABRT)
ABORT_RE = re.compile(r"exitcode\s*:\s*-6\b|exitcode: -6\)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(way: str, nproc: int, steps: int, timeout: float) -> dict:
    """One torchrun of the reproducer; returns the exit status, aborted ranks and seconds."""
    script = [str(REPRO), "--steps", str(steps)]
    if way == "entry":
        script = [str(ENTRY), "--no-healthcheck", "--", *script]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)  # torchrun forwards SIGTERM to its workers
        out, _ = proc.communicate(timeout=60)
    aborted = max(len(ABORT_RE.findall(out)), out.count("terminate called"))
    finished = len(re.findall(r"^rank \d+ finished", out, re.M))
    return {"rc": proc.returncode, "aborted": aborted, "finished": finished,
            "seconds": time.monotonic() - started, "out": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per way")
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--keep", default=None, help="write each run's output into this folder")
    args = parser.parse_args()
    totals = {way: {"runs": 0, "aborted_ranks": 0, "runs_with_abort": 0, "failed": 0, "finished": 0,
                    "seconds": 0.0} for way in ("bare", "entry")}
    print(f"{'run':>4} {'way':<6} {'rc':>4} {'finished':>8} {'aborted':>7} {'s':>6}", flush=True)
    for i in range(args.runs):
        for way in ("bare", "entry"):
            r = one_run(way, args.nproc, args.steps, args.timeout)
            t = totals[way]
            t["runs"] += 1
            t["aborted_ranks"] += r["aborted"]
            t["runs_with_abort"] += bool(r["aborted"])
            t["failed"] += r["rc"] != 0
            t["finished"] += r["finished"]
            t["seconds"] += r["seconds"]
            print(f"{i + 1:>4} {way:<6} {r['rc']:>4} {r['finished']:>8} {r['aborted']:>7} {r['seconds']:>6.1f}",
                  flush=True)
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                (Path(args.keep) / f"{i + 1:02d}-{way}.txt").write_text(r["out"])
    print()
    print(f"{'launch':<24} {'runs':>4} {'ranks finished':>14} {'aborted ranks':>13} "
          f"{'runs with abort':>15} {'runs reported failed':>20} {'mean s':>6}")
    for way, label in (("bare", "torchrun"), ("entry", "torchrun + entry.py")):
        t = totals[way]
        print(f"{label:<24} {t['runs']:>4} {t['finished']:>14} {t['aborted_ranks']:>13} "
              f"{t['runs_with_abort']:>15} {t['failed']:>20} {t['seconds'] / max(1, t['runs']):>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
