"""What of a node's output line reaches the screen: pure text handling, no I/O.

A node's line is not always one line of one rank. torchrun copies each rank's output as it comes,
so a rank's partial line (a progress bar redrawn with `\\r`, never ended by a newline) is followed,
in the same line, by that rank's or another rank's next output, each with its own `[host:rank] `
prefix; the node's shell heartbeat lands after a partial line too. `pieces` cuts a line where a
rank's prefix begins inside it, and gives each piece the text a terminal would show: the last
`\\r`-segment that holds anything, without ANSI sequences (cursor moves, colours, titles) or other
control characters; a piece of nothing but padding shows nothing. A piece that was rewritten with
`\\r`, or has a progress bar's shape (torchrun passes each redraw on as a line of its own), is a
progress bar: its redraws are one live line, not a stream of lines. Text written after a whole bar
before its next redraw (a logger's warning: the bar never ended its line) is a line of its own.
PyTorch's C++ log prefix (`[rank1]:[W1205 20:57:37.174484652 reducer.cpp:1529] `) is shown as
`[W reducer.cpp:1529] `: the rank is the line's own prefix, and without the time the same warning
from every rank is one folded line. The log keeps each piece as it came.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ddplaunch.output.who import prefix_at, rank_starts

#: A progress bar's redraw by its shape, for redraws that arrive as lines of their own (torchrun
#: reads a rank's output with universal newlines: its `\r` ends a line): tqdm's (Hugging Face's
#: Trainer, Lightning's) `45%|████▌     | 45/100 [00:01<00:01, 40.1it/s]`, or `123it [00:01, 95.2it/s]`
#: without a total.
BAR_RE = re.compile(r"\d{1,3}%\|[^|]*\|\s*\S+/\S+ \[|\b\d+(?:\.\d+)?[kMGT]?(?:it|B) \[\d+:\d{2}")
#: A whole tqdm bar at the start of a redraw, its description included, to the `]` that closes its
#: times and rate: what follows was written after it (with no newline between).
WHOLE_BAR_RE = re.compile(r"^[^|\[]*\d{1,3}%\|[^|]*\|\s*\S+/\S+ \[[^\]]*\]")
#: PyTorch's C++ log prefix: rank, severity, date and time (and a thread id), file:line.
TORCH_LOG_RE = re.compile(r"^(?:\[rank\d+\]:)?\[([DIWEF])\d{4} \d{2}:\d{2}:\d{2}\.\d+ (?:\d+ )?([^\]\s]+)\] ")
#: ANSI escape sequences: CSI (cursor moves, erase, colours), OSC (window titles), and the two-byte ones.
ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]?")
#: Control characters a screen line never carries (tabs stay; `\r` is handled before), C1 and
#: Unicode's line separators included: a terminal or a reader would break the line there.
CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


@dataclass(frozen=True)
class Piece:
    """One part of a node's line: the rank whose `[host:rank] ` began it (None: the node's own
    text), the rest as it came (for the log), what a screen shows of it ("" when nothing), whether
    it was a redraw (`\\r`: a progress bar), and the line a screen shows of what was written
    after a whole bar ("" when nothing). A node's own text keeps a `[host] ` it started with."""

    rank: Optional[int]
    raw: str
    shown: str
    bar: bool
    after: str = ""


def pieces(line: str, host: str) -> list[Piece]:
    """`line` (one line a node printed, without its newline) cut before every `[host:rank] ` that
    begins inside it (torchrun's prefix of this node's ranks), each piece with its screen text.
    The prefixes are found and read by output/who.py."""
    bounds = [0, *rank_starts(line, host), len(line)]
    return [_piece(line[a:b], host) for a, b in zip(bounds, bounds[1:]) if line[a:b]]


def _piece(raw: str, host: str) -> Piece:
    rank, length = prefix_at(raw, host) or (None, 0)
    head, body = "" if rank is not None else raw[:length], raw[length:]
    segments = [screen_text(s) for s in body.split("\r")]
    last = next((s for s in reversed(segments) if s.strip()), "")
    bar = WHOLE_BAR_RE.match(last)
    after = last[bar.end():].strip() if bar else ""
    if bar and after:
        last = last[:bar.end()]
    last = TORCH_LOG_RE.sub(r"[\1 \2] ", last)
    after = TORCH_LOG_RE.sub(r"[\1 \2] ", after)
    return Piece(rank, body if rank is not None else raw, head + last if last else "",
                 "\r" in body or BAR_RE.search(last) is not None, head + after if after else "")


def screen_text(text: str) -> str:
    """`text` as a terminal line shows it: no ANSI sequences or control characters, no trailing padding."""
    return CONTROL_RE.sub("", ANSI_RE.sub("", text)).rstrip()
