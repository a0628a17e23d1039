"""What people see of a run, and the run's log: lines to the terminal and the log file, in one place.

`Console` writes whole lines, each carrying its host, to a stream and the log file; `note` is a
line from ddplaunch itself, `block` a table or summary as it is. It only displays: what the
lines mean (payloads, findings, tails) is read per stage by `StageLines` (output/stagelines.py), which
decides what reaches the terminal — quiet by default, `verbose` shows everything — while the log
always gets every line. `make_console` adds a live host table (rich) on a terminal.

One line per cluster: the same text from many ranks (or hosts) within `FOLD_S` seconds is shown
once, with the count and who printed it — `[x6 ranks: dle0:0-1, dle1:2-3, dle2:4-5] UserWarning:
...` — so a line every rank prints does not fill the screen; the log keeps every line, `verbose`
shows them all as they come. A rank's progress bar (a line it redraws with `\r`) is one line
redrawn in place under the live table on a terminal, and elsewhere its newest state every
BAR_EVERY_S seconds and when full.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import deque
from typing import IO, Iterable, Optional, Sequence

from rich.console import Console as RichConsole
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddplaunch.output.who import OutputLine
from ddplaunch.plan.launch import Stage
from ddplaunch.record.events import EventLog, HostState, Shown
from ddplaunch.record.results import NodeState, Progress

#: More hosts than this are summarized as counts per state instead of one row each.
MAX_ROWS = 16
#: Seconds a shown line waits for the same text from other ranks before it is shown (folded).
FOLD_S = 0.5
#: Where the screen is not a terminal (a file, a pipe, CI), a rank's progress bar is shown every
#: this many seconds at most, and when it is full; a terminal redraws it in place (LiveConsole).
BAR_EVERY_S = 10.0
#: Where a bar says how far it is (`45/100`), and a full one.
BAR_AT_RE = re.compile(r"\|\s*(\S+)/(\S+) \[")
#: Progress bar lines a terminal shows live at once (the ranks that redrew theirs last; ranks at
#: the same count of the same bar are one line), and the ranks' bars kept for them.
LIVE_BARS, KEPT_BARS = 8, 1024
#: A rank's full bars remembered, so that one redrawn as it closes is not printed again.
FULL_KEPT = 4
#: A line that names hosts names this many at most, then gives their count (one line at 1,000
#: hosts; the run's files and `status --json` hold them all).
HOSTS_NAMED = 8


def hosts_named(labels: Sequence[str], most: int = HOSTS_NAMED) -> str:
    """`a, b, c`; past `most`: `a, b, ..., h, ... (1000 hosts)`."""
    if len(labels) <= most:
        return ", ".join(labels)
    return ", ".join(labels[:most]) + f", ... ({len(labels)} hosts)"


class _Fold:
    """Lines that wait to be shown, each with everyone who printed the same text meanwhile."""

    def __init__(self, first: OutputLine, at: float):
        self.first, self.at = first, at
        self.who: dict[tuple[str, Optional[int]], None] = {}  # in order; a lookup costs O(1)

    def text(self) -> str:
        if len(self.who) < 2:
            return str(self.first)
        rest = self.first.body
        ranks = [r for _, r in self.who if r is not None]
        hosts = sorted(set(h for h, _ in self.who))
        if len(ranks) == len(self.who):
            if len(hosts) > HOSTS_NAMED:  # one line for thousands of ranks stays one line
                return f"[x{len(ranks)} ranks: {rank_ranges(ranks)} on {len(hosts)} hosts] {rest}"
            by_host: dict[str, list[int]] = {}
            for host, rank in sorted(self.who, key=lambda w: w[1] or 0):
                by_host.setdefault(host, []).append(rank or 0)
            names = ", ".join(f"{h}:{rank_ranges(rs)}" for h, rs in by_host.items())
            return f"[x{len(ranks)} ranks: {names}] {rest}"
        if len(hosts) > HOSTS_NAMED:
            return f"[x{len(hosts)} hosts: {', '.join(hosts[:HOSTS_NAMED])}, ...] {rest}"
        return f"[x{len(self.who)} hosts: {', '.join(hosts)}] {rest}"


def rank_ranges(values: list[int]) -> str:
    """`0-3,5` for [0, 1, 2, 3, 5]."""
    out, start = [], None
    values = sorted(set(values))
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


class Console:
    """Lines to a stream (what is shown) and a log file (everything)."""

    def __init__(self, stream: Optional[IO[str]] = None, log: Optional[IO[str]] = None,
                 verbose: bool = False, events: Optional[EventLog] = None):
        self._stream = stream if stream is not None else sys.stdout
        self._log = log
        #: The run's event log: every line shown and every host state go there too (for `attach`).
        self._events = events
        self._lock = threading.RLock()
        self._once: set[str] = set()
        self.verbose = verbose
        #: Lines waiting to be shown, by their text without the prefix, oldest first.
        self._folds: dict[tuple[str, bool], _Fold] = {}
        self._flusher: Optional[threading.Thread] = None
        #: When each rank's progress bar was last shown, and how far it was: (host, rank) -> (monotonic time, count).
        self._bars: dict[tuple[str, Optional[int]], tuple[float, Optional[str]]] = {}
        #: Each rank's full bars shown last (their description and count).
        self._full: dict[tuple[str, Optional[int]], deque[str]] = {}

    def line(self, line: OutputLine, shown: bool, screen: Optional[OutputLine] = None) -> None:
        """One line of a host: to the log as it came, and, when `shown`, to the screen as a screen
        shows it (`screen`, default `line`; see `show`)."""
        with self._lock:
            self._logged(str(line))
            if shown:
                self.show(screen or line)

    def log(self, text: str) -> None:
        """A line from ddplaunch to the log only, as it is (not a host's: no prefix)."""
        with self._lock:
            self._logged(text)

    def show(self, line: OutputLine) -> None:
        """A line as a screen shows it, not logged (the line it came in was): after `FOLD_S`,
        once for everyone who printed the same text meanwhile; at once with `verbose`."""
        with self._lock:
            if self.verbose:
                self._show(str(line))
                return
            key = (line.body, line.rank is not None)
            by = (line.host, line.rank)
            fold = self._folds.get(key)
            if fold is not None and by in fold.who:  # the same one again: a new line, after the others
                self.flush()
                fold = None
            if fold is None:
                fold = self._folds[key] = _Fold(line, time.monotonic())
            fold.who[by] = None
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_when_due, daemon=True)
                self._flusher.start()

    def bar(self, line: OutputLine, screen: Optional[OutputLine]) -> None:
        """A rank's progress bar redrawn (`screen`: its newest state; None to log it only): to the
        log as it came; shown every BAR_EVERY_S seconds at most per rank, and when it is full."""
        with self._lock:
            found = self._bar_of(line, screen)
            if found is None or screen is None:
                return
            key, at = found
            now, (shown_at, was) = time.monotonic(), self._bars.get(key, (-BAR_EVERY_S, None))
            if at is not None and at == was:
                return  # the same count again (a bar redrawn as it closes)
            if now - shown_at >= BAR_EVERY_S or full(screen.body):
                self._bars[key] = (now, at)
                self.flush()
                self._show(str(screen))

    def _bar_of(self, line: OutputLine,
                screen: Optional[OutputLine]) -> Optional[tuple[tuple[str, Optional[int]], Optional[str]]]:
        """A bar's line logged as it came; whose it is ((host, rank)) and how far it is, when it is
        to be shown (None: to the log only)."""
        self._logged(str(line))
        if screen is None:
            return None
        who = (screen.host, screen.rank)
        m = BAR_AT_RE.search(screen.body)
        if m is None:
            return who, None
        if m.group(1) == m.group(2):  # full: shown once, though redrawn as it closes after other bars
            shown, bar = self._full.setdefault(who, deque(maxlen=FULL_KEPT)), screen.body[:m.end()]
            if bar in shown:
                return None
            shown.append(bar)
        return who, f"{m.group(1)}/{m.group(2)}"

    def progress(self, progress: Progress) -> None:
        """The job's optimizer steps as rank 0 counts them (a terminal shows them live, whatever
        the job prints: a bar hidden off a terminal, or none); nothing here, the summary says it."""

    def _logged(self, text: str) -> None:
        if self._log is not None:
            self._log.write(text + "\n")
            self._log.flush()

    def _flush_when_due(self) -> None:
        while True:
            time.sleep(0.1)
            with self._lock:
                self.flush(due_only=True)
                if not self._folds:
                    self._flusher = None
                    return

    def flush(self, due_only: bool = False) -> None:
        """Show the lines that waited (all of them, or those whose `FOLD_S` has passed), oldest first."""
        with self._lock:
            now = time.monotonic()
            for key, fold in list(self._folds.items()):
                if due_only and now - fold.at < FOLD_S:
                    break  # younger ones wait too: lines keep their order
                del self._folds[key]
                self._show(fold.text())

    def first_time(self, key: str) -> bool:
        """True the first time `key` is asked for in this run (a banner shown once)."""
        with self._lock:
            if key in self._once:
                return False
            self._once.add(key)
            return True

    def note(self, text: str) -> None:
        """A line from ddplaunch itself."""
        self.block(f"[ddplaunch] {text}")

    def block(self, text: str) -> None:
        """Lines from ddplaunch as they are (tables, summaries), after what waits to be shown."""
        with self._lock:
            self.flush()
            self._show(text.rstrip("\n"))
            if self._log is not None:
                self._log.write(text.rstrip("\n") + "\n")
                self._log.flush()

    def state(self, host: str, stage: Stage, state: NodeState, exit_code: Optional[int] = None) -> None:
        """A host's current state in a launch (connecting, running, how its node ended): to the
        event log, and shown live on a terminal by `LiveConsole`; plain output has the log lines."""
        event = HostState(host, stage, state, exit_code)
        if self._events is not None:
            self._events.append(event)
        self.show_state(event)

    def show_state(self, event: HostState) -> None:
        """Show a host's state (a follower of the event log calls this for each HostState)."""

    def close(self) -> None:
        """Show what waits; end live output, if any."""
        self.flush()

    def _show(self, text: str) -> None:
        if self._events is not None:
            self._events.append(Shown(text))
        self._write(text)

    def _write(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()


class QuietConsole(Console):
    """Shows and logs nothing: for launches whose lines only matter as data (localization probes)."""

    def line(self, line: OutputLine, shown: bool, screen: Optional[OutputLine] = None) -> None:
        pass

    def log(self, text: str) -> None:
        pass

    def show(self, line: OutputLine) -> None:
        pass

    def bar(self, line: OutputLine, screen: Optional[OutputLine]) -> None:
        pass


class LiveConsole(Console):
    """A Console that also shows every host's state, live, on a terminal."""

    def __init__(self, stream: IO[str], log: Optional[IO[str]], hosts: list[str], verbose: bool = False,
                 events: Optional[EventLog] = None):
        super().__init__(stream, log, verbose, events)
        self.states: dict[str, Optional[HostState]] = {h: None for h in hosts}
        #: each rank's newest progress bar, redrawn under the host table (the last LIVE_BARS), and
        #: the job's steps as its rank 0 counts them
        self.live_bars: dict[tuple[str, Optional[int]], OutputLine] = {}
        self.steps: Optional[Progress] = None
        self.rich = RichConsole(file=stream, highlight=False, soft_wrap=True)
        self.live = Live(self._table(), console=self.rich, refresh_per_second=4, transient=True)
        self.live.start()

    def show_state(self, event: HostState) -> None:
        with self._lock:
            self.states[event.host] = event
            self.live.update(self._live())

    def bar(self, line: OutputLine, screen: Optional[OutputLine]) -> None:
        """A rank's progress bar: one live line, redrawn in place; printed once when full."""
        with self._lock:
            found = self._bar_of(line, screen)
            if found is None or screen is None:
                return
            key, at = found
            self.live_bars.pop(key, None)
            if full(screen.body):
                if self._bars.get(key, (0.0, None))[1] != at:  # once: not again as it closes
                    self._bars[key] = (time.monotonic(), at)
                    self.flush()
                    self._show(str(screen))
            else:
                self.live_bars[key] = screen
                while len(self.live_bars) > KEPT_BARS:
                    del self.live_bars[next(iter(self.live_bars))]
            self.live.update(self._live())

    def progress(self, progress: Progress) -> None:
        with self._lock:
            self.steps = progress
            self.live.update(self._live())

    def _live(self) -> RenderableType:
        lines = [Text(steps_line(self.steps), no_wrap=True)] if self.steps is not None else []
        lines += [Text(bar, no_wrap=True, overflow="ellipsis") for bar in fold_bars(self.live_bars.values())]
        return Group(self._table(), *lines) if lines else self._table()

    def close(self) -> None:
        self.flush()
        self.live.stop()

    def _write(self, text: str) -> None:
        self.live.console.print(text, markup=False, highlight=False, emoji=False)

    def _table(self) -> Table:
        table = Table(box=None, show_header=False, pad_edge=False)
        if len(self.states) > MAX_ROWS:
            counts: dict[str, int] = {}
            for event in self.states.values():
                word = "waiting" if event is None else state_word(event)
                counts[word] = counts.get(word, 0) + 1
            table.add_row("hosts", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
            return table
        for host, event in self.states.items():
            text = "waiting" if event is None else state_text(event)
            style = "" if event is None else STATE_STYLE.get(event.state, "")
            table.add_row(f"[bold]{host}[/]", f"[{style}]{text}[/]" if style else text)
        return table


def steps_line(progress: Progress) -> str:
    """`job: step 1,240 (3.2 steps/s)`: the live line of a job's progress."""
    done = progress.last_step - progress.first_step
    rate = f" ({done / progress.training_s:.3g} steps/s)" if done > 0 and progress.training_s > 0 else ""
    return f"job: step {progress.last_step:,}{rate}"


def fold_bars(bars: Iterable[OutputLine]) -> list[str]:
    """The newest LIVE_BARS lines of `bars` (each a rank's, oldest first), the ranks at the same
    count of the same bar (its description, its count) as one: the newest of them, and how many
    more are there — `[h2:5] 45%|████ | 45/100 [00:09<00:11, 5it/s] (+7 ranks at 45/100)`. A
    node's own bar (no rank) is a line of its own."""
    groups: dict[str, list[OutputLine]] = {}
    newest: dict[str, int] = {}
    for i, bar in enumerate(bars):
        key = (bar_identity(bar.body) if bar.rank is not None else None) or str(bar)
        groups.setdefault(key, []).append(bar)
        newest[key] = i
    lines = []
    for key in sorted(groups, key=newest.__getitem__)[-LIVE_BARS:]:
        same = groups[key]
        more = len(same) - 1
        lines.append(str(same[-1]) + (f" (+{more} rank{'s' if more > 1 else ''} at {bar_at(same[-1].body)})"
                                      if more else ""))
    return lines


def bar_identity(text: str) -> Optional[str]:
    """A bar's text up to its count (`Epoch 1:  45%|████ | 45/100`): the same bar at the same
    count, whatever its times say; None when `text` is no bar."""
    m = BAR_AT_RE.search(text)
    return text[:m.end()] if m else None


def bar_at(bar: str) -> Optional[str]:
    """How far a progress bar is (`45/100`), None when it does not say."""
    m = BAR_AT_RE.search(bar)
    return f"{m.group(1)}/{m.group(2)}" if m else None


def full(bar: str) -> bool:
    """Whether a progress bar is at its end (`100/100`)."""
    m = BAR_AT_RE.search(bar)
    return m is not None and m.group(1) == m.group(2)


#: How the live table colours a host's state.
STATE_STYLE = {NodeState.FAILED: "red", NodeState.LOST: "red", NodeState.UNREACHABLE: "red",
               NodeState.OK: "green", NodeState.RUNNING: "green"}


def state_word(event: HostState) -> str:
    """One word for a host's state: `connecting`, `running`, or how its node ended."""
    return "connecting" if event.state == NodeState.NOT_STARTED else str(event.state)


def state_text(event: HostState) -> str:
    """A host's state as the live table shows it: `connecting (job)`, `running job`, `ok (exit 0)`."""
    if event.state == NodeState.NOT_STARTED:
        return f"connecting ({event.stage})"
    if event.state == NodeState.RUNNING:
        return f"running {event.stage}"
    if event.exit_code is None and event.state == NodeState.UNREACHABLE:
        return str(event.state)
    return f"{event.state} (exit {event.exit_code})"


def make_console(stream: IO[str], log: Optional[IO[str]], hosts: list[str], verbose: bool = False,
                 events: Optional[EventLog] = None) -> Console:
    """LiveConsole on a terminal, plain lines otherwise."""
    if stream.isatty():
        return LiveConsole(stream, log, hosts, verbose, events)
    return Console(stream, log, verbose, events)
