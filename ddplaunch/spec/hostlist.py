"""Slurm hostlists, expanded as `scontrol show hostnames` does, bounded before they expand.

`expand_hostlist("gpu[01-03,07],cpu1")` -> gpu01, gpu02, gpu03, gpu07, cpu1; `expand_hosts` does
it for the entries of `hosts:` and `recovery.spares:` (spec/model.py), on every backend.

The grammar is Slurm's: names separated by commas; a name is literal text (letters, digits,
`. _ -`, and the `: %` of addresses) around any number of `[...]` groups of comma-separated
numbers and ranges `N-M`. A range keeps the zero padding of its first number (`[08-10]` -> 08,
09, 10); text after the last group is a suffix (as Slurm 23.02.5 and later; 22.05 refuses it).
Several groups multiply in Slurm's order: the last group varies fastest, then the first, the
second, ..., the one before the last slowest (`a[1-2]b[1-2]c[1-2]` -> a1b1c1 a1b1c2 a2b1c1
a2b1c2 a1b2c1 ...). Empty names between commas (`a,,b,`) are skipped and duplicates kept, as
Slurm does.

What Slurm refuses is refused, and so is what Slurm reads in a surprising way: reversed ranges
(`[3-1]`), a range end padded otherwise than Slurm prints it (`[1-010]`: Slurm reads 1-10), a
range without an end (`[1-]`: Slurm reads 1), signs (`[+1-2]`: Slurm pads to 01), spaces (Slurm
splits there, even inside brackets), unmatched or nested brackets (Slurm 22.05 makes names such
as `gpu]`), numbers of more than 18 digits after leading zeros (Slurm reads those past 2**64-1 as
2**64-1), names starting with `-`. Sizes are computed before anything expands: at most
`MAX_HOSTS` hosts, names of at most `MAX_NAME` characters. Every refusal is a ValueError naming
the entry, what is wrong and, where it can, the fix.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Iterator, Union

from ddplaunch.spec.yamlsafe import char_name, show

#: Hosts a hostlist, or a whole `hosts:` list, may name: Slurm's MAX_SLURM_NODES (64K), also the
#: most hosts one Slurm range may hold. Far above any cluster ddplaunch launches on.
MAX_HOSTS = 65_536
#: Characters in one host name: a DNS name's limit, as for `addr:` in spec/model.py.
MAX_NAME = 253
#: Digits (leading zeros aside) of a number: Slurm reads numbers past 2**64-1 as 2**64-1.
MAX_DIGITS = 18
#: Counts stop growing here, so a product of many huge groups stays a small integer.
_COUNT_CAP = 10 ** 24

_TEXT = re.compile(r"[A-Za-z0-9_.:%-]")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_NUMBER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class _Range:
    """One `lo-hi` of a bracket group; numbers are printed zero-padded to `width` digits."""

    lo: int
    hi: int
    width: int

    def numbers(self) -> Iterator[str]:
        return (f"{i:0{self.width}d}" for i in range(self.lo, self.hi + 1))


Group = list[_Range]
#: One comma-separated name: its literal texts and bracket groups, alternating (text, group, text, ...).
Item = list[Union[str, Group]]


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """The host names a Slurm hostlist stands for, in Slurm's order.

    Args:
        text: a hostlist such as `gpu[01-04,07],cpu1` or `rack[1-2]-node[01-08]`.
        limit: the most hosts it may name (the rest of a `hosts:` list's budget).

    Returns:
        The names, exactly as `scontrol show hostnames` prints them (duplicates kept).

    Raises:
        ValueError: a malformed hostlist, one Slurm would read in a surprising way, or one over the
            bounds; the message names the entry, the problem and, where it can, the fix.
    """
    items = [_parse_item(text, start, end) for start, end in _item_spans(text)]
    total = sum(_count(item) for item in items)
    if total > limit:
        many = f"{total} hosts" if total < _COUNT_CAP else "more than 10**24 hosts"
        raise ValueError(f"{_entry(text)}: {many}; at most {limit}"
                         + ("" if limit == MAX_HOSTS else f" more (a list names at most {MAX_HOSTS} in all)"))
    for item in items:
        longest = sum(len(p) if isinstance(p, str) else max(max(r.width, len(str(r.hi))) for r in p)
                      for p in item)
        if longest > MAX_NAME:
            raise ValueError(f"{_entry(text)}: names of up to {longest} characters; a host name has at "
                             f"most {MAX_NAME}")
    if total == 0:
        raise ValueError(f"{_entry(text)}: names no host; write a name such as gpu1 or gpu[1-4]")
    return [name for item in items for name in _names(item)]


def is_hostlist(entry: Any) -> bool:
    """Whether a `hosts:` entry is a hostlist to expand: a string with `[`, `]` or `,`, other than
    a bracketed IPv6 address such as `[::1]`."""
    ipv6 = isinstance(entry, str) and entry.startswith("[") and ":" in entry
    return isinstance(entry, str) and not ipv6 and any(c in entry for c in "[],")


def expand_hosts(entries: list[Any]) -> list[Any]:
    """A `hosts:` (or `recovery.spares:`) list with its hostlists expanded, at most MAX_HOSTS in all;
    other entries (plain names, addresses, mappings) are kept for the model to check.

    Raises:
        ValueError: from `expand_hostlist`, for the first bad entry.
    """
    out: list[Any] = []
    for entry in entries:
        if len(out) >= MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} hosts (from {show(entry, 60)!r} on); at most {MAX_HOSTS}")
        out += expand_hostlist(entry, MAX_HOSTS - len(out)) if is_hostlist(entry) else [entry]
    return out


def _entry(text: str) -> str:
    return repr(show(text))


def _item_spans(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of every non-empty comma-separated name, after checking the characters and that
    brackets pair up without nesting."""
    start, opened = 0, -1
    for i, char in enumerate(text):
        if char == "[":
            if opened >= 0:
                raise ValueError(f"{_entry(text)}: '[' inside [...] at character {i + 1}; brackets do not nest")
            opened = i
        elif char == "]":
            if opened < 0:
                raise ValueError(f"{_entry(text)}: ']' at character {i + 1} without an opening '['")
            opened = -1
        elif char == "," and opened < 0:
            if i > start:
                yield start, i
            start = i + 1
        elif char != "," and not _TEXT.fullmatch(char):
            what = "a space" if char == " " else repr(char) if char.isprintable() else char_name(char)
            raise ValueError(f"{_entry(text)}: {what} at character {i + 1}; a hostlist holds letters, "
                             "digits, . _ - : %, [ranges] and commas, nothing else")
    if opened >= 0:
        raise ValueError(f"{_entry(text)}: '[' at character {opened + 1} without a closing ']'")
    if len(text) > start:
        yield start, len(text)


def _parse_item(text: str, start: int, end: int) -> Item:
    """The texts and groups of the name text[start:end] (brackets already checked to pair up)."""
    if text[start] == "-":
        raise ValueError(f"{_entry(text)}: a host name cannot start with '-' (ssh would read it as an option)")
    for number in _NUMBER.finditer(text, start, end):
        if len(number.group().lstrip("0")) > MAX_DIGITS:
            raise ValueError(f"{_entry(text)}: the number {show(number.group(), 60)} has more than "
                             f"{MAX_DIGITS} digits (Slurm reads numbers past 2**64-1 as 2**64-1)")
    item: Item = []
    for piece in re.finditer(r"\[([^\]]*)\]|[^\[]+", text[start:end]):
        if piece.group(1) is None:
            item.append(piece.group())
        else:
            item.append(_parse_group(text, start + piece.start(1), piece.group(1)))
    return item


def _parse_group(text: str, offset: int, inside: str) -> Group:
    """The ranges of one `[...]` whose content `inside` starts at text[offset]."""
    if not inside:
        raise ValueError(f"{_entry(text)}: empty brackets []; write a number or range in them, e.g. [1-4]")
    group: Group = []
    at = offset
    for part in inside.split(","):
        group.append(_parse_range(text, at, part))
        at += len(part) + 1
    return group


def _parse_range(text: str, at: int, part: str) -> _Range:
    """One `N` or `N-M` (`part`, found at text[at]) of a bracket group, checked as Slurm would read it."""
    def fixed(new: str) -> str:
        return repr(show(text[:at] + new + text[at + len(part):]))

    if not part:
        raise ValueError(f"{_entry(text)}: an empty range between commas in brackets; remove the extra ','")
    match = _RANGE.fullmatch(part)
    if part.endswith("-") and _NUMBER.fullmatch(part[:-1]):
        raise ValueError(f"{_entry(text)}: range {part!r} has no end (Slurm reads it as {part[:-1]}); "
                         f"write {fixed(part[:-1])} or {fixed(part + 'N')}")
    if not match:
        raise ValueError(f"{_entry(text)}: {show(part, 60)!r} in brackets is not a number or a range "
                         "of numbers (N or N-M, digits only)")
    lo_s, hi_s = match.group(1), match.group(2) or match.group(1)
    lo, hi, width = int(lo_s), int(hi_s), len(lo_s)
    if lo > hi:
        raise ValueError(f"{_entry(text)}: range {part} runs backwards; write {fixed(f'{hi_s}-{lo_s}')}")
    if f"{hi:0{width}d}" != hi_s:
        wide = max(width, len(hi_s))
        fixes = dict.fromkeys([fixed(f"{lo_s}-{hi:0{width}d}"), fixed(f"{lo:0{wide}d}-{hi:0{wide}d}")])
        raise ValueError(f"{_entry(text)}: range {part} pads its ends differently (Slurm pads every number "
                         f"to the width of {lo_s}: {lo_s}-{hi:0{width}d}); write {' or '.join(fixes)}")
    return _Range(lo, hi, width)


def _count(item: Item) -> int:
    """How many names `item` stands for, computed without expanding it; at most `_COUNT_CAP`."""
    count = 1
    for piece in item:
        if not isinstance(piece, str):
            count = min(_COUNT_CAP, count * min(_COUNT_CAP, sum(r.hi - r.lo + 1 for r in piece)))
    return count


def _names(item: Item) -> Iterator[str]:
    """The names of one item, in Slurm's order: its `_push_range_list` loops over the group before
    the last outermost, then the one before that, ..., the first, and the last group innermost."""
    groups = [p for p in item if not isinstance(p, str)]
    order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1] if groups else []
    numbers = [[n for r in groups[g] for n in r.numbers()] for g in order]
    for combo in itertools.product(*numbers):
        chosen = iter([dict(zip(order, combo))[g] for g in range(len(groups))])
        yield "".join(p if isinstance(p, str) else next(chosen) for p in item)
