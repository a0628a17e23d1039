"""Stragglers: the host whose ranks compute slower than their peers, named while training runs.

Every rank sends its step times and its waits at the gradient collectives (hostside/
steptiming.py). In a synchronous job every rank's step lasts as long as the slowest rank's, so
step times are equal everywhere; what differs is the wait: the others wait at each collective for
the straggler, which arrives last and waits least. A rank's compute share is its step time minus
its wait. `StragglerJudge` compares, over the last `window` steps every rank has reported, each
host's compute share (the median of its ranks' medians) with the median of the other hosts'
ranks, and names a host whose share is `threshold` (15 %) — or, on a noisy machine, three times
the spread of its peers' — above it in three windows in a row. Against its own level: how a
rank's share compares with its peers' when nothing is wrong differs a little by rank (its place in
the collective's algorithm: ±5 % measured for Gloo's ranks, steadily), so the median of a host's
ratios in the windows it was not slow in, as far as it is within `threshold / 3` of even, is its
level, and a host slower than that by the bar is slow (one slow from the start is named too: no
more than `threshold / 3` of its slowness can become its level). Pure: fed with payloads, it
returns verdicts; the run loop shows and records them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Optional

from ddplaunch.hostside.entry import Timing
from ddplaunch.record.incidents import Straggler

#: How much slower than its peers a host's ranks compute before it is named (documented default).
THRESHOLD = 0.15
#: Steps per window, and the windows in a row a host must be slow in before it is named.
WINDOW = 20
IN_A_ROW = 3
#: Steps left out at the start of a launch (the first steps build buckets, warm caches, and the
#: ranks' start-up work lingers: on a busy machine rank 0 ran ~25 % slower for its first 25 steps).
WARMUP = 20
#: A host must also be slower than this many times the spread of its peers (their median absolute
#: deviation): on a noisy machine (CPUs shared) the bar rises with the noise.
NOISE_FACTOR = 3.0
#: How many of a host's recent windows (those it was not slow in) make its level (see above).
LEVEL_WINDOWS = 50


class StragglerJudge:
    """One launch's per-rank timing; `feed` a rank's payload, get a newly named straggler back.
    `world_size` None (processes per node found on the host): judged once two hosts reported."""

    def __init__(self, world_size: Optional[int], threshold: float = THRESHOLD, window: int = WINDOW):
        self.world_size, self.threshold, self.window = world_size, threshold, window
        self._lock = threading.Lock()
        #: rank -> step -> (step_s, wait_s)
        self._steps: dict[int, dict[int, tuple[float, float]]] = {}
        self.host_of: dict[int, str] = {}
        self.named: dict[str, Straggler] = {}
        self._slow_in: dict[str, int] = {}   # host -> the last window end it was slow in
        self._level: dict[str, deque[float]] = {}  # host -> its ratios to its peers when not slow
        self._judged = WARMUP

    def feed(self, host: str, timing: Timing) -> Optional[Straggler]:
        """A rank's `DDPLAUNCH_TIMING_JSON` payload; the straggler it makes named, if any."""
        with self._lock:
            mine = self._steps.setdefault(timing.rank, {})
            self.host_of[timing.rank] = host
            for item in timing.steps:
                if (isinstance(item, list) and len(item) == 3 and all(isinstance(v, (int, float)) for v in item)
                        and item[0] > WARMUP):
                    mine[int(item[0])] = (float(item[1]), float(item[2]))
            return self._judge()

    def _judge(self) -> Optional[Straggler]:
        if len(self._steps) < (self.world_size or 2) or len(set(self.host_of.values())) < 2:
            return None
        newest = min(max(s, default=0) for s in self._steps.values())
        found = None
        while self._judged + self.window <= newest:  # every full window not judged yet, in order
            first, last = self._judged + 1, self._judged + self.window
            self._judged = last
            found = self._window(first, last) or found
        for steps in self._steps.values():  # keep two windows
            for s in [s for s in steps if s <= self._judged - 2 * self.window]:
                del steps[s]
        return found

    def _window(self, first: int, last: int) -> Optional[Straggler]:
        per_rank: dict[int, tuple[float, float]] = {}
        for rank, steps in self._steps.items():
            got = [steps[s] for s in range(first, last + 1) if s in steps]
            if len(got) < self.window // 2:
                return None  # a rank's report is missing: judge nothing rather than guess
            per_rank[rank] = (statistics.median(t - w for t, w in got), statistics.median(w for _, w in got))
        hosts = sorted(set(self.host_of[r] for r in per_rank))
        found = None
        for host in hosts:
            ranks = sorted(r for r in per_rank if self.host_of[r] == host)
            peers = [r for r in per_rank if self.host_of[r] != host]
            mine = statistics.median(per_rank[r][0] for r in ranks)
            theirs = statistics.median(per_rank[r][0] for r in peers)
            if theirs <= 0:
                self._slow_in.pop(host, None)
                continue
            spread = statistics.median(abs(per_rank[r][0] - theirs) for r in peers)
            bar = max(self.threshold, NOISE_FACTOR * spread / theirs)
            if mine < (1 + bar) * theirs * self._own_level(host):
                self._level.setdefault(host, deque(maxlen=LEVEL_WINDOWS)).append(mine / theirs)
                self._slow_in.pop(host, None)
                continue
            since = self._slow_in.setdefault(host, first)
            if first - since < (IN_A_ROW - 1) * self.window or host in self.named or found:
                continue  # not slow long enough yet, or named already (one host named a window)
            found = Straggler(host=host, ranks=ranks, slowdown=mine / theirs - 1, since_step=since,
                              named_at=time.time(), compute_s=mine, peers_compute_s=theirs,
                              peers_wait_s=statistics.median(per_rank[r][1] for r in peers),
                              ranks_slow={r: round(per_rank[r][0] / theirs - 1, 3) for r in ranks})
            self.named[host] = found
        return found

    def _own_level(self, host: str) -> float:
        """`host`'s share against its peers' when it was not slow, within threshold/3 of even."""
        level = self._level.get(host)
        if not level:
            return 1.0
        most = 1 + self.threshold / 3
        return min(max(statistics.median(level), 1 / most), most)
