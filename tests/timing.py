"""Time in tests. A test asserts behaviour; the speed we promise is measured in bench/ (figures in
docs/benchmarks.md). What remains here are two kinds of bound, each one call, so that every time
bound of the suite is found by grepping for them:

- `no_hang(took, limit, guards)`: the wall time of something that ends by itself (a run stopped by
  Ctrl-C, a dead host named by the pre-flight). The limit only tells a hang or a fall-back to a long
  default (torchrun's 900 s rendezvous, a 300 s collective timeout) from a working path, so it is at
  least 3x what a loaded 2-core machine needs; the message says what it guards.
- `cpu_within(cpu_s, units, what)`: a promise about work done (a spec loaded, a hostlist refused),
  as a multiple of a fixed reference workload timed on the same machine just before (`cpu_unit`),
  so a slower processor or a busy neighbour moves both sides of the comparison.

With DDPLAUNCH_TIMINGS=FILE every check appends a JSON line (test, what, measured, limit): the
figures for a run under load (`bench/../tests` runs in the closing notes).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: "A spec loads in a second of CPU" (security pass): 60 reference units took 0.8-1.0 CPU-s on the
#: 2-core machines where it was promised; the loads at the limits take 0.01-0.2 CPU-s there.
SPEC_LOAD_UNITS = 60.0
#: "Every hostile spec exits 2 in under 2.5 s": `ddplaunch validate` as a process, the interpreter's
#: start and imports included (~0.4 CPU-s); 2.5 s was ~150 units there.
CLI_REFUSAL_UNITS = 150.0
#: How often the reference workload is timed again: a check uses a unit at most this old.
UNIT_MAX_AGE_S = 10.0
_unit: tuple[float, float] = (0.0, -1e9)  # (CPU seconds, monotonic time it was measured)


def _record(kind: str, what: str, measured: float, limit: float) -> None:
    path = os.environ.get("DDPLAUNCH_TIMINGS")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"test": test, "kind": kind, "what": what, "measured": round(measured, 4),
                              "limit": round(limit, 4)}) + "\n")


def no_hang(took: float, limit: float, guards: str) -> None:
    """Fail when `took` seconds reached `limit`: `guards` says what a longer time would mean."""
    _record("wall", guards, took, limit)
    assert took < limit, f"{guards}: took {took:.1f}s, guard {limit:.0f}s (3x a loaded machine's time)"


def _reference_work() -> None:
    """A fixed piece of pure-Python work of the kind the CPU bounds measure (parsing, dicts, strings)."""
    text = "\n".join(f"key{i}: [{i}, 'v{i}', {{a: {i}}}]" for i in range(1600))
    for _ in range(3):
        parsed = {}
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            parsed[key] = json.loads(json.dumps(value.strip("[]").split(", ")))
        assert len(parsed) == 1600


def cpu_unit(fresh: bool = False) -> float:
    """CPU seconds (this thread) the reference workload takes on this machine now: the best of 5,
    cached for UNIT_MAX_AGE_S (or measured now with `fresh`)."""
    global _unit
    if fresh or time.monotonic() - _unit[1] > UNIT_MAX_AGE_S:
        runs = []
        for _ in range(5):
            t0 = time.thread_time()
            _reference_work()
            runs.append(time.thread_time() - t0)
        _unit = (min(runs), time.monotonic())
    return _unit[0]


class Took:
    """What `cpu_time` measured, readable once its block has ended."""

    seconds = 0.0


@contextmanager
def cpu_time(children: bool = False) -> Iterator[Took]:
    """CPU seconds of the block: this thread's, or with `children` those of the child processes
    waited for inside it (user + system). The test process's heap is frozen for the block
    (`gc.freeze`): a collection of every object the suite made so far, triggered by the block's
    allocations, is not the block's work."""
    took = Took()

    def now() -> float:
        if children:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            return usage.ru_utime + usage.ru_stime
        return time.thread_time()

    gc.freeze()
    t0 = now()
    try:
        yield took
    finally:
        took.seconds = now() - t0
        gc.unfreeze()


def cpu_within(cpu_s: float, units: float, what: str) -> None:
    """Fail when `cpu_s` CPU seconds exceed `units` reference units. A unit older than the work is
    timed again before a failure is declared (the machine may have slowed since it was taken)."""
    limit = units * cpu_unit()
    if cpu_s >= limit:
        limit = units * cpu_unit(fresh=True)
    _record("cpu", what, cpu_s, limit)
    assert cpu_s < limit, (f"{what}: {cpu_s:.3f} CPU-s, more than {units:g} reference units "
                           f"({limit:.3f} CPU-s on this machine now)")
