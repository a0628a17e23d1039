"""Self-healing runs: after a job launch that failed, which hosts to launch on next.

A launch whose failure is the hosts' (results.StageResult.host_failure: a host lost, every
other failure only a peer's death) is recovered while `recovery.max_host_failures` lasts: each
lost host is replaced by a spare at its node rank (the world size stays, so a DDP job resumes
bitwise), or, without a spare left, left behind while at least `recovery.min_hosts` remain (the
world shrinks; the job must reshard). A spare that the relaunch could not even reach died while
it waited: it is named and skipped, the next spare takes its place, and it costs the budget
nothing (the host that was lost is what counts).

A job's own failure (a rank raised, exited non-zero or was killed on a host that answers) is
restarted on the same hosts while `job.max_restarts` lasts: every host's workers together, in one
new launch (torchrun's own restarts are per node and fall out of step across hosts). The same
failure right after a restart (the exception's type and line, or the signal) is not retried: it
will happen again. Nor is any relaunch after the last NO_PROGRESS relaunches each ended before
the job's first step (no progress). Pure: the run loop (run/loop.py) relaunches; this module
decides and keeps the record.
"""

from __future__ import annotations

import time
from typing import Optional

from ddplaunch.record.incidents import Recovery
from ddplaunch.record.results import UNREACHABLE, NodeOutcome, StageResult, job_failure
from ddplaunch.spec.model import HostSpec, RecoverySpec


#: Relaunches in a row that end before their job's first step: the run stops with "no progress"
#: rather than spending its budget on a failure that will happen again.
NO_PROGRESS = 3


class RecoveryBudget:
    """The run's recoveries so far, its spares left, and the decision after each failed launch."""

    def __init__(self, spec: RecoverySpec, spares: list[HostSpec]):
        self.spec = spec
        self.spares = list(spares)
        self.done: list[Recovery] = []
        self.lost: list[str] = []
        #: spares dropped while they waited (run/spares.py): label -> why
        self.dropped: dict[str, str] = {}
        #: relaunches in a row that ended before their job's first step
        self.stalled = 0
        #: hosts the run lost, as they were in its spec (recovery.rejoin_after: each may come back)
        self.lost_specs: dict[str, HostSpec] = {}
        #: when each of them began to answer the probes without a failure since (run/spares.py)
        self.healthy_since: dict[str, float] = {}
        #: the run's size: the hosts of its first launch (a run that shrank grows back to it)
        self.size = 0

    def comeback(self) -> list[HostSpec]:
        """Hosts the run lost that may come back as spares: lost once (a host lost twice is not
        taken back by itself), not back already; none when `recovery.rejoin_after` is 0."""
        if self.spec.rejoin_after <= 0:
            return []
        return [h for label, h in self.lost_specs.items() if self.lost.count(label) == 1]

    def readmit(self, label: str) -> None:
        """A lost host is a spare again (at the end of the spares: the ones that never failed first)."""
        host = self.lost_specs.pop(label)
        self.healthy_since.pop(label, None)
        self.spares.append(host)

    def can_grow(self, hosts: list[HostSpec]) -> bool:
        """Whether a run that shrank (`recovery.min_hosts`) can grow back by a spare now."""
        return bool(self.spares) and 0 < len(hosts) < self.size and self.spec.min_hosts is not None

    def grow(self, hosts: list[HostSpec], held_at: float) -> tuple[list[HostSpec], str]:
        """The hosts of a run that shrank, with spares added at new node ranks up to its size
        (the job held at its checkpoint at `held_at`), and the record of it."""
        added = self.spares[:self.size - len(hosts)]
        self.spares = self.spares[len(added):]
        new = [*hosts, *added]
        self.done.append(Recovery(number=len(self.done) + 1, lost=[], causes={}, lost_at=held_at,
                                  detected_at=held_at, hosts_after=len(new), grown=[h.label for h in added]))
        return new, self.done[-1].describe()

    @property
    def host_recoveries(self) -> int:
        return sum(1 for r in self.done if not r.failure and not r.grown)

    @property
    def restarts(self) -> int:
        return sum(1 for r in self.done if r.failure)

    def next_hosts(self, hosts: list[HostSpec], result: StageResult, master: Optional[str] = None
                   ) -> tuple[Optional[list[HostSpec]], str]:
        """The hosts the job launches on next after `result`, and why (None: the run ends).

        Args:
            hosts: the hosts of the failed launch, in node order.
            master: `master.addr` when the spec fixes it (the master cannot move then).
        """
        lost = result.lost_hosts
        dead = self._dead_spares(result)
        if dead and len(dead) == len(lost):
            return self._skip_dead_spares(hosts, dead)
        names = ", ".join(o.host for o in lost)
        stalled = self._no_progress(result, f"{names} lost")
        if stalled:
            return None, stalled
        if self.spec.max_host_failures == 0:
            return None, f"{names} lost: recovery.max_host_failures is 0 (set it to survive host failures)"
        if len(self.lost) + len(lost) > self.spec.max_host_failures:
            before = f" after {', '.join(self.lost)} earlier" if self.lost else ""
            return None, (f"{names} lost{before}: more host failures than recovery.max_host_failures="
                          f"{self.spec.max_host_failures}")
        by_label = {h.label: h for h in hosts}
        if master and any(by_label[o.host].addr == master for o in lost if o.host in by_label):
            return None, f"{names} lost, and master.addr {master} with it: remove master.addr so the master can move"
        return self._replace(hosts, lost)

    def restart(self, hosts: list[HostSpec], result: StageResult, max_restarts: int
                ) -> tuple[Optional[list[HostSpec]], str]:
        """After a launch whose job failed by itself (no host lost): the same hosts again, and
        why (None: the run ends) — unless `max_restarts` are used up, the failure is the one the
        last restart was for, or relaunches make no progress."""
        first = result.first_failure
        assert first is not None, "a restart is for a launch that failed"
        what, key = job_failure(first)
        stalled = self._no_progress(result, what)
        if stalled:
            return None, stalled
        last = self.done[-1] if self.done else None
        if key and last is not None and last.failure_key == key:
            return None, f"the same failure again: {what}, as before restart {last.number}: not retried"
        if self.restarts >= max_restarts:
            return None, f"{what}: job.max_restarts={max_restarts} restart{'s' if max_restarts > 1 else ''} used up"
        at = first.ended_at or result.ended_at or time.time()
        self.done.append(Recovery(number=len(self.done) + 1, lost=[], causes={}, lost_at=at, detected_at=at,
                                  hosts_after=len(hosts), failure=what, failure_key=key))
        return list(hosts), self.done[-1].describe()

    def _no_progress(self, result: StageResult, what: str) -> str:
        """Why the run stops when this relaunch, like the NO_PROGRESS - 1 before it, ended before
        its job's first step ("" while relaunches make progress)."""
        self.stalled = self.stalled + 1 if self.done and result.progress is None else 0
        if self.stalled < NO_PROGRESS:
            return ""
        ends = [r.what() for r in self.done[-(self.stalled - 1):]] + [what]
        return (f"{what}: no progress — the last {self.stalled} relaunches each ended before the job's first step "
                f"({'; '.join(ends)}); not relaunched again: look at what ends them (the hosts' logs, the job's start)")

    def _dead_spares(self, result: StageResult) -> list[NodeOutcome]:
        """Spares the last recovery put in that this launch could not reach: never started there."""
        joined = set(self.done[-1].replaced.values()) if self.done else set()
        return [o for o in result.lost_hosts if o.host in joined and o.state == UNREACHABLE]

    def _skip_dead_spares(self, hosts: list[HostSpec], dead: list[NodeOutcome]
                          ) -> tuple[Optional[list[HostSpec]], str]:
        """The same recovery again, each dead spare's place taken by the next spare (or, with none
        left, given up while `recovery.min_hosts` allows): the budget is not charged."""
        recovery = self.done[-1]
        why = {o.host: o.detail or o.state for o in dead}
        new: list[HostSpec] = []
        for host in hosts:
            if host.label not in why:
                new.append(host)
                continue
            recovery.dead_spares[host.label] = why[host.label]
            stood_for = next(lost for lost, spare in recovery.replaced.items() if spare == host.label)
            if self.spares:
                spare = self.spares.pop(0)
                recovery.replaced[stood_for] = spare.label
                new.append(_in_place_of(host, spare))
            else:
                del recovery.replaced[stood_for]
        names = ", ".join(why)
        if len(new) < len(hosts) and (self.spec.min_hosts is None or len(new) < self.spec.min_hosts):
            return None, (f"spare {names} cannot be reached ({'; '.join(why.values())}) and no spare is left "
                          "to take its place")
        recovery.hosts_after = len(new)
        return new, (f"spare {names} cannot be reached ({'; '.join(why.values())}): skipped, at no cost to "
                     f"recovery.max_host_failures; {recovery.describe()}")

    def _replace(self, hosts: list[HostSpec], lost: list[NodeOutcome]) -> tuple[Optional[list[HostSpec]], str]:
        gone = {o.host for o in lost}
        spares = list(self.spares)
        replaced: dict[str, str] = {}
        new: list[HostSpec] = []
        for host in hosts:
            if host.label not in gone:
                new.append(host)
            elif spares:
                spare = spares.pop(0)
                replaced[host.label] = spare.label
                new.append(_in_place_of(host, spare))
        names = ", ".join(sorted(gone))
        if len(new) < len(hosts):
            floor = self.spec.min_hosts
            if floor is None:
                return None, (f"{names} lost and no spare left to replace it (add recovery.spares, or set "
                              "recovery.min_hosts to go on with fewer hosts)")
            if len(new) < floor:
                return None, (f"{names} lost and no spare left: {len(new)} host(s) would remain, fewer than "
                              f"recovery.min_hosts={floor}")
        self.spares = spares
        self.lost += sorted(gone)
        self.lost_specs.update({h.label: h for h in hosts if h.label in gone})
        self.done.append(Recovery(
            number=len(self.done) + 1, lost=[o.host for o in lost], causes={o.host: o.detail for o in lost},
            lost_at=min(o.last_heard_at or o.ended_at or time.time() for o in lost),
            detected_at=max(o.ended_at or time.time() for o in lost), replaced=replaced, hosts_after=len(new)))
        return new, self.done[-1].describe()


def _in_place_of(lost: HostSpec, spare: HostSpec) -> HostSpec:
    """`spare` at `lost`'s node rank: with `lost`'s process count, so the world and every rank stay."""
    return spare.model_copy(update={"nproc": lost.nproc})
