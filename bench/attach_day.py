"""`attach`, `status` and `top --once` on a run with 24 hours of traffic at 1,000 hosts x 8 ranks.

Writes the event log a supervisor writes over a day of such a run (record/events.py, with the
snapshots it saves beside it: record/snapshot.py), as the run loop writes it — the run's start,
every host's state, rank 0's line each second (86,400 `Shown`), a window of steps every 30 s (a
part per host), a straggler named and a few quiet hosts — then times each reader as a user runs
it (`python -m ddplaunch ...`, the interpreter's start included):

  - `attach RUN` of the run still going (its record names this process as its supervisor): until
    the replay printed the newest line (then the reader is stopped), from the snapshot and with
    no snapshot (the whole log folded from its first line, as before issue #40)
  - the same run ended: `attach RUN` to its exit, `status RUN`, `top --once RUN`

Usage: .venv/bin/python bench/attach_day.py [--hosts 1000] [--hours 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.plan.launch import Stage  # noqa: E402
from ddplaunch.record.events import (EventLog, HostQuiet, HostState, RunEnded, RunStarted, Shown,  # noqa: E402
                                     StageStarted, StepWindow)
from ddplaunch.record.results import NodeState, RunState  # noqa: E402
from ddplaunch.record.runs import Local, RunRecord  # noqa: E402
from ddplaunch.record.snapshot import SNAPSHOT_FILE, Snapshots  # noqa: E402
from ddplaunch.record.view import RunView  # noqa: E402
from tests.events_util import straggler_named  # noqa: E402


def write_day(home: Path, run_id: str, hosts: int, hours: float, ended: bool) -> tuple[Path, str]:
    """The run's record and event log; the text of its newest screen line."""
    os.environ["DDPLAUNCH_HOME"] = str(home)
    names = [f"gpu{i:04d}" for i in range(hosts)]
    record = RunRecord(run_id=run_id, spec_path="cluster.yaml", backend="ssh", hosts=names, spec={},
                       placement=Local.this_process())
    run_dir = record.make_dir()
    record.save()
    view = RunView()
    log = EventLog(run_dir, listeners=[view.add])
    log.listen(Snapshots(run_dir, view, log))
    t0 = time.time() - hours * 3600
    rng = random.Random(1)
    log.append(RunStarted(run_id, "ssh", names, os.getpid(), "here", t=t0))
    log.append(StageStarted(Stage.JOB, names[0], 29500, names, t=t0))
    for h in names:
        log.append(HostState(h, Stage.JOB, NodeState.RUNNING, t=t0))
    seconds = int(hours * 3600)
    text = ""
    for s in range(1, seconds + 1):
        t = t0 + s
        text = f"[{names[0]}:0] step={s} loss={2.0 / (1 + s / 3600):.4f}"
        log.append(Shown(text, t=t))
        if s % 30 == 0:
            parts = {h: [round(0.4 * (1 + 0.02 * rng.random()), 4), 0.05, 0.45, 0.41] for h in names}
            log.append(StepWindow(s * 1 - 4, s, parts, t=t))
        if s == seconds // 3:
            log.append(straggler_named(names[37], [301], 0.5, s - 15, 0.6, 0.4, 0.2, t=t))
        if s % 21600 == 0:
            log.append(HostQuiet(names[(s // 21600) * 7], s - 4, s, t=t))
    if ended:
        for h in names:
            log.append(HostState(h, Stage.JOB, NodeState.OK, 0, t=t0 + seconds))
        from tests.events_util import stage_ended
        log.append(stage_ended({h: NodeState.OK for h in names}, {h: 0 for h in names}, t=t0 + seconds))
        log.append(RunEnded(RunState.OK, 0, t=t0 + seconds))
    log.close()
    return run_dir, text


def timed(argv: list[str], env: dict[str, str], until: str | None = None, timeout: float = 1800) -> float:
    """Seconds until the command ended (or printed `until`, then it is stopped)."""
    t0 = time.perf_counter()
    if until is None:
        subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, timeout=timeout, check=False)
        return time.perf_counter() - t0
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if until in line:
            break
    took = time.perf_counter() - t0
    proc.kill()
    proc.wait()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddpl-bench-attach-"))
    env = dict(os.environ, DDPLAUNCH_HOME=str(work / "home"))
    py = [sys.executable, "-m", "ddplaunch"]
    t0 = time.perf_counter()
    going, newest = write_day(work / "home", "day-going", args.hosts, args.hours, ended=False)
    ended, _ = write_day(work / "home", "day-ended", args.hosts, args.hours, ended=True)
    size = (going / "events.jsonl").stat().st_size
    print(f"wrote 2 logs of {size / 1e6:.0f} MB each ({args.hours:g} h, {args.hosts} hosts) in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    bare = work / "home" / "runs" / "day-bare"
    shutil.copytree(going, bare)
    (bare / SNAPSHOT_FILE).unlink(missing_ok=True)
    record = (bare / "record.json").read_text().replace('"day-going"', '"day-bare"')
    (bare / "record.json").write_text(record)
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        rows.setdefault("attach (running), from the snapshot", []).append(
            timed([*py, "attach", "day-going"], env, until=newest))
        rows.setdefault("attach (running), no snapshot: the whole log", []).append(
            timed([*py, "attach", "day-bare"], env, until=newest))
        rows.setdefault("attach (ended), to its exit", []).append(timed([*py, "attach", "day-ended"], env))
        rows.setdefault("status (running)", []).append(timed([*py, "status", "day-going"], env))
        rows.setdefault("top --once (running)", []).append(timed([*py, "top", "--once", "day-going"], env))
    rows.setdefault("python -m ddplaunch --help (the interpreter's start)", []).extend(
        timed([*py, "--help"], env) for _ in range(args.repeats))
    print(f"\n| reader ({args.hours:g} h at {args.hosts} hosts x 8, log {size / 1e6:.0f} MB) | median s | min s | max s |")
    print("|---|---:|---:|---:|")
    for name, times in rows.items():
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
