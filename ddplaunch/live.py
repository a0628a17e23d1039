"""Live host status on a terminal: a compact table of every host's state below the log stream.

`make_sink` returns a plain `LineSink` when the output is not a terminal (CI logs, pipes, files)
and a `LiveSink` otherwise: log lines scroll as usual while rich keeps one row per host
(connecting, running a stage, exited with a code) pinned under them.
"""

from __future__ import annotations

from typing import IO, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ddplaunch.backends.base import LineSink

#: More hosts than this are summarized as counts per state instead of one row each.
MAX_ROWS = 16


class LiveSink(LineSink):
    """A LineSink that also shows every host's state, live, on a terminal."""

    def __init__(self, stream: IO[str], log: Optional[IO[str]], hosts: list[str]):
        super().__init__(stream, log)
        self.states = {h: "waiting" for h in hosts}
        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.live = Live(self._table(), console=self.console, refresh_per_second=4, transient=True)
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
                counts[s] = counts.get(s, 0) + 1
            table.add_row("hosts", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
            return table
        for host, text in self.states.items():
            style = "red" if ("failed" in text or "lost" in text or "unreachable" in text) else \
                "green" if text.startswith(("ok", "running")) else ""
            table.add_row(f"[bold]{host}[/]", f"[{style}]{text}[/]" if style else text)
        return table


def make_sink(stream: IO[str], log: Optional[IO[str]], hosts: list[str]) -> LineSink:
    """LiveSink on a terminal, plain lines otherwise."""
    if stream.isatty():
        return LiveSink(stream, log, hosts)
    return LineSink(stream, log)
