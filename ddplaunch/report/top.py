"""`ddplaunch top [RUN_ID]`: every host and rank of a run, live, from its event log.

`table` renders the fold of the run's events (record/view.py): per host its state, its ranks' newest
step, step time and share of it spent waiting at the collectives, their straggler score (how much
longer they compute than the median rank), when they last reported, the run's recoveries and a
host named a straggler. `top` replays the log and refreshes the table each second until the run
ends (on a terminal a live table, elsewhere one table per refresh); `--once` prints it once.
Reads the log only: it works the same for a run in the foreground, detached, or over.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import IO, Callable, Optional

from rich.console import Console as RichConsole
from rich.live import Live
from rich.table import Table

from ddplaunch.output.console import state_text
from ddplaunch.record.events import RankSteps, follow, read_events
from ddplaunch.record.view import RunView

#: Seconds between two refreshes of the table.
REFRESH_S = 1.0


def score(view: RunView, rank: int) -> Optional[float]:
    """How much longer this rank computes than the median rank (0.4: 40 % longer)."""
    if len(view.ranks) < 2:
        return None
    median = statistics.median(_compute_s(r) for r in view.ranks.values())
    return _compute_s(view.ranks[rank]) / median - 1 if median > 0 else None


def _compute_s(steps: RankSteps) -> float:
    return max(0.0, steps.step_s - steps.wait_s)


def table(view: RunView, now: float) -> Table:
    """The table: a row per rank under its host (a host with no rank reporting: one row)."""
    stage = view.running.stage if view.running is not None else view.launches[-1].started.stage \
        if view.launches else None
    title = f"run {view.run_id}: {view.ended.state if view.ended else stage or 'starting'}"
    n = len(view.recoveries)
    title += f", {n} recover{'y' if n == 1 else 'ies'}" if n else ""
    out = Table(title=title, title_justify="left")
    for name in ("host", "state", "rank", "step", "step time", "wait", "straggler score", "last report"):
        out.add_column(name, justify="left" if name in ("host", "state") else "right")
    by_host: dict[str, list[int]] = {}
    for r in sorted(view.ranks):
        by_host.setdefault(view.ranks[r].host, []).append(r)
    named = {s.host: s.slowdown for s in view.stragglers}
    hosts = list(dict.fromkeys([*view.hosts, *view.host_states, *by_host]))
    for host in hosts:
        event = view.host_states.get(host)
        state = state_text(event) if event is not None else ""
        if host in named:
            state = f"{state}; STRAGGLER {named[host]:+.0%}".lstrip("; ")
        ranks: list[Optional[int]] = [*by_host[host]] if host in by_host else [None]
        for i, rank in enumerate(ranks):
            cells = [host if i == 0 else "", state if i == 0 else ""]
            if rank is None:
                out.add_row(*cells, "", "", "", "", "", "")
                continue
            row, rank_score = view.ranks[rank], score(view, rank)
            cells += [str(rank), str(row.step), f"{row.step_s * 1e3:.0f} ms",
                      f"{100 * row.wait_s / row.step_s:.0f}%" if row.step_s > 0 else "-",
                      f"{rank_score:+.0%}" if rank_score is not None else "-", f"{max(0.0, now - row.t):.0f}s ago"]
            out.add_row(*cells)
    return out


def top(run_dir: Path, alive: Callable[[], bool], stream: IO[str], once: bool = False) -> int:
    """Show the run's table: once, or refreshed every second until the run ends (Ctrl-C leaves)."""
    view = RunView()
    rich = RichConsole(file=stream, highlight=False, soft_wrap=True)
    if once:
        for event in read_events(run_dir):
            view.add(event)
        rich.print(table(view, time.time()))
        return 0
    lock, done = threading.Lock(), threading.Event()

    def consume() -> None:
        for event in follow(run_dir, alive):
            with lock:
                view.add(event)
        done.set()
    threading.Thread(target=consume, name="ddplaunch-top", daemon=True).start()
    try:
        if stream.isatty():
            with Live(console=rich, refresh_per_second=2, transient=False) as live:
                while not done.wait(REFRESH_S):
                    with lock:
                        live.update(table(view, time.time()))
                with lock:
                    live.update(table(view, time.time()))
        else:
            while not done.wait(REFRESH_S):
                with lock:
                    rich.print(table(view, time.time()))
            rich.print(table(view, time.time()))
    except KeyboardInterrupt:
        return 130
    return 0
