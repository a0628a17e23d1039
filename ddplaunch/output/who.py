"""Who printed a line: the one reader and the one renderer of the `[host:rank] ` prefix torchrun
puts on every worker line (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, set by the plan) and of the
`[host] ` ddplaunch puts on a node's own lines (torchrun's agent, the shell).

A node's line is read once, where it comes in (output/stagelines.py), into an `OutputLine`; every
later reader uses its fields, and `str(line)` renders it for the screen and the log. `read_line`
reads a rendered line back where only the text is left (the run's log file). Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

_LINE_RE = re.compile(r"^\[([^\]:]+)(?::(\d+))?\] ?(.*)$", re.S)


@dataclass(frozen=True)
class OutputLine:
    """One line a node printed: its host (the plan's label), its node rank (None: read back from
    the log, which does not say it), the global rank whose line it is (None: the node's own line,
    not a worker's) and its body: what was printed, without the prefix (the job's words, or
    torchrun's and PyTorch's: output/torchrun.py reads those)."""

    host: str
    node: Optional[int]
    rank: Optional[int]
    body: str

    def __str__(self) -> str:
        """The line as the screen and the log show it: `[host:rank] body`, or `[host] body`."""
        return prefix(self.host, self.rank) + self.body

    def with_body(self, body: str) -> OutputLine:
        """The same host, node and rank printing `body`."""
        return replace(self, body=body)


def prefix(host: str, rank: Optional[int] = None) -> str:
    """`[host:rank] ` for a rank's line, `[host] ` for the node's own."""
    return f"[{host}] " if rank is None else f"[{host}:{rank}] "


def rank_starts(line: str, host: str) -> list[int]:
    """Where a `[host:rank] ` of this node's ranks begins inside `line`, after its start (torchrun
    copies a rank's partial line, then the next output, into one line). String search, no
    pattern per host: a thousand hosts' patterns would not stay compiled."""
    out, at = [], line.find(f"[{host}:", 1)
    while at > 0:
        if prefix_at(line[at:], host) is not None:
            out.append(at)
        at = line.find(f"[{host}:", at + 1)
    return out


def prefix_at(text: str, host: str) -> Optional[tuple[Optional[int], int]]:
    """The rank (None for `[host] `) and the length of the `[host:rank] ` or `[host] ` that `text`
    starts with; None when it starts with neither."""
    if not text.startswith(f"[{host}"):
        return None
    end = text.find("] ", len(host) + 1)
    if end < 0:
        return None
    middle = text[len(host) + 1:end]
    if middle == "":
        return None, end + 2
    if middle[:1] == ":" and middle[1:].isdecimal():
        return int(middle[1:]), end + 2
    return None


def read_line(line: str) -> Optional[OutputLine]:
    """A rendered line read back (from the run's log: its node is not known); None without a prefix."""
    m = _LINE_RE.match(line)
    if m is None:
        return None
    return OutputLine(m.group(1), None, int(m.group(2)) if m.group(2) is not None else None, m.group(3))
