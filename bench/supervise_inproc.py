"""The supervisor's readers under the traffic of 16,384 emulated ranks, in-process, beside main's.

Generator processes emulate the hosts (8 ranks each) and write what each host's session would
carry, at the rate a steady run sends it, to pipes: a heartbeat a second per host, and

  new  (this tree) the node agent's lines: its status (`HOSTSTEPS`) every 2 s, its part of every
       window of steps (`WINDOW`: each rank's median compute, wait and step time), rank 0's
       `step=N` line a step
  old  (main before issue #40, `--old-tree`, a git worktree) every rank's own `TIMING` line each
       step, rank 0's line a step

One reader thread per generator hands each line to the supervisor's own objects — `StageLines`
(heartbeats first), the console and the event log (with its snapshots), and the straggler judge
(new: `StepsWatch`, judged on its timer; old: `StragglerJudge.feed` per line and a `RankSteps`
event per line, as main's run loop did). One host's rank computes 1.6x longer from
`--inject-at` seconds on. Measured in this process only (the generators are others): its CPU
(getrusage) over the steady part, each heartbeat's delay from its write to the moment
`StageLines` recorded it (p50/p99/max), when the slowed host was named, the event log's growth
(bytes/s, and per day at 1,000 hosts x 8), and `top`'s refresh (the table of the run's fold and
its hosts' live status, rendered) at every host.

Usage: .venv/bin/python bench/supervise_inproc.py [--ranks 16384] [--per-host 8] [--seconds 120]
       [--step-s 0.5] [--window 5] [--impl new|old] [--old-tree /tmp/ddpl-main] [--json out.json]
       (docs/scaling.md has the command lines behind its figures)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT = "DDPLAUNCH_ALIVE"
WARMUP = 20
BASE_COMPUTE, WAIT = 0.40, 0.05


# ----------------------------------------------------------------------------- the hosts (generators)

def generate(args: argparse.Namespace) -> None:
    """Hosts [lo, hi): their lines on stdout as `node<TAB>sent_monotonic<TAB>line`."""
    lo, hi = (int(x) for x in args.generate.split(":"))
    start, out = args.start, sys.stdout
    rng = random.Random(lo)
    phase = {n: rng.random() for n in range(lo, hi)}  # hosts do not beat in step
    beat = {n: start + phase[n] for n in range(lo, hi)}
    status_at = {n: start + 2 * phase[n] for n in range(lo, hi)}
    step = 0
    slow_host, slow_rank = args.slow_rank // args.per_host, args.slow_rank
    while True:
        now = time.monotonic()
        if now - start > args.seconds:
            return
        lines = []
        for n in range(lo, hi):
            if now >= beat[n]:
                beat[n] += 1.0
                lines.append(f"{n}\t{time.monotonic():.6f}\t{HEARTBEAT}\n")
        due = int((now - start) / args.step_s)
        while step < due:
            step += 1
            slowed = now - start >= args.inject_at
            lines += _step_lines(args, lo, hi, step, slowed, slow_host, slow_rank, rng)
        for n in range(lo, hi):
            if args.impl == "new" and now >= status_at[n]:
                status_at[n] += 2.0
                worst = [n * args.per_host, BASE_COMPUTE]
                payload = {"step": step, "step_s": BASE_COMPUTE + WAIT, "wait_s": WAIT, "ranks": args.per_host,
                           "worst": worst}
                lines.append(f"{n}\t{time.monotonic():.6f}\t[h{n}] DDPLAUNCH_HOSTSTEPS_JSON {json.dumps(payload)}\n")
        if lines:
            out.write("".join(lines))
            out.flush()
        time.sleep(0.01)


def _step_lines(args: argparse.Namespace, lo: int, hi: int, step: int, slowed: bool, slow_host: int,
                slow_rank: int, rng: random.Random) -> list[str]:
    out = []
    slow_factor = 1.6 if slowed else 1.0
    step_s = BASE_COMPUTE * slow_factor + WAIT
    stamp = f"{time.monotonic():.6f}"
    if lo == 0:
        out.append(f"0\t{stamp}\t[h0:0] step={step} emulated loss={1 / step:.4f}\n")
    window_end = step > WARMUP and (step - WARMUP) % args.window == 0
    for n in range(lo, hi):
        if args.impl == "old":
            for r in range(n * args.per_host, (n + 1) * args.per_host):
                c = BASE_COMPUTE * (slow_factor if r == slow_rank else 1.0) * (1 + 0.02 * rng.random())
                payload = {"rank": r, "steps": [[step, round(step_s, 6), round(step_s - c, 6)]]}
                out.append(f"{n}\t{stamp}\t[h{n}:{r}] DDPLAUNCH_TIMING_JSON {json.dumps(payload)}\n")
        elif window_end:
            ranks = {}
            for r in range(n * args.per_host, (n + 1) * args.per_host):
                c = BASE_COMPUTE * (slow_factor if r == slow_rank else 1.0) * (1 + 0.02 * rng.random())
                ranks[str(r)] = [round(c, 6), round(step_s - c, 6), round(step_s, 6)]
            payload = {"first": step - args.window + 1, "last": step, "ranks": ranks, "silent": []}
            out.append(f"{n}\t{stamp}\t[h{n}] DDPLAUNCH_WINDOW_JSON {json.dumps(payload)}\n")
    return out


# ----------------------------------------------------------------------------- the supervisor (this process)

class Supervisor:
    """The supervisor's objects for one job launch, fed as its readers feed them."""

    def __init__(self, args: argparse.Namespace, run_dir: Path):
        self.named_at: list[float] = []
        self.hosts = [f"h{n}" for n in range(args.ranks // args.per_host)]
        from ddplaunch.output.console import Console
        from ddplaunch.output.stagelines import StageLines
        from ddplaunch.record import events as ev

        self.ev = ev
        view_cls = __import__("ddplaunch.record.view", fromlist=["RunView"]).RunView
        self.view = view_cls()
        self.log = ev.EventLog(run_dir, listeners=[self.view.add, self._heard])
        if args.impl == "new":
            from ddplaunch.record.snapshot import Snapshots
            self.log.listen(Snapshots(run_dir, self.view, self.log))
        self.log.append(ev.RunStarted("bench", "ssh", self.hosts, os.getpid(), "here"))
        self.console = Console(open(os.devnull, "w"), log=open(run_dir / "output.log", "w"), events=self.log)
        self.watch: Any = None
        if args.impl == "new":
            from ddplaunch.run.steps import StepsWatch
            plan = SimpleNamespace(nodes=[SimpleNamespace(host_label=h) for h in self.hosts])
            self.watch = StepsWatch(plan, 0.15, args.window, run_dir, self.console, self.log.append, lambda s: None)
            report = self.watch.report
        else:
            report = self._old_report(args)
        self.lines = StageLines(self.console, on_report=report)

    def _old_report(self, args: argparse.Namespace) -> Any:
        """main's run loop before issue #40: a RankSteps event per line, the judge fed per line."""
        from ddplaunch.diagnose.stragglers import StragglerJudge
        judge = StragglerJudge(args.ranks, 0.15, args.window)
        ev = self.ev

        def report(host: str, payload: Any) -> None:
            steps = [s for s in payload.steps if isinstance(s, list) and len(s) == 3]
            if steps:
                self.log.append(ev.RankSteps(host, payload.rank, int(steps[-1][0]),
                                             statistics.median(s[1] for s in steps),
                                             statistics.median(s[2] for s in steps)))
            found = judge.feed(host, payload)
            if found is not None:
                self.log.append(ev.StragglerNamed(found))
        return report

    def _heard(self, event: Any) -> None:
        if type(event).__name__ == "StragglerNamed":
            self.named_at.append(time.monotonic())


def read(pipe: Any, sup: Supervisor, delays: list[float]) -> None:
    """One reader: each line to StageLines, as a backend's reader hands it; a heartbeat's delay."""
    emit = sup.lines.emit
    for raw in pipe:
        node, sent, text = raw.rstrip("\n").split("\t", 2)
        n = int(node)
        emit(n, f"h{n}", text)
        if text == HEARTBEAT:
            delays.append(time.monotonic() - float(sent))


def top_refresh_s(run_dir: Path, view: Any, repeats: int = 5) -> float:
    """The median seconds of one `top` refresh: its table of the fold and the live status, rendered."""
    from rich.console import Console as RichConsole

    from ddplaunch.record.live import read_live
    from ddplaunch.report.top import table
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        RichConsole(file=io.StringIO(), width=160).print(table(view, read_live(run_dir), time.time()))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def supervise(args: argparse.Namespace) -> dict[str, Any]:
    if args.impl == "old":
        sys.path.insert(0, str(Path(args.old_tree).resolve()))
    else:
        sys.path.insert(0, str(ROOT))
    run_dir = Path(tempfile.mkdtemp(prefix="ddpl-bench-sup-"))
    sup = Supervisor(args, run_dir)
    hosts = args.ranks // args.per_host
    start = time.monotonic() + 1.0
    slow_rank = (hosts // 3) * args.per_host + 5
    cuts = [hosts * i // args.generators for i in range(args.generators + 1)]
    procs = [subprocess.Popen([sys.executable, __file__, "--generate", f"{lo}:{hi}", "--start", str(start),
                               "--seconds", str(args.seconds), "--step-s", str(args.step_s), "--window",
                               str(args.window), "--per-host", str(args.per_host), "--impl", args.impl,
                               "--inject-at", str(args.inject_at), "--slow-rank", str(slow_rank)],
                              stdout=subprocess.PIPE, text=True, bufsize=1 << 16)
             for lo, hi in zip(cuts, cuts[1:])]
    delays: list[float] = []
    readers = [threading.Thread(target=read, args=(p.stdout, sup, delays), daemon=True) for p in procs]
    for r in readers:
        r.start()
    if sup.watch is not None:
        sup.watch.__enter__()
    steady_from = start + min(30.0, args.seconds / 4)
    time.sleep(max(0.0, steady_from - time.monotonic()))
    cpu0, wall0, size0, beats0 = _cpu(), time.monotonic(), _size(run_dir), len(delays)
    for p in procs:
        p.wait()
    for r in readers:
        r.join()
    cpu1, wall1, size1 = _cpu(), time.monotonic(), _size(run_dir)
    if sup.watch is not None:
        sup.watch.__exit__(None, None, None)
    steady = sorted(delays[beats0:])
    inject = start + args.inject_at
    named = [t - inject for t in sup.named_at if t >= inject]
    rate = (size1 - size0) / (wall1 - wall0)
    out = {"impl": args.impl, "ranks": args.ranks, "hosts": hosts, "seconds": args.seconds,
           "cores": (cpu1 - cpu0) / (wall1 - wall0), "beats": len(steady),
           "beat_p50_s": _pct(steady, 50), "beat_p99_s": _pct(steady, 99), "beat_max_s": steady[-1] if steady else None,
           "named_s": named[0] if named else None, "named_host": sup.view.stragglers[0].host if sup.view.stragglers else None,
           "slow_host": f"h{slow_rank // args.per_host}", "log_bytes_per_s": rate,
           "log_gb_per_day_at_1000x8": rate * 86400 / 1e9 * (8192 / args.ranks),
           "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "threads": threading.active_count()}
    if args.impl == "new":
        out["top_refresh_s"] = top_refresh_s(run_dir, sup.view)
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _size(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.iterdir() if p.name == "events.jsonl")


def _pct(values: list[float], p: float) -> float | None:
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16384)
    ap.add_argument("--per-host", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--impl", choices=["new", "old"], default="new")
    ap.add_argument("--old-tree", default="/tmp/ddpl-main")
    ap.add_argument("--generators", type=int, default=4)
    ap.add_argument("--inject-at", type=float, default=60)
    ap.add_argument("--json")
    ap.add_argument("--generate", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--slow-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        generate(args)
        return
    result = supervise(args)
    print("| impl | ranks | hosts | supervisor cores | heartbeat delay p50 / p99 / max | slowed host named after "
          "| event log | per day at 1,000 x 8 | top refresh | peak RSS |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---:|")
    named = f"{result['named_s']:.1f} s ({result['named_host']})" if result["named_s"] is not None else "never"
    top = f"{result['top_refresh_s']:.2f} s" if "top_refresh_s" in result else "-"
    print(f"| {result['impl']} | {result['ranks']} | {result['hosts']} | {result['cores']:.3f} | "
          f"{_ms(result['beat_p50_s'])} / {_ms(result['beat_p99_s'])} / {_ms(result['beat_max_s'])} | {named} | "
          f"{result['log_bytes_per_s'] / 1e3:.1f} KB/s | {result['log_gb_per_day_at_1000x8']:.2f} GB | {top} | "
          f"{result['rss_mib']:.0f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def _ms(v: float | None) -> str:
    return f"{v * 1e3:.0f} ms" if v is not None else "-"


if __name__ == "__main__":
    main()
