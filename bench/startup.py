"""Startup overhead of ddplaunch on one machine, side by side in one run.

Rows: bare `torchrun --standalone` on jobs/toy_ddp.py; `ddplaunch up` of the same job with the
health check skipped; `ddplaunch up` with the health check. Runs are interleaved (A B C A B C ...)
so machine noise hits all three alike; the table shows the median and the overhead vs bare
torchrun. Usage: .venv/bin/python bench/startup.py [--repeats 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(argv, env):
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    if proc.returncode != 0 or "updated_weight=0.6" not in proc.stdout:
        sys.exit(f"run failed: {' '.join(argv)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return took


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    env = dict(os.environ, DDPLAUNCH_HOME=tempfile.mkdtemp(prefix="ddplaunch-bench-"))
    py = sys.executable
    two = Path(env["DDPLAUNCH_HOME"]) / "two-launches.yaml"
    two.write_text((ROOT / "cluster.yaml").read_text().replace("  launch: inline", "  launch: separate")
                   .replace("workdir: null", f"workdir: {ROOT}"))
    cases = {
        "torchrun --standalone": [py, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2", "jobs/toy_ddp.py"],
        "ddplaunch up --skip-healthcheck": [py, "-m", "ddplaunch", "up", "cluster.yaml", "--skip-healthcheck"],
        "ddplaunch up (with health check)": [py, "-m", "ddplaunch", "up", "cluster.yaml"],
        "ddplaunch up (health check launched apart)": [py, "-m", "ddplaunch", "up", str(two)],
    }
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, argv in cases.items():
            times[name].append(timed(argv, env))
    base = statistics.median(times["torchrun --standalone"])
    print(f"{'launch':<44} {'median s':>9} {'min s':>7} {'max s':>7} {'vs torchrun':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<44} {med:>9.2f} {min(ts):>7.2f} {max(ts):>7.2f} {med - base:>+11.2f}s")
    print(f"health check adds {statistics.median(times['ddplaunch up (with health check)']) - statistics.median(times['ddplaunch up --skip-healthcheck']):.2f}s "
          f"({args.repeats} interleaved runs each, 2 ranks, Gloo, {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
