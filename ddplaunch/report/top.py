"""`ddplaunch top [RUN_ID]`: every host and rank of a run, live, from its event log.

`TopView` folds the run's events (events.py) into a table: per host its state, its ranks' newest
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Optional

from rich.console import Console as RichConsole
from rich.live import Live
from rich.table import Table

from ddplaunch.record.events import (Event, HostState, RankSteps, RecoveryStarted, RunEnded, RunStarted, StageStarted,
                                     StragglerNamed, follow, read_events)

#: Seconds between two refreshes of the table.
REFRESH_S = 1.0


@dataclass
class RankRow:
    host: str
    step: int
    step_s: float
    wait_s: float
    at: float

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.wait_s)


@dataclass
class TopView:
    """What the table shows, folded from the events so far."""

    run_id: str = ""
    hosts: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)
    ranks: dict[int, RankRow] = field(default_factory=dict)
    stragglers: dict[str, float] = field(default_factory=dict)
    recoveries: int = 0
    stage: str = ""
    ended: Optional[str] = None

    def add(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.run_id, self.hosts = event.run_id, list(event.hosts)
        elif isinstance(event, HostState):
            self.states[event.host] = event.text
            if event.host not in self.hosts:
                self.hosts.append(event.host)
        elif isinstance(event, StageStarted):
            self.stage = event.stage
            self.ranks = {} if event.stage == "job" else self.ranks  # a relaunch counts steps again
            self.hosts += [h for h in event.hosts if h not in self.hosts]
        elif isinstance(event, RankSteps):
            self.ranks[event.rank] = RankRow(event.host, event.step, event.step_s, event.wait_s, event.t)
        elif isinstance(event, StragglerNamed):
            self.stragglers[event.host] = event.slowdown
        elif isinstance(event, RecoveryStarted):
            self.recoveries += 1
        elif isinstance(event, RunEnded):
            self.ended = event.state

    def score(self, rank: int) -> Optional[float]:
        """How much longer this rank computes than the median rank (0.4: 40 % longer)."""
        if len(self.ranks) < 2:
            return None
        median = statistics.median(r.compute_s for r in self.ranks.values())
        return self.ranks[rank].compute_s / median - 1 if median > 0 else None

    def table(self, now: float) -> Table:
        title = f"run {self.run_id}: {self.ended or self.stage or 'starting'}"
        title += f", {self.recoveries} recover{'y' if self.recoveries == 1 else 'ies'}" if self.recoveries else ""
        table = Table(title=title, title_justify="left")
        for name in ("host", "state", "rank", "step", "step time", "wait", "straggler score", "last report"):
            table.add_column(name, justify="left" if name in ("host", "state") else "right")
        by_host: dict[str, list[int]] = {}
        for r in sorted(self.ranks):
            by_host.setdefault(self.ranks[r].host, []).append(r)
        for host in self.hosts + [h for h in by_host if h not in self.hosts]:
            state = self.states.get(host, "")
            if host in self.stragglers:
                state = f"{state}; STRAGGLER {self.stragglers[host]:+.0%}".lstrip("; ")
            ranks: list[Optional[int]] = [*by_host[host]] if host in by_host else [None]
            for i, rank in enumerate(ranks):
                cells = [host if i == 0 else "", state if i == 0 else ""]
                if rank is None:
                    table.add_row(*cells, "", "", "", "", "", "")
                    continue
                row, score = self.ranks[rank], self.score(rank)
                cells += [str(rank), str(row.step), f"{row.step_s * 1e3:.0f} ms",
                          f"{100 * row.wait_s / row.step_s:.0f}%" if row.step_s > 0 else "-",
                          f"{score:+.0%}" if score is not None else "-", f"{max(0.0, now - row.at):.0f}s ago"]
                table.add_row(*cells)
        return table


def top(run_dir: Path, alive: Callable[[], bool], stream: IO[str], once: bool = False) -> int:
    """Show the run's table: once, or refreshed every second until the run ends (Ctrl-C leaves)."""
    view = TopView()
    rich = RichConsole(file=stream, highlight=False, soft_wrap=True)
    if once:
        for event in read_events(run_dir):
            view.add(event)
        rich.print(view.table(time.time()))
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
                        live.update(view.table(time.time()))
                with lock:
                    live.update(view.table(time.time()))
        else:
            while not done.wait(REFRESH_S):
                with lock:
                    rich.print(view.table(time.time()))
            rich.print(view.table(time.time()))
    except KeyboardInterrupt:
        return 130
    return 0
