"""Stragglers: the host whose ranks compute slower than their peers, named while training runs.

Every rank sends its step times and its waits at the gradient collectives (hostside/
steptiming.py) to its node's agent, which folds them per window of `window` steps (hostside/
fold.py): each rank's median compute and wait over the window, one part per host. In a synchronous job every rank's step lasts as long as the slowest rank's, so
step times are equal everywhere; what differs is the wait: the others wait at each collective for
the straggler, which arrives last and waits least. A rank's compute share is its step time minus
its wait. `StragglerJudge` compares, per window, each host's compute share (its slowest rank's
median: one slow GPU among a host's eight is the straggler, and the host's median would hide it)
with the same number of the other hosts (their median), and names a host whose share is
`threshold` (15 %) — or, on a noisy machine, three times the spread of its peers' — above it in
three windows in a row, with the ranks that are. Against its own level: how a
rank's share compares with its peers' when nothing is wrong differs a little by rank (its place in
the collective's algorithm: ±5 % measured for Gloo's ranks, steadily), so the median of a host's
ratios in the windows it was not slow in, as far as it is within `threshold / 3` of even, is its
level, and a host slower than that by the bar is slow (one slow from the start is named too: no
more than `threshold / 3` of its slowness can become its level). Three windows must also hold
MIN_SLOW_S (3 s) of steps: with steps of milliseconds a rank held back by a shared core for a
fraction of a second is no straggler. Pure: fed with the hosts' parts,
it returns verdicts (and the ranks gone silent, the hosts whose part never came); the run loop
shows and records them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ddplaunch.hostside.payloads import HostWindow
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
#: Seconds of its steps a host must also be slow for before it is named: with steps of a few
#: milliseconds three windows are a fraction of a second, and a rank that a shared core held back
#: that long (a Lightning job's 7 ms steps on the sim: 49 % "slower" for 0.4 s) is no straggler.
MIN_SLOW_S = 3.0


#: Seconds a window waits for every host's part before it is judged with the hosts that sent
#: theirs (a host whose agent went quiet must not hold the judge back).
LATE_S = 10.0
#: A host is quiet when no part of it came for this long, or three windows' time if longer, while
#: the other hosts send theirs: a part that comes late (a busy host) is not a quiet host.
QUIET_S = 2 * LATE_S
#: Windows kept waiting at most (the oldest is judged when more come: memory stays bounded).
MAX_PENDING = 8
#: From this many hosts on, a host's peers are every host (the host itself moves the median and the
#: spread by a hair): the window is judged in O(ranks + hosts log hosts), not O(hosts^2).
EXACT_PEERS_UP_TO = 256


@dataclass(frozen=True)
class Judged:
    """A window judged: each host's part as a few numbers — its ranks' medians of compute, wait
    and step time (the median of its ranks' medians), its slowest rank's compute."""

    first: int
    last: int
    hosts: dict[str, list[float]]


@dataclass(frozen=True)
class Quiet:
    """A host whose parts stopped coming (the last it sent ended at step `first` - 1) while the
    other hosts sent theirs up to step `last`."""

    host: str
    first: int
    last: int


@dataclass
class Verdicts:
    """What judging the waiting windows found: the windows judged, hosts newly named, ranks
    newly silent (host -> ranks), hosts newly quiet."""

    windows: list[Judged] = field(default_factory=list)
    stragglers: list[Straggler] = field(default_factory=list)
    silent: dict[str, list[int]] = field(default_factory=dict)
    missing: list[Quiet] = field(default_factory=list)


class StragglerJudge:
    """One launch's windows of steps, a part per host (`HostWindow`: every rank's median compute
    and wait over `window` steps, folded on the host by its agent). `add` them as they come;
    `judge` (on a timer, not per line) judges each window once, in order, when every host sent its
    part or LATE_S after the first did: O(ranks log ranks) per window, bounded memory."""

    def __init__(self, hosts: Sequence[str] = (), threshold: float = THRESHOLD, window: int = WINDOW):
        self.threshold, self.window = threshold, window
        self.expected = set(hosts)
        self._lock = threading.Lock()
        self._pending: dict[int, dict[str, HostWindow]] = {}  # a window's last step -> host -> its part
        self._arrived: dict[int, float] = {}  # when a window's first part came (monotonic)
        self.host_of: dict[int, str] = {}
        self.named: dict[str, Straggler] = {}
        self._slow_in: dict[str, int] = {}   # host -> the first step of the windows it is slow in
        self._slow_s: dict[str, float] = {}  # host -> the seconds of steps of those windows
        self._level: dict[str, deque[float]] = {}  # host -> its ratios to its peers when not slow
        self._judged = 0
        self._silent: set[tuple[str, int]] = set()
        self._missing: set[str] = set()
        self._heard: dict[str, tuple[float, int]] = {}  # host -> when its newest part came, its last step
        self._period = 0.0  # seconds between windows, as they come
        self._first_heard: Optional[float] = None  # when any host's first part came

    def add(self, host: str, part: HostWindow) -> None:
        """A host's part of a window (from a reader's thread)."""
        now = time.monotonic()
        with self._lock:
            self._first_heard = self._first_heard or now
            self._heard[host] = (now, max(part.last, self._heard.get(host, (now, 0))[1]))
            self._missing.discard(host)  # a host that sends again is heard again
            self.expected.add(host)
            if part.last <= self._judged:
                return  # too late to be judged, but heard
            if part.last not in self._arrived:
                if self._arrived:
                    gap = now - self._arrived[max(self._arrived)]
                    self._period = gap if not self._period else 0.8 * self._period + 0.2 * gap
                self._arrived[part.last] = now
            self._pending.setdefault(part.last, {})[host] = part

    def judge(self, now: Optional[float] = None) -> Verdicts:
        """Judge every window that is complete (or waited LATE_S), oldest first."""
        now = time.monotonic() if now is None else now
        out = Verdicts()
        with self._lock:
            for last in sorted(self._pending):
                parts = self._pending[last]
                late = now - self._arrived[last] >= LATE_S or len(self._pending) > MAX_PENDING
                if not self.expected <= set(parts) and not late:
                    break  # windows in order: a later one waits for this one
                del self._pending[last], self._arrived[last]
                self._judged = last
                self._note_silent(parts, out)
                out.windows.append(_summary(parts))
                found = self._window(parts)
                if found is not None:
                    out.stragglers.append(found)
            self._note_missing(now, out)
        return out

    def _note_missing(self, now: float, out: Verdicts) -> None:
        """Hosts that sent no part for QUIET_S (or three windows' time) while others sent parts of
        later windows (when every rank waits — a frozen rank holds the collective — every host's
        parts stop at the same window, some a moment before others: nobody is quiet then):
        O(hosts) a judgement."""
        if self._first_heard is None:
            return
        quiet_s = max(QUIET_S, 3 * self._period)
        newest = max(step for _, step in self._heard.values())
        if now - max(at for at, _ in self._heard.values()) >= quiet_s:
            return  # nobody sends: the run is between launches, or ended; not one host's silence
        for host in sorted(self.expected - self._missing):
            at, step = self._heard.get(host, (self._first_heard, 0))  # never heard: since the first part
            if now - at >= quiet_s and newest > step:  # the others went on past its last part
                self._missing.add(host)
                out.missing.append(Quiet(host, step + 1, max(newest, step + 1)))

    def _note_silent(self, parts: dict[str, HostWindow], out: Verdicts) -> None:
        for host, part in parts.items():
            new = sorted(int(r) for r in part.silent if (host, int(r)) not in self._silent)
            if new:
                self._silent |= {(host, r) for r in new}
                out.silent[host] = new

    def _window(self, parts: dict[str, HostWindow]) -> Optional[Straggler]:
        per_rank: dict[int, tuple[float, float]] = {}
        step_s: list[float] = []
        for host, part in parts.items():
            for rank, values in part.ranks.items():
                if isinstance(values, list) and len(values) >= 2:
                    per_rank[int(rank)] = (float(values[0]), float(values[1]))
                    self.host_of[int(rank)] = host
                    step_s += [float(values[2])] if len(values) >= 3 else []
        ranks_of: dict[str, list[int]] = {}
        for r in sorted(per_rank):
            ranks_of.setdefault(self.host_of[r], []).append(r)
        if len(ranks_of) < 2:
            return None
        first = min(p.first for p in parts.values())
        lasted = (max(p.last for p in parts.values()) - first + 1) * (statistics.median(step_s) if step_s else 0.0)
        # each host as one number, the same kind for all: its slowest rank's compute
        slowest = {h: max(per_rank[r][0] for r in rs) for h, rs in ranks_of.items()}
        peers = _Peers(slowest, statistics.median(w for _, w in per_rank.values()))
        found = None
        for host, ranks in sorted(ranks_of.items()):
            mine = slowest[host]
            theirs, spread = peers.of(host)
            if theirs <= 0:
                self._slow_in.pop(host, None)
                self._slow_s.pop(host, None)
                continue
            bar = (1 + max(self.threshold, NOISE_FACTOR * spread / theirs)) * theirs * self._own_level(host)
            if mine < bar:
                self._level.setdefault(host, deque(maxlen=LEVEL_WINDOWS)).append(mine / theirs)
                self._slow_in.pop(host, None)
                self._slow_s.pop(host, None)
                continue
            since = self._slow_in.setdefault(host, first)
            self._slow_s[host] = self._slow_s.get(host, 0.0) + lasted
            if first - since < (IN_A_ROW - 1) * self.window or self._slow_s[host] < MIN_SLOW_S or host in self.named \
                    or found:
                continue  # not slow long enough yet, or named already (one host named a window)
            found = Straggler(host=host, ranks=[r for r in ranks if per_rank[r][0] >= bar], slowdown=mine / theirs - 1,
                              since_step=since, named_at=time.time(), compute_s=mine, peers_compute_s=theirs,
                              peers_wait_s=peers.wait, ranks_slow={r: round(per_rank[r][0] / theirs - 1, 3) for r in ranks})
            self.named[host] = found
        return found

    def _own_level(self, host: str) -> float:
        """`host`'s share against its peers' when it was not slow, within threshold/3 of even."""
        level = self._level.get(host)
        if not level:
            return 1.0
        most = 1 + self.threshold / 3
        return min(max(statistics.median(level), 1 / most), most)


def _summary(parts: dict[str, HostWindow]) -> Judged:
    """The window as a few numbers per host: the median of its ranks' medians of compute, wait and
    step time, and its slowest rank's compute."""
    hosts = {}
    for host, part in sorted(parts.items()):
        values = [v for v in part.ranks.values() if isinstance(v, list) and len(v) >= 3]
        if values:
            hosts[host] = [round(statistics.median(float(v[i]) for v in values), 6) for i in range(3)] + \
                [round(max(float(v[0]) for v in values), 6)]
    return Judged(min(p.first for p in parts.values()), max(p.last for p in parts.values()), hosts)


class _Peers:
    """A host's peers in one window: the median of the other hosts' slowest-rank compute and its
    spread (median absolute deviation); the ranks' median wait. Exact (the host itself left out)
    up to EXACT_PEERS_UP_TO hosts; beyond, every host's, computed once for the window."""

    def __init__(self, slowest: dict[str, float], wait: float):
        self.slowest, self.wait = slowest, wait
        self.exact = len(slowest) <= EXACT_PEERS_UP_TO
        if not self.exact:
            self.all = _stats(list(slowest.values()))

    def of(self, host: str) -> tuple[float, float]:
        if not self.exact:
            return self.all
        return _stats([v for h, v in self.slowest.items() if h != host])


def _stats(values: list[float]) -> tuple[float, float]:
    median = statistics.median(values)
    return median, statistics.median(abs(v - median) for v in values)
