"""What people see of a run, and the run's log: lines to the terminal and the log file, in one place.

`Console` writes whole lines, each carrying its host, to a stream and the log file; `note` is a
line from ddplaunch itself, `block` a table or summary as it is. It only displays: what the
lines mean (payloads, findings, tails) is read per stage by `StageLines` (stagelines.py), which
decides what reaches the terminal — quiet by default, `verbose` shows everything — while the log
always gets every line. `make_console` adds a live host table (rich) on a terminal.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Optional

from rich.console import Console as RichConsole
from rich.live import Live
from rich.table import Table

#: More hosts than this are summarized as counts per state instead of one row each.
MAX_ROWS = 16


class Console:
    """Lines to a stream (what is shown) and a log file (everything)."""

    def __init__(self, stream: Optional[IO[str]] = None, log: Optional[IO[str]] = None,
                 verbose: bool = False):
        self._stream = stream if stream is not None else sys.stdout
        self._log = log
        self._lock = threading.Lock()
        self._once: set[str] = set()
        self.verbose = verbose

    def line(self, text: str, shown: bool) -> None:
        """One line of a host: to the log, and to the stream when `shown`."""
        with self._lock:
            if shown:
                self._write(text)
            if self._log is not None:
                self._log.write(text + "\n")
                self._log.flush()

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
        """Lines from ddplaunch as they are (tables, summaries)."""
        self.line(text.rstrip("\n"), shown=True)

    def state(self, host: str, text: str) -> None:
        """A host's current state (connecting, running a stage, exited): shown live on a
        terminal by `LiveConsole`; plain output has the log lines for it."""

    def close(self) -> None:
        """End live output, if any."""

    def _write(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()


class QuietConsole(Console):
    """Shows and logs nothing: for launches whose lines only matter as data (localization probes)."""

    def line(self, text: str, shown: bool) -> None:
        pass


class LiveConsole(Console):
    """A Console that also shows every host's state, live, on a terminal."""

    def __init__(self, stream: IO[str], log: Optional[IO[str]], hosts: list[str], verbose: bool = False):
        super().__init__(stream, log, verbose)
        self.states = {h: "waiting" for h in hosts}
        self.rich = RichConsole(file=stream, highlight=False, soft_wrap=True)
        self.live = Live(self._table(), console=self.rich, refresh_per_second=4, transient=True)
        self.live.start()

    def state(self, host: str, text: str) -> None:
        with self._lock:
            self.states[host] = text
            self.live.update(self._table())

    def close(self) -> None:
        self.live.stop()

    def _write(self, text: str) -> None:
        self.live.console.print(text, markup=False, highlight=False, emoji=False)

    def _table(self) -> Table:
        table = Table(box=None, show_header=False, pad_edge=False)
        if len(self.states) > MAX_ROWS:
            counts: dict[str, int] = {}
            for s in self.states.values():
                word = s.split(" (")[0]
                counts[word] = counts.get(word, 0) + 1
            table.add_row("hosts", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
            return table
        for host, text in self.states.items():
            style = "red" if ("failed" in text or "lost" in text or "unreachable" in text) else \
                "green" if text.startswith(("ok", "running")) else ""
            table.add_row(f"[bold]{host}[/]", f"[{style}]{text}[/]" if style else text)
        return table


def make_console(stream: IO[str], log: Optional[IO[str]], hosts: list[str], verbose: bool = False) -> Console:
    """LiveConsole on a terminal, plain lines otherwise."""
    if stream.isatty():
        return LiveConsole(stream, log, hosts, verbose)
    return Console(stream, log, verbose)
