"""Who printed a line: the one reader of the `[host:rank] ` prefix torchrun puts on every worker
line (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, set by the plan) and the `[host] ` ddplaunch puts on a
node's own lines (torchrun's agent, the shell). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_WHO_RE = re.compile(r"^\[([^\]:]+)(?::(\d+))?\] ?(.*)$", re.S)


@dataclass(frozen=True)
class Who:
    """A line's host, its global rank (None: the node's own line, not a worker's) and its text."""

    host: str
    rank: Optional[int]
    text: str


def who_of(line: str) -> Optional[Who]:
    """Who printed `line`, None for a line without a prefix."""
    m = _WHO_RE.match(line)
    if m is None:
        return None
    return Who(m.group(1), int(m.group(2)) if m.group(2) is not None else None, m.group(3))


def rank_of(line: str) -> Optional[tuple[str, int]]:
    """(host, global rank) of a worker line, None for torchrun's or the shell's own lines."""
    who = who_of(line)
    return (who.host, who.rank) if who is not None and who.rank is not None else None


def without_rank(line: str) -> str:
    """A worker line's text without its `[host:rank] ` prefix (other lines as they are)."""
    who = who_of(line)
    return who.text if who is not None and who.rank is not None else line
