"""How fast a rank's line reaches a terminal: a foreground `ddplaunch up` and an `attach` of the
same run, side by side (both follow the run's event log; the supervisor writes it).

One local run of 6 ranks (nproc_per_node 6) whose job prints `tick <rank> <time.time()>` every
0.5 s for `--seconds`; `up` runs in the foreground and `attach RUN_ID` is started beside it once
the run is taken. For every tick line each of them shows, latency = when the line arrived -
when the rank printed it. A line every rank prints at once is shown once (folded, console.py
FOLD_S = 1 s), so the job staggers its ranks: each prints at its own offset in the half second.

With `--baseline DIR` (a checkout of an earlier ddplaunch, e.g. `git worktree add /tmp/base f0cea8f`)
its foreground `up` runs too, right after, on the same job: today's screen against the one before
the supervisor.

Usage: .venv/bin/python bench/attach.py [--seconds 20] [--baseline DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK_RE = re.compile(r"tick (\d+) (\d+\.\d+)")
JOB = """import os, sys, time
rank, n = int(os.environ["RANK"]), int(sys.argv[1])
time.sleep(rank * 0.5 / 6)
for _ in range(n):
    print(f"tick {rank} {time.time():.6f}", flush=True)
    time.sleep(0.5)
"""


def follow(proc: subprocess.Popen, out: list[float]) -> None:
    for line in proc.stdout:
        now = time.time()
        m = TICK_RE.search(line)
        if m:
            out.append(now - float(m.group(2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--json")
    ap.add_argument("--baseline", help="an earlier checkout whose `up` runs the same job after")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ddpl-attach-"))
    (tmp / "tick.py").write_text(JOB)
    spec = tmp / "c.yaml"
    spec.write_text(f"name: attach\nworkdir: {ROOT}\nnproc_per_node: 6\nhealthcheck: {{enabled: false}}\n"
                    f"job: {{script: {tmp / 'tick.py'}, args: ['{int(args.seconds * 2)}']}}\n")
    env = dict(os.environ, DDPLAUNCH_HOME=str(tmp / "state"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "ddplaunch"]
    lat: dict[str, list[float]] = {"up (foreground)": [], "attach": []}
    up = subprocess.Popen([*cmd, "up", str(spec), "--run-id", "lat"], stdout=subprocess.PIPE, text=True, env=env)
    while not (tmp / "state" / "runs" / "lat" / "events.jsonl").exists():
        time.sleep(0.05)
    att = subprocess.Popen([*cmd, "attach", "lat"], stdout=subprocess.PIPE, text=True, env=env)
    threads = [threading.Thread(target=follow, args=(p, lat[k])) for p, k in ((up, "up (foreground)"), (att, "attach"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    up.wait()
    att.wait()
    if args.baseline:
        lat["up before the supervisor"] = []
        base_env = dict(env, PYTHONPATH=args.baseline)
        old = subprocess.Popen([*cmd, "up", str(spec), "--run-id", "lat-base"], stdout=subprocess.PIPE, text=True,
                               env=base_env, cwd=args.baseline)
        follow(old, lat["up before the supervisor"])
        old.wait()
    rows = {k: {"lines": len(v), "median_s": statistics.median(v), "p90_s": sorted(v)[int(0.9 * len(v))],
                "max_s": max(v)} for k, v in lat.items() if v}
    print(f"{'follower':26} {'lines':>6} {'median':>8} {'p90':>8} {'max':>8}")
    for k, r in rows.items():
        print(f"{k:26} {r['lines']:6d} {r['median_s']:7.2f}s {r['p90_s']:7.2f}s {r['max_s']:7.2f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
