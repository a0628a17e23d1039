"""The straggler judge (diagnose/stragglers.StragglerJudge), fed with what ranks send, folded per
window of steps as the node agents fold it (tests/events_util.Agents): in a synchronous job every
rank's step lasts as long as the slowest's, so the straggler is the rank that waits least at the
collectives. The real thing (sim hosts, a host's CPU limited) is in
tests/diagnose/test_stragglers_sim.py."""

from __future__ import annotations

import math
import random
from typing import Callable, Optional

from ddplaunch.diagnose.stragglers import IN_A_ROW, MIN_SLOW_S, THRESHOLD, WARMUP, WINDOW, StragglerJudge
from ddplaunch.hostside.fold import SILENT_S
from ddplaunch.hostside.payloads import Timing, read_payload
from tests.events_util import Agents

HOSTS = {0: "h1", 1: "h1", 2: "h2", 3: "h2", 4: "h3", 5: "h3"}


def _feed(watch: Agents, steps: range, compute: dict[int, float], noise: float = 0.0, seed: int = 0,
          hosts: dict[int, str] = HOSTS):
    """Every rank reports `steps`: a step lasts as long as the slowest rank's compute plus 10 ms
    of transfer; each rank waits the rest. The straggler named, if any, with the step it was named at."""
    rnd = random.Random(seed)
    named = []
    for step in steps:
        mine = {r: c * (1 + rnd.uniform(-noise, noise)) for r, c in compute.items()}
        step_s = max(mine.values()) + 0.010
        for rank, c in mine.items():
            found = watch.feed(hosts[rank], Timing(rank, [[step, step_s, step_s - c]]), clock=float(step))
            if found is not None:
                named.append((found, step))
    return named


def named_at(step_s: float) -> int:
    """The step a host slow from the first judged window on is named at, its steps `step_s` long:
    slow in IN_A_ROW windows in a row that hold MIN_SLOW_S of steps."""
    return WARMUP + WINDOW * max(IN_A_ROW, math.ceil(MIN_SLOW_S / (WINDOW * step_s)))


def judged(*hosts: str) -> Agents:
    """A judge of `hosts` (default: HOSTS's), fed as the node agents feed it."""
    return Agents(StragglerJudge(list(hosts or sorted(set(HOSTS.values())))))


def test_the_rank_that_waits_least_is_named_though_every_step_time_is_equal():
    watch = judged()
    compute = {r: 0.100 for r in HOSTS} | {2: 0.150, 3: 0.150}
    named = _feed(watch, range(1, 200), compute)
    assert len(named) == 1, named
    found, step = named[0]
    assert (found.host, found.ranks) == ("h2", [2, 3])
    assert abs(found.slowdown - 0.5) < 0.01
    assert abs(found.peers_wait_s - 0.060) < 0.001 and abs(found.compute_s - 0.150) < 0.001
    assert step == named_at(0.160)  # slow in IN_A_ROW windows in a row and for MIN_SLOW_S, then named: once
    assert "h2 (ranks 2, 3) computes 50% slower than its peers since step" in found.describe()


def test_steps_of_milliseconds_are_slow_for_seconds_before_their_host_is_named():
    """Three windows of 13 ms steps are a third of a second: a rank a shared core held back that
    long is no straggler. Slow for MIN_SLOW_S of its steps, it is."""
    compute = {r: 0.002 for r in HOSTS} | {2: 0.003, 3: 0.003}
    step_s = 0.003 + 0.010
    assert _feed(judged(), range(1, WARMUP + 4 * IN_A_ROW * WINDOW), compute) == []
    named = _feed(judged(), range(1, WARMUP + 2 * int(MIN_SLOW_S / step_s)), compute)
    assert [(found.host, found.ranks) for found, _ in named] == [("h2", [2, 3])]
    (_, step), = named
    assert step >= WARMUP + MIN_SLOW_S / step_s


#: 16 hosts of 8 ranks.
EIGHTS = {r: f"n{r // 8}" for r in range(128)}


def test_one_slow_rank_among_a_hosts_eight_is_named_with_its_host():
    """The host's median would hide one slow GPU of eight: the judge takes its slowest rank."""
    watch = Agents(StragglerJudge(sorted(set(EIGHTS.values()))))
    named = _feed(watch, range(1, 200), {r: 0.100 for r in EIGHTS} | {45: 0.140}, noise=0.02, hosts=EIGHTS)
    assert [(found.host, found.ranks) for found, _ in named] == [("n5", [45])]
    assert "n5 (rank 45) computes" in named[0][0].describe()


def test_eight_ranks_a_host_with_noise_name_nobody():
    """Each host's slowest of eight ranks is noisier than one rank: compared with the other hosts'
    slowest ranks, not with their median rank, noise names nobody."""
    for seed in range(10):
        watch = Agents(StragglerJudge(sorted(set(EIGHTS.values()))))
        assert _feed(watch, range(1, 200), {r: 0.100 for r in EIGHTS}, noise=0.15, seed=seed, hosts=EIGHTS) == []


def test_a_healthy_run_with_noise_names_nobody():
    for seed in range(20):
        watch = judged()
        assert _feed(watch, range(1, 300), {r: 0.100 for r in HOSTS}, noise=0.3, seed=seed) == []


def test_a_slowdown_under_the_threshold_names_nobody():
    watch = judged()
    compute = {r: 0.100 for r in HOSTS} | {4: 0.100 * (1 + THRESHOLD - 0.03), 5: 0.100 * (1 + THRESHOLD - 0.03)}
    assert _feed(watch, range(1, 200), compute) == []


def test_a_slowdown_shorter_than_its_windows_in_a_row_or_min_slow_s_names_nobody():
    """Slow in IN_A_ROW windows in a row that hold MIN_SLOW_S of steps: named; in one window fewer
    (its steps long enough), or in as many windows of steps too short to hold MIN_SLOW_S: nobody."""
    healthy = {r: 0.100 for r in HOSTS}
    for slow, windows, holds, named in ((0.4, IN_A_ROW, True, True), (0.8, IN_A_ROW - 1, True, False),
                                        (0.2, IN_A_ROW, False, False)):
        assert (windows * WINDOW * (slow + 0.01) >= MIN_SLOW_S) == holds  # the steps' seconds
        watch = judged()
        _feed(watch, range(1, WARMUP + WINDOW + 1), healthy)
        burst = range(WARMUP + WINDOW + 1, WARMUP + (windows + 1) * WINDOW + 1)
        assert bool(_feed(watch, burst, healthy | {0: slow, 1: slow})) == named, (slow, windows)
        assert _feed(watch, range(burst.stop, burst.stop + 200), healthy) == []


def test_a_host_is_judged_against_its_own_level_when_training_started():
    """Where a rank sits in the collective makes its measured share differ a little (+5 % for
    Gloo's rank 0 here): a host 5 % over its peers from the start that drifts to 19 % (CPUs
    shared: 12 s of it named a host of a healthy 10-minute run) is 13 % over its own level, not a
    straggler; slowed by a quarter, it is, and its slowdown is reported against its peers."""
    healthy = {r: 0.100 for r in HOSTS}
    start = WARMUP + 10 * WINDOW
    watch = judged()
    assert _feed(watch, range(1, start + 1), healthy | {0: 0.105, 1: 0.105}) == []
    assert _feed(watch, range(start + 1, start + 5 * WINDOW + 1), healthy | {0: 0.119, 1: 0.119}) == []
    named = _feed(watch, range(start + 5 * WINDOW + 1, start + 15 * WINDOW + 1), healthy | {0: 0.131, 1: 0.131})
    assert [(found.host, round(found.slowdown, 2)) for found, _ in named] == [("h1", 0.31)]


def test_a_host_slow_from_the_start_is_named():
    """Only threshold/3 of a host's slowness can be taken as its own level: 30 % slow from the first
    step on is a straggler."""
    watch = judged()
    named = _feed(watch, range(1, 200), {r: 0.100 for r in HOSTS} | {4: 0.130, 5: 0.130})
    assert [(found.host, round(found.slowdown, 2), step) for found, step in named] == \
        [("h3", 0.3, named_at(0.140))]


def test_on_a_noisy_machine_the_bar_rises_with_the_peers_spread():
    """Peers computing 70-130 ms (a spread of 30 %): a host 20 % over their median is noise there."""
    watch = judged("h1", "h2", "h3", "h4")
    hosts = {0: "h1", 1: "h2", 2: "h3", 3: "h4"}
    named = []
    for step in range(1, 300):
        compute = {0: 0.070, 1: 0.100, 2: 0.130, 3: 0.120}
        step_s = max(compute.values()) + 0.01
        for rank, c in compute.items():
            found = watch.feed(hosts[rank], Timing(rank, [[step, step_s, step_s - c]]))
            named += [found] if found else []
    assert named == []


#: Issue #55's run: 3 hosts of 1 rank, 39 ms of compute a step, 30 ms of transfer.
THREE = {0: "h1", 1: "h2", 2: "h3"}
FAST, HELD = 0.039, 0.171


def _run(compute_of: Callable[[int, random.Random], dict[int, float]], steps: int = 400, seed: int = 0,
         transfer: float = 0.030, started: Optional[dict[int, float]] = None) -> list[tuple[str, float]]:
    """Each step every rank of THREE computes `compute_of(step, rnd)` (with ±5 %), the step lasts as
    long as the slowest rank's plus `transfer`, each rank waits the rest. The hosts named, with the
    seconds into the run (the sum of the step times) each was named at; `started`: each step's
    start in seconds into the run."""
    rnd, watch, clock, named = random.Random(seed), judged(*sorted(set(THREE.values()))), 0.0, []
    for step in range(1, steps):
        compute = {r: c * (1 + rnd.uniform(-0.05, 0.05)) for r, c in compute_of(step, rnd).items()}
        step_s = max(compute.values()) + transfer
        if started is not None:
            started[step] = clock
        clock += step_s
        for rank, c in compute.items():
            found = watch.feed(THREE[rank], Timing(rank, [[step, step_s, step_s - c]]), clock=clock)
            named += [(found.host, clock)] if found is not None else []
    return named


def _held_back(chance: dict[int, float], steps: range) -> Callable[[int, random.Random], dict[int, float]]:
    """During `steps` each rank is held back (HELD, not FAST) in a step with its `chance`: a busy
    machine's cores."""
    return lambda step, rnd: {r: HELD if step in steps and rnd.random() < p else FAST for r, p in chance.items()}


def test_a_busy_machine_that_holds_one_rank_back_a_little_more_often_names_nobody():
    """Issue #55: "dlw2 (rank 1) computes 338% slower than its peers since step 101: 171 ms a step
    against 39 ms", nothing slowed. For 16 s every rank's step is either fast (39 ms) or held back
    by a busy core (171 ms), rank 1 in 60 % of its steps, the others in 40 %: a window's median of
    such steps is the one or the other on a coin's throw, and rank 1's came out 171 ms against 39
    (the judge before named it in 9 seeds of 30, "since step 101"). Measured by the trimmed mean and
    its standard error, rank 1 computes 20-30 % more, well within the steps' own spread: nobody."""
    for seed in range(30):
        assert _run(_held_back({0: 0.4, 1: 0.6, 2: 0.4}, range(101, 181)), seed=seed) == [], seed


def test_the_issues_own_verdict_is_no_straggler_when_nobody_waits_for_it():
    """The issue's line itself: rank 1 "171 ms a step against 39 ms", yet "every other rank waits 37
    ms a step for it". In a synchronous job every rank waits for the slowest: a rank 132 ms slower
    that the others wait 37 ms for is the windows' statistics, not a straggler."""
    watch = judged(*sorted(set(THREE.values())))
    for step in range(1, 400):
        for rank in THREE:
            step_s, wait = (0.171, 0.0) if rank == 1 else (0.076, 0.037)
            assert watch.feed(THREE[rank], Timing(rank, [[step, step_s, wait]]), clock=step * 0.1) is None, step


def test_a_burst_of_load_on_the_whole_machine_names_nobody():
    """Every rank held back in half its steps for 40 s (the judge before named a host in 2 seeds of
    30), and a burst that holds one rank back the whole time, 4.4x its compute for 14 s (named
    before): a burst is no straggler."""
    for seed in range(30):
        assert _run(_held_back({0: 0.5, 1: 0.5, 2: 0.5}, range(101, 301)), seed=seed) == [], seed
    burst = range(101, 171)  # 70 steps of ~200 ms
    named = _run(lambda step, rnd: {r: HELD if r == 1 and step in burst else FAST for r in THREE})
    assert named == []


def test_one_rank_pausing_for_2_s_names_nobody():
    """A rank pauses 2 s in one step (a GC, a checkpoint, the page cache) while the others wait,
    once, then every 20 s."""
    assert _run(lambda step, rnd: {r: 2.0 if r == 1 and step == 130 else FAST for r in THREE}) == []
    assert _run(lambda step, rnd: {r: 2.0 if r == 1 and step % 250 == 0 else FAST for r in THREE}, steps=2000) == []


def test_a_host_at_a_quarter_of_its_cpu_is_named_within_30_s():
    """The true positive the fixes keep: on the sim a host limited to 25 % of a CPU computes 1.7-2.1x
    what its peers do (bench/stragglers.py), every step noisy (CPUs shared: ±30 % here); it is named
    within 30 s of being slowed, in every seed, and nobody else, nor anybody before."""
    slowed = 101
    for seed in range(10):
        started: dict[int, float] = {}
        named = _run(lambda step, rnd: {r: 0.060 * (1.8 if r == 2 and step >= slowed else 1)
                                        * (1 + rnd.uniform(-0.3, 0.3)) for r in THREE}, seed=seed, started=started)
        assert [host for host, _ in named] == ["h3"], (seed, named)
        assert named[0][1] - started[slowed] < 30.0, (seed, named, started[slowed])


def test_a_rank_that_never_reports_is_itself_a_finding_and_the_others_are_judged():
    """Rank 5 started and never reported a step: named silent once its node's others have reported
    for SILENT_S, and the judge goes on with the ranks that report (h1 is slow, and named)."""
    watch = judged()
    watch.start("h3", 5)
    compute = {r: 0.100 for r in HOSTS if r != 5} | {0: 0.3, 1: 0.3}
    named = _feed(watch, range(1, 200), compute)
    assert [found.host for found, _ in named] == ["h1"] and watch.silent == {"h3": [5]}
    assert SILENT_S < 200  # the fake clock: a step a second


def test_one_host_alone_has_no_peers():
    watch = judged("h1")
    for step in range(1, 60):
        assert watch.feed("h1", Timing(0, [[step, 0.2, 0.0]])) is None
        assert watch.feed("h1", Timing(1, [[step, 0.2, 0.1]])) is None


def test_a_malformed_payload_is_ignored():
    watch = judged("h1")
    assert read_payload("TIMING", '{"rank": "0", "steps": []}') is None  # the schema refuses it: never fed
    assert watch.feed("h1", Timing(0, [["x", 1, 2], [5, 1], None])) is None


def test_the_hold_file_is_the_one_the_entry_looks_for():
    """evict.py asks rank 0 to hold by creating entry.py's HOLD_FILE (the host side imports nothing)."""
    import importlib.util

    from ddplaunch.run import eviction as evict
    from ddplaunch.plan.launch import ENTRY_SOURCE

    spec = importlib.util.spec_from_file_location("entry_under_test", ENTRY_SOURCE)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    assert entry.HOLD_FILE == evict.HOLD_FILE


def test_a_host_late_every_window_is_not_quiet_and_one_that_stops_is_said_once(monkeypatch):
    """A busy host's parts come after the window was judged without them: it is heard, not quiet.
    A host that stops sending while the others go on is quiet once, with the step it stopped at,
    and heard again when it sends again."""
    from ddplaunch.diagnose import stragglers
    from ddplaunch.hostside.payloads import HostWindow

    clock = [0.0]
    monkeypatch.setattr(stragglers.time, "monotonic", lambda: clock[0])
    judge = StragglerJudge(["a", "b", "late", "stops"], window=3)

    def part(first: int) -> HostWindow:
        return HostWindow(first, first + 2, {str(r): [0.1, 0.01, 0.11] for r in range(2)})

    quiet: list[tuple[str, int, int]] = []
    for window in range(40):  # a window every 3 s
        first = 3 * window + 1
        clock[0] = 3.0 * window
        for host in ("a", "b") + (("stops",) if window < 20 else ()) + (("resumes",) if window == 35 else ()):
            judge.add("stops" if host == "resumes" else host, part(first))
        if window >= 4:  # "late" sends each window 12 s late: past the judge's wait, so never judged
            judge.add("late", part(first - 12))
        for t in (0.0, 1.0, 2.0):
            clock[0] = 3.0 * window + t
            quiet += [(q.host, q.first, q.last) for q in judge.judge().missing]
    assert quiet == [("stops", 61, 78)], quiet  # its last part (step 60) came at 57 s; said 20 s on, at step 78
    assert "stops" not in judge._missing  # it sent again at window 35
    # then every rank waits (a frozen rank holds the collective): every host's parts stop at the
    # same window, the last ones a few seconds after the first; nobody is quiet
    quiet = []
    for t in range(40):
        clock[0] = 120.0 + t
        if t < 4:
            judge.add(["a", "b", "late", "stops"][t], part(121))
        quiet += [q.host for q in judge.judge().missing]
    assert quiet == [], quiet
