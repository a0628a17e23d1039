"""Folding the ranks' step timing: per window of steps (the straggler judge's unit) and per
interval (a node's status), as the node agent (agent.py) does for its ranks — and the supervisor
for ranks whose reports came as lines. Pure, standard library only; what it keeps is bounded by
ranks x a window's steps.
"""

import statistics
from typing import Any, Optional

#: A rank that said nothing this long while others report is silent.
SILENT_S = 10.0
#: Steps of an open window kept per rank at most (a rank far ahead of a silent one: bounded).
MAX_OPEN_STEPS = 4096
#: The share of a window's steps left out at each end of a rank's compute before its mean (a
#: one-off pause — a GC, a checkpoint — is one step of twenty, left out).
TRIM = 0.1


def _steps(items: list[Any]) -> list[tuple[int, float, float]]:
    """The well-formed [step, step_s, wait_s] of a report."""
    return [(int(s[0]), float(s[1]), float(s[2])) for s in items
            if isinstance(s, list) and len(s) >= 3 and all(isinstance(v, (int, float)) for v in s[:3])]


class StepWindows:
    """Each rank's steps, folded per window of `window` steps after the first `warmup` ones
    (windows end at warmup + k * window): a window is done once every reporting rank passed its
    end; then each rank's [median compute, median wait, median step time, trimmed mean compute,
    its standard error] over it. A median of steps that are each fast or held back (a busy
    machine) is the one or the other on a coin's throw; the trimmed mean moves with how often a
    rank was held back, and its standard error says how sure it is. Pure; bounded by window x
    ranks."""

    def __init__(self, window: int, warmup: int):
        self.window, self.warmup = max(1, window), max(0, warmup)
        self.steps: dict[int, dict[int, tuple[float, float]]] = {}
        self.newest: dict[int, int] = {}
        self.heard: dict[int, float] = {}
        self.started: set[int] = set()
        self.last_report = 0.0  # when any rank last reported steps
        self.next_end = self.warmup + self.window

    def start(self, rank: int, now: float) -> None:
        self.started.add(rank)
        self.heard.setdefault(rank, now)

    def add(self, rank: int, steps: list[Any], now: float) -> None:
        """A rank's report: [step, step_s, wait_s] per optimizer step."""
        self.started.add(rank)
        self.heard[rank] = self.last_report = now
        mine = self.steps.setdefault(rank, {})
        for step, step_s, wait_s in _steps(steps):
            self.newest[rank] = max(self.newest.get(rank, 0), step)
            if step > self.next_end - self.window:
                mine[step] = (step_s, wait_s)
        while len(mine) > MAX_OPEN_STEPS:
            del mine[min(mine)]

    def silent(self) -> list[int]:
        """Ranks that started and said nothing for SILENT_S before another rank's newest report."""
        return sorted(r for r in self.started if self.last_report - self.heard.get(r, self.last_report) >= SILENT_S)

    def done(self) -> list[dict[str, Any]]:
        """Every window that every reporting (not silent) rank has passed, in order."""
        out: list[dict[str, Any]] = []
        while True:
            silent = set(self.silent())
            live = [r for r in self.started if r not in silent]  # started, not yet stepped: waited for
            if not live or min(self.newest.get(r, 0) for r in live) < self.next_end:
                return out
            first, last = self.next_end - self.window + 1, self.next_end
            ranks = {}
            for r in live:
                got = [v for s, v in self.steps.get(r, {}).items() if first <= s <= last]
                if got:
                    mean, error = trimmed([t - w for t, w in got])
                    ranks[str(r)] = [round(statistics.median(t - w for t, w in got), 6),
                                     round(statistics.median(w for _, w in got), 6),
                                     round(statistics.median(t for t, _ in got), 6), round(mean, 6), round(error, 6)]
            for mine in self.steps.values():
                for s in [s for s in mine if s <= last]:
                    del mine[s]
            self.next_end += self.window
            out.append({"first": first, "last": last, "ranks": ranks, "silent": sorted(silent)})


def trimmed(values: list[float]) -> tuple[float, float]:
    """The mean of `values` without the TRIM share at each end, and its standard error (0 for
    fewer than two values kept)."""
    cut = int(len(values) * TRIM)
    kept = sorted(values)[cut:len(values) - cut] or sorted(values)
    mean = statistics.fmean(kept)
    return mean, (statistics.stdev(kept) / len(kept) ** 0.5 if len(kept) > 1 else 0.0)


class Status:
    """The node's latest steps, for the status line: per rank the steps since the last line."""

    def __init__(self) -> None:
        self.recent: dict[int, list[tuple[int, float, float]]] = {}
        #: every rank that reported: the node's ranks, not only those that stepped since the last line
        self.seen: set[int] = set()

    def add(self, rank: int, steps: list[Any]) -> None:
        self.seen.add(rank)
        mine = self.recent.setdefault(rank, [])
        mine += _steps(steps)
        del mine[:-64]

    def line(self) -> Optional[dict[str, Any]]:
        """The status since the last line (None: no rank stepped)."""
        recent = {r: v for r, v in self.recent.items() if v}
        self.recent = {}
        if not recent:
            return None
        step_s = statistics.median(t for v in recent.values() for _, t, _ in v)
        wait_s = statistics.median(w for v in recent.values() for _, _, w in v)
        compute = {r: statistics.median(t - w for _, t, w in v) for r, v in recent.items()}
        worst = max(compute, key=lambda r: compute[r])
        return {"step": max(s for v in recent.values() for s, _, _ in v), "step_s": round(step_s, 6),
                "wait_s": round(wait_s, 6), "ranks": len(self.seen), "worst": [worst, round(compute[worst], 6)]}
