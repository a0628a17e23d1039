"""Slurm's hostlist syntax, expanded without asking Slurm: `gpu[01-04,07],cpu1` -> gpu01 ... gpu04,
gpu07, cpu1 (zero padding kept). Used for `hosts:` on every backend."""

from __future__ import annotations

import re


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax without asking Slurm: `gpu[01-04,07],cpu1` -> gpu01..gpu04, gpu07, cpu1
    (zero padding kept). Used for `hosts:` on every backend."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        out += _expand_one(part.strip())
    return [h for h in out if h]


def _expand_one(part: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if not m:
        return [part]
    head, tail = part[:m.start()], part[m.end():]
    names = []
    for rng in m.group(1).split(","):
        lo, _, hi = rng.partition("-")
        if hi:
            width = len(lo) if lo.startswith("0") else 0
            names += [f"{head}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
        else:
            names.append(f"{head}{lo}")
    return [n + rest for n in names for rest in _expand_one(tail)]
