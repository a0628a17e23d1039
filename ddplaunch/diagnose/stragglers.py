"""Stragglers: the host whose ranks compute slower than their peers, named while training runs.

Every rank sends its step times and its waits at the gradient collectives (hostside/
steptiming.py) to its node's agent, which folds them per window of `window` steps (hostside/
fold.py): each rank's compute and wait over the window, one part per host. In a synchronous job
every rank's step lasts as long as the slowest rank's, so step times are equal everywhere; what
differs is the wait: the others wait at each collective for the straggler, which arrives last and
waits least. A rank's compute share is its step time minus its wait. `StragglerJudge` compares,
per window, each host's compute share (its slowest rank's: one slow GPU among a host's eight is
the straggler, and the host's median would hide it; the trimmed mean of its steps, not their
median, which on a busy machine is a fast step or a held-back one on a coin's throw) with the
same number of the other hosts (their median). A host is slow in a window when it is

- `threshold` (15 %) — or, on a noisy machine, three times the spread of its peers' — above it,
  against its own level (how a rank's share compares with its peers' when nothing is wrong
  differs a little by rank: its place in the collective's algorithm, ±5 % measured for Gloo's
  ranks, steadily; the median of a host's ratios in the windows it was not slow in, as far as it
  is within `threshold / 3` of even: a host slow from the start is named too);
- surely so: its extra compute is SURE (3) standard errors of the difference or more (the steps'
  own spread within the window: a window of steps that vary by a factor of four proves less
  than one of steady steps);
- and waited for: its peers wait at least WAIT_SHARE (half) of its extra compute a step (a rank
  "slower" that nobody waits for is the windows' statistics, not a straggler).

It is named once slow in IN_A_ROW (2) windows in a row that hold MIN_SLOW_S (15 s) of steps: a
rank held back by a shared core or a burst of load on the machine for a few seconds, or paused
by a GC or a checkpoint, is no straggler (issue #55: a healthy host named after 5 s of a busy
machine). O(hosts) a window beside reading the parts, nothing per rank per second. Pure: fed with
the hosts' parts, it returns verdicts (and the ranks gone silent, the hosts whose part never
came); the run loop shows and records them.
"""

from __future__ import annotations

import math
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
#: Steps per window, and the windows in a row a host must be slow in before it is named (with
#: MIN_SLOW_S: a second window confirms the first; where a slow host's steps are long, as on a
#: busy machine, three windows of 20 were 36 s of ~600 ms steps).
WINDOW = 20
IN_A_ROW = 2
#: Steps left out at the start of a launch (the first steps build buckets, warm caches, and the
#: ranks' start-up work lingers: on a busy machine rank 0 ran ~25 % slower for its first 25 steps).
WARMUP = 20
#: A host must also be slower than this many times the spread of its peers (their median absolute
#: deviation): on a noisy machine (CPUs shared) the bar rises with the noise.
NOISE_FACTOR = 3.0
#: How many of a host's recent windows (those it was not slow in) make its level (see above).
LEVEL_WINDOWS = 50
#: Seconds of its steps a host must also be slow for before it is named: with steps of a few
#: milliseconds two windows are a fraction of a second, and a rank that a shared core held back
#: that long (a Lightning job's 7 ms steps on the sim: 49 % "slower" for 0.4 s), or a burst of
#: load on the machine for several seconds, is no straggler. A host at a quarter of its CPU makes
#: every step slow: three of its windows took ~15 s on a quiet sim, two 24 s on a busy one.
MIN_SLOW_S = 15.0
#: A slow window must also be sure: the host's compute over its peers' by this many standard
#: errors of the difference (the steps' own spread within the window, fold.py), ...
SURE = 3.0
#: ... and its peers must wait for it: their median wait at least this share of its extra compute
#: (in a synchronous job every other rank waits for the slowest; "slower" that nobody waits for is
#: the windows' statistics, not a straggler).
WAIT_SHARE = 0.5


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

    def __init__(self, hosts: Sequence[str] = (), threshold: float = THRESHOLD, window: int = WINDOW,
                 min_slow_s: float = MIN_SLOW_S):
        self.threshold, self.window, self.min_slow_s = threshold, window, min_slow_s
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
        ranks = _Ranks(parts, self.host_of)
        if len(ranks.of) < 2:
            return None
        first = min(p.first for p in parts.values())
        lasted = (max(p.last for p in parts.values()) - first + 1) * ranks.step_s
        peers = _Peers(ranks.hosts)
        found = None
        for host, mine in sorted(ranks.hosts.items()):
            theirs = peers.of(host)
            if theirs.compute <= 0:
                self._forget(host)
                continue
            bar = (1 + max(self.threshold, NOISE_FACTOR * theirs.spread / theirs.compute)) * theirs.compute \
                * self._own_level(host)
            if mine.compute < bar:
                self._level.setdefault(host, deque(maxlen=LEVEL_WINDOWS)).append(mine.compute / theirs.compute)
                self._forget(host)
                continue
            extra = mine.compute - theirs.compute
            if extra < SURE * math.hypot(mine.error, theirs.error) or theirs.wait < WAIT_SHARE * extra:
                self._forget(host)  # slower by chance (the steps' own spread), or nobody waits for it
                continue
            since = self._slow_in.setdefault(host, first)
            self._slow_s[host] = self._slow_s.get(host, 0.0) + lasted
            if first - since < (IN_A_ROW - 1) * self.window or self._slow_s[host] < self.min_slow_s \
                    or host in self.named or found:
                continue  # not slow long enough yet, or named already (one host named a window)
            found = Straggler(host=host, ranks=[r for r in ranks.of[host] if ranks.compute[r] >= bar],
                              slowdown=mine.compute / theirs.compute - 1, since_step=since, named_at=time.time(),
                              compute_s=mine.compute, peers_compute_s=theirs.compute, peers_wait_s=theirs.wait,
                              ranks_slow={r: round(ranks.compute[r] / theirs.compute - 1, 3) for r in ranks.of[host]})
            self.named[host] = found
        return found

    def _forget(self, host: str) -> None:
        """`host` is not slow in this window: its run of slow windows ends."""
        self._slow_in.pop(host, None)
        self._slow_s.pop(host, None)

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


@dataclass(frozen=True)
class _Host:
    """A host in one window: its slowest rank's compute a step (the trimmed mean where the agent
    sent it, else the median) and that number's standard error; its ranks' median wait."""

    compute: float
    error: float
    wait: float


class _Ranks:
    """A window's parts read once: each rank's compute, the ranks of each host, each host as a
    `_Host`, and the median step time."""

    def __init__(self, parts: dict[str, HostWindow], host_of: dict[int, str]):
        self.compute: dict[int, float] = {}
        error: dict[int, float] = {}
        wait: dict[int, float] = {}
        step_s: list[float] = []
        for host, part in parts.items():
            for rank, values in part.ranks.items():
                if isinstance(values, list) and len(values) >= 2:
                    r = int(rank)
                    sure = len(values) >= 5  # the agent's trimmed mean and its error (fold.py)
                    self.compute[r] = float(values[3] if sure else values[0])
                    error[r] = float(values[4]) if sure else 0.0
                    wait[r] = float(values[1])
                    host_of[r] = host
                    step_s += [float(values[2])] if len(values) >= 3 else []
        self.of: dict[str, list[int]] = {}
        for r in sorted(self.compute):
            self.of.setdefault(host_of[r], []).append(r)
        self.hosts: dict[str, _Host] = {}
        for host, rs in self.of.items():
            slowest = max(rs, key=lambda r: self.compute[r])
            self.hosts[host] = _Host(self.compute[slowest], error[slowest], statistics.median(wait[r] for r in rs))
        self.step_s = statistics.median(step_s) if step_s else 0.0


@dataclass(frozen=True)
class _Theirs:
    """A host's peers in one window: the median of their computes, its spread (median absolute
    deviation), the median of their errors and of their waits."""

    compute: float
    spread: float
    error: float
    wait: float


class _Peers:
    """A host's peers in one window, exact (the host itself left out) up to EXACT_PEERS_UP_TO
    hosts; beyond, every host's, computed once for the window."""

    def __init__(self, hosts: dict[str, _Host]):
        self.hosts = hosts
        self.exact = len(hosts) <= EXACT_PEERS_UP_TO
        if not self.exact:
            self.all = _theirs(list(hosts.values()))

    def of(self, host: str) -> _Theirs:
        if not self.exact:
            return self.all
        return _theirs([v for h, v in self.hosts.items() if h != host])


def _theirs(hosts: list[_Host]) -> _Theirs:
    median = statistics.median(h.compute for h in hosts)
    return _Theirs(median, statistics.median(abs(h.compute - median) for h in hosts),
                   statistics.median(h.error for h in hosts), statistics.median(h.wait for h in hosts))
