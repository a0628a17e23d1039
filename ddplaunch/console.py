"""Console output of a run: every host's lines, to the terminal and the run's log, in one place.

`LineSink` writes whole lines, each carrying its host, to a stream and the log file; it keeps
each node's and each rank's last lines for the summary, the machine-readable payload lines
(`DDPLAUNCH_<NAME>_JSON {...}`, logged but never shown), findings worth repeating, and the clock
of the hang watchdog. Quiet by default: torchrun's banner once, nothing from hosts ddplaunch is
stopping on purpose; `verbose` shows everything. The log always has every line.
`make_sink` adds a live host table (rich) on a terminal.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from typing import IO, Any, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ddplaunch.torchrun_logs import FINDING_RE, MAX_FINDINGS, NOISE_RE, PAYLOAD_RE, rank_of

TAIL_LINES = 40
#: More hosts than this are summarized as counts per state instead of one row each.
MAX_ROWS = 16


class LineSink:
    """Lines from every node to a stream and a log file.

    torchrun prefixes worker lines with `[host:rank] ` itself; lines of torchrun or the shell
    get `[host] ` here, so every line says where it came from.
    """

    def __init__(self, stream: Optional[IO[str]] = None, log: Optional[IO[str]] = None,
                 verbose: bool = False):
        self._stream = stream if stream is not None else sys.stdout
        self._log = log
        self._lock = threading.Lock()
        self._tails: dict[int, deque[str]] = {}
        self._rank_tails: dict[int, deque[str]] = {}
        self._muted: set[int] = set()
        #: Nodes whose torchrun agent began its own error report (the summary has the cause).
        self._agent_failing: set[int] = set()
        self._banner_shown = False
        self.verbose = verbose
        #: Payloads of `DDPLAUNCH_<NAME>_JSON {...}` lines, by NAME: the last one, and all of them.
        self.payloads: dict[str, str] = {}
        self.all_payloads: dict[str, list[str]] = {}
        #: When the last line from any node arrived (the hang watchdog's clock), and from any rank.
        self.last_line_at = time.time()
        self.last_rank_line_at: Optional[float] = None
        #: Lines matching FINDING_RE, in arrival order (at most MAX_FINDINGS).
        self.findings: list[str] = []

    def emit(self, node_rank: int, host: str, line: str) -> None:
        line = line.rstrip("\r\n")
        if not line.startswith(f"[{host}:"):
            line = f"[{host}] {line}"
        marker = PAYLOAD_RE.search(line)
        with self._lock:
            self.last_line_at = time.time()
            if FINDING_RE.search(line) and len(self.findings) < MAX_FINDINGS:
                self.findings.append(line)
            if marker:  # machine-readable: kept and logged, not shown on the console
                self.payloads[marker.group(1)] = marker.group(2)
                self.all_payloads.setdefault(marker.group(1), []).append(marker.group(2))
            else:
                self._tails.setdefault(node_rank, deque(maxlen=TAIL_LINES)).append(line)
                ranked = rank_of(line)
                if ranked is not None:
                    self.last_rank_line_at = self.last_line_at
                    self._rank_tails.setdefault(ranked[1], deque(maxlen=TAIL_LINES)).append(line)
                if self._shown(node_rank, line):
                    self._write(line)
            if self._log is not None:
                self._log.write(line + "\n")
                self._log.flush()

    def _shown(self, node_rank: int, line: str) -> bool:
        if self.verbose:
            return True
        if node_rank in self._muted:
            return False
        if line.endswith("] ") and line.count("[") == 1 and ":" not in line:  # a blank line of torchrun's
            return False
        if rank_of(line) is None:  # torchrun's own lines (the agent): its failure report stays in the log
            if node_rank in self._agent_failing:
                return False
            if "Traceback (most recent call last)" in line or "ChildFailedError" in line:
                self._agent_failing.add(node_rank)
                return False
        if NOISE_RE.search(line):
            if "OMP_NUM_THREADS" in line and not self._banner_shown:
                self._banner_shown = True
                return True
            return False
        return True

    def new_launch(self) -> None:
        """A new launch begins: node numbers name other hosts now, so nothing stays muted."""
        with self._lock:
            self._muted.clear()
            self._agent_failing.clear()

    def mute(self, node_ranks: set[int]) -> None:
        """Keep these nodes' further lines off the terminal (ddplaunch is stopping them on
        purpose: their SignalException tracebacks belong in the log, not on screen)."""
        with self._lock:
            self._muted |= node_ranks

    def note(self, text: str) -> None:
        """A line from ddplaunch itself."""
        self.block(f"[ddplaunch] {text}")

    def block(self, text: str) -> None:
        """Lines from ddplaunch as they are (tables, summaries)."""
        text = text.rstrip("\n")
        with self._lock:
            self._write(text)
            if self._log is not None:
                self._log.write(text + "\n")
                self._log.flush()

    def payload(self, name: str) -> Optional[dict[str, Any]]:
        """The last `DDPLAUNCH_<NAME>_JSON` payload, parsed (None if absent or not valid JSON)."""
        raw = self.payloads.get(name)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def payload_list(self, name: str) -> list[dict[str, Any]]:
        """Every `DDPLAUNCH_<NAME>_JSON` payload seen, parsed (invalid ones skipped)."""
        out = []
        for raw in self.all_payloads.get(name, []):
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        return out

    def state(self, host: str, text: str) -> None:
        """A host's current state (connecting, running a stage, exited): shown live on a
        terminal by `LiveSink`; plain output has the log lines for it."""

    def close(self) -> None:
        """End live output, if any."""

    def _write(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()

    def tail(self, node_rank: int) -> list[str]:
        with self._lock:
            return list(self._tails.get(node_rank, ()))

    def rank_tail(self, rank: int) -> list[str]:
        """The last lines of one global rank (its own output, from torchrun's `[host:rank]` prefix)."""
        with self._lock:
            return list(self._rank_tails.get(rank, ()))


class LiveSink(LineSink):
    """A LineSink that also shows every host's state, live, on a terminal."""

    def __init__(self, stream: IO[str], log: Optional[IO[str]], hosts: list[str], verbose: bool = False):
        super().__init__(stream, log, verbose)
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
                word = s.split(" (")[0]
                counts[word] = counts.get(word, 0) + 1
            table.add_row("hosts", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
            return table
        for host, text in self.states.items():
            style = "red" if ("failed" in text or "lost" in text or "unreachable" in text) else \
                "green" if text.startswith(("ok", "running")) else ""
            table.add_row(f"[bold]{host}[/]", f"[{style}]{text}[/]" if style else text)
        return table


def make_sink(stream: IO[str], log: Optional[IO[str]], hosts: list[str], verbose: bool = False) -> LineSink:
    """LiveSink on a terminal, plain lines otherwise."""
    if stream.isatty():
        return LiveSink(stream, log, hosts, verbose)
    return LineSink(stream, log, verbose)
