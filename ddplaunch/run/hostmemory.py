"""Bad hosts remembered across runs (record/hosthealth.py holds the file): what a run records, and
what the next `up` does with a recorded host.

Recorded (`HostMemory.note`, from the run's own events): a host lost in a launch (crashed, frozen,
cut off: `StageEnded`'s lost nodes, a recovery's lost hosts with their causes, a straggler it
evicted), a host whose kernel's OOM killer ended the run's processes (`StageEnded`'s nodes that
say so), and a host the health check named bad (`Localized`, whether the gate stops or drops
it). Never the launcher's own machine, never a host only the pre-flight found wanting (that is
the spec's or the host's set-up, which the pre-flight says).

Used (`skip_recorded`, before anything runs): a recorded host of the spec gets a spare in its
place (a listed spare, itself not recorded), or is left out where `recovery.min_hosts` allows; a
Slurm allocation by node count excludes the recorded Slurm nodes (`--exclude`). Otherwise `up`
refuses, saying which host, why, since when, and how to readmit it (`ddplaunch hosts clear HOST`,
or a `ddplaunch check` that passes on it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from ddplaunch.errors import PlanError
from ddplaunch.record.events import Event, HostBack, Localized, RecoveryStarted, StageEnded
from ddplaunch.record.hosthealth import BadHost, clear, health_file, recorded, remember
from ddplaunch.record.results import NodeState
from ddplaunch.report.goodput import duration
from ddplaunch.spec.model import ClusterSpec, HostSpec
from ddplaunch.spec.registry import registration


def describe(entry: BadHost, now: Optional[float] = None) -> str:
    """`dlt3: its ranks are frozen (run r1, 2h07m ago)`."""
    return f"{entry.host}: {entry.cause} (run {entry.run_id}, {duration((now or time.time()) - entry.at)} ago)"


class HostMemory:
    """What one run records of its bad hosts, from its events as they are said."""

    def __init__(self, spec: ClusterSpec, run_id: str):
        self.path, self.run_id = health_file(spec.recovery.host_health_file), run_id
        self.on = spec.recovery.remember_bad_hosts > 0
        self.ttl = spec.recovery.remember_bad_hosts
        self.backend = spec.backend
        #: the hosts this run recorded bad (label -> why)
        self.noted: dict[str, str] = {}

    def note(self, event: Event) -> None:
        """Record the hosts `event` names bad (a failure to write costs the run nothing)."""
        bad: dict[str, str] = {}
        if isinstance(event, RecoveryStarted):
            bad = {h: event.recovery.causes.get(h, "lost") for h in event.recovery.lost}
        elif isinstance(event, Localized):  # the health check named them, whether the run stops or goes on
            loc = event.localization
            bad = {h: f"failed the health check{': ' + loc.reasons[h] if loc.reasons.get(h) else ''}"
                   for h in loc.bad_hosts}
        elif isinstance(event, StageEnded):
            bad = {o.host: f"its kernel's OOM killer ended {', '.join(o.oom_killed)}"
                   for o in event.result.outcomes if o.oom_killed}
            bad |= {o.host: o.detail or "lost" for o in event.result.outcomes if o.state == NodeState.LOST}
        if isinstance(event, HostBack) and self.on:  # healthy again: the next runs take it too
            try:
                clear(self.path, [event.host])
            except OSError:
                pass
        if bad and self.on:
            try:
                remember(self.path, bad, self.run_id, self.backend)
                self.noted.update(bad)
            except OSError:
                pass

    def cleared(self, host: str) -> bool:
        """Whether an operator cleared a host this run recorded (`ddplaunch hosts clear HOST`)."""
        if not self.on or host not in self.noted:
            return False
        try:
            return host not in recorded(self.path, self.ttl)
        except OSError:
            return False


@dataclass
class Skipped:
    """What `skip_recorded` did: the spec to run, and the recorded hosts it left out (with what
    took each one's place, if anything)."""

    spec: ClusterSpec
    left_out: list[BadHost] = field(default_factory=list)
    replaced_by: dict[str, str] = field(default_factory=dict)
    excluded: list[BadHost] = field(default_factory=list)  # Slurm nodes the allocation must not hold

    def hosts(self) -> list[str]:
        """The recorded hosts this run goes without."""
        return [e.host for e in self.left_out + self.excluded]

    def lines(self) -> list[str]:
        """What `up` says of it, one line per host."""
        fix = "`ddplaunch hosts clear HOST` readmits"
        out = [f"skipped {describe(e)}: {self.replaced_by[e.host] + ' in its place' if e.host in self.replaced_by else 'left out'}"
               for e in self.left_out]
        out += [f"excluded from the allocation {describe(e)}" for e in self.excluded]
        return out + ([fix] if out else [])


def skip_recorded(spec: ClusterSpec, check: bool = False, now: Optional[float] = None) -> Skipped:
    """`spec` without its recorded hosts (see the module's text); a `check` keeps them (one that
    passes readmits them).

    Raises:
        PlanError: a recorded host that neither a spare nor `recovery.min_hosts` lets the run do
        without (or the master.addr the spec names).
    """
    if check or spec.recovery.remember_bad_hosts <= 0:
        return Skipped(spec)
    bad = recorded(health_file(spec.recovery.host_health_file), spec.recovery.remember_bad_hosts, now)
    if not bad:
        return Skipped(spec)
    if registration(spec.backend).allocates and "hosts" not in spec.model_fields_set:  # the scheduler picks the nodes
        excluded = [e for h, e in sorted(bad.items()) if e.backend == spec.backend and h not in spec.slurm.exclude]
        slurm = spec.slurm.model_copy(update={"exclude": [*spec.slurm.exclude, *(e.host for e in excluded)]})
        return Skipped(spec.model_copy(update={"slurm": slurm}), excluded=excluded)
    hosts, spares = _swap(spec, bad)
    left_out = [bad[h.label] for h in spec.hosts if h.label in bad]
    if not left_out:
        return Skipped(spec)
    replaced = {old.label: new.label for old, new in zip(spec.hosts, hosts) if new is not None and new is not old}
    keep = [h for h in hosts if h is not None]
    floor = spec.recovery.min_hosts
    where = f"(host-health file {health_file(spec.recovery.host_health_file)})"
    fix = "If the host is fixed, readmit it with `ddplaunch hosts clear HOST` or a `ddplaunch check` that passes on it"
    master = next((e for h in spec.hosts for e in left_out if h.label == e.host and spec.master.addr in (h.label, h.addr)),
                  None)
    if master is not None:
        raise PlanError(f"master.addr {spec.master.addr} is recorded as bad by an earlier run: {describe(master, now)} "
                        f"{where}. Name another master, or: {fix}")
    if len(keep) < len(spec.hosts) and (floor is None or len(keep) < floor):
        missing = [describe(bad[h.label], now) for h, new in zip(spec.hosts, hosts) if new is None]
        raise PlanError(f"recorded as bad by an earlier run, and no spare (recovery.spares) or recovery.min_hosts lets "
                        f"this run do without it: {'; '.join(missing)} {where}. {fix}")
    recovery = spec.recovery.model_copy(update={"spares": spares})
    return Skipped(spec.model_copy(update={"hosts": keep, "recovery": recovery}), left_out, replaced)


def _swap(spec: ClusterSpec, bad: dict[str, BadHost]) -> tuple[list[Optional[HostSpec]], object]:
    """Each host, or the next healthy listed spare in a recorded one's place (None: none left);
    the spares left (recorded spares dropped; a count of Slurm spares as it was)."""
    listed = spec.recovery.spares if isinstance(spec.recovery.spares, list) else None
    free = [s for s in listed or [] if s.label not in bad]
    hosts: list[Optional[HostSpec]] = []
    for host in spec.hosts:
        hosts.append(host if host.label not in bad else (free.pop(0) if free else None))
    return hosts, (free if listed is not None else spec.recovery.spares)


def readmit(spec: ClusterSpec, hosts: list[str]) -> list[str]:
    """Clear `hosts` from the spec's host-health file (a check passed on them): those that were in it."""
    try:
        return clear(health_file(spec.recovery.host_health_file), hosts)
    except OSError:
        return []
