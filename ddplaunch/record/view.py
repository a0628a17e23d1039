"""The one fold of a run's events: `RunView.of(events)` is what every reader knows of a run.

The summary, `status`, `top`, `attach`, the run page, `--json` and the Python API (`ddplaunch.up`
returns the run loop's own view) read a `RunView`; none keeps a copy of a stage, a recovery or a
straggler of its own. `add` takes one event at a time (a follower folds as the log grows), and
what it keeps is bounded by the run's hosts, ranks, launches and incidents, never by its length:
of the steps only the newest window judged (the hosts' live status is record/live.py's). Pure:
events in, values out; nothing an event holds is changed (what the fold learns of a launch later,
it keeps beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from ddplaunch.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from ddplaunch.plan.launch import Stage
from ddplaunch.record.diagnosis import Gate, HealthVerdict, Localization, PreflightReport
from ddplaunch.record.events import (Allocated, Event, GateStopped, HostBack, HostQuiet, HostState, HostsExcluded,
                                     Localized, NotRecovered, PreflightChecked, RanksFrozen, RanksSilent,
                                     RecoveryStarted, RecoveryUpdated, Replanned, Requested, Requeued, RunEnded,
                                     RunStarted, SpareDropped, SparesRejected, StageEnded, StageStarted, StepWindow,
                                     StragglerNamed)
from ddplaunch.record.incidents import Recovery, Straggler
from ddplaunch.record.results import RunState, StageResult


#: How the plan text marks where the run was planned again without excluded hosts.
REPLANNED = "# re-planned without excluded hosts\n"


@dataclass
class Launch:
    """One launch of a stage: its start, its result once it ended, and the recovery that
    launched it again (its number) if one did."""

    started: StageStarted
    result: Optional[StageResult] = None
    recovered: Optional[int] = None

    @property
    def outcome(self) -> Optional[StageResult]:
        """The result as readers see it: with the recovery that followed it (a copy: the event's
        own result is never changed)."""
        if self.result is None or self.recovered is None:
            return self.result
        return replace(self.result, recovered=self.recovered)


@dataclass
class RunView:
    """What a run's events say, folded."""

    run_id: str = ""
    started: Optional[RunStarted] = None
    #: the launch that ends the run (`job`; `healthcheck` for `check`)
    final_stage: Stage = Stage.JOB
    #: the hosts the run runs on now (after recoveries and exclusions)
    hosts: list[str] = field(default_factory=list)
    requested: list[str] = field(default_factory=list)
    preflight: Optional[PreflightReport] = None
    launches: list[Launch] = field(default_factory=list)
    host_states: dict[str, HostState] = field(default_factory=dict)
    localization: Optional[Localization] = None
    excluded: list[str] = field(default_factory=list)
    #: spares a gate found wanting (dropped before anything ran)
    rejected_spares: list[str] = field(default_factory=list)
    #: the gate that stopped the run before its last launch
    blocked: Optional[Gate] = None
    recoveries: list[Recovery] = field(default_factory=list)
    unrecovered: Optional[str] = None
    stragglers: list[Straggler] = field(default_factory=list)
    spares_dropped: dict[str, str] = field(default_factory=dict)
    #: hosts the run lost that came back as spares, in order (recovery.rejoin_after)
    hosts_back: list[HostBack] = field(default_factory=list)
    #: the newest window of steps judged in the job launch that runs (a relaunch starts again)
    last_window: Optional[StepWindow] = None
    #: ranks gone silent (host -> ranks), hosts whose step reports stopped while others came
    silent: dict[str, list[int]] = field(default_factory=dict)
    quiet: list[str] = field(default_factory=list)
    #: the ranks each host's agent says cannot run now (host -> rank -> process state)
    frozen: dict[str, dict[str, str]] = field(default_factory=dict)
    requeues: int = 0
    #: the scheduler's job an attached run's stages run on
    allocation: Optional[Allocated] = None
    ended: Optional[RunEnded] = None
    #: a dry run's text (`ddplaunch.up(..., dry_run=True)`): nothing ran
    dry_run: Optional[str] = None
    _try_start: int = 0  # the first launch of the allocation's current try

    @classmethod
    def of(cls, events: Iterable[Event]) -> "RunView":
        view = cls()
        for event in events:
            view.add(event)
        return view

    @classmethod
    def of_dry_run(cls, run_id: str, text: str) -> "RunView":
        return cls(run_id=run_id, dry_run=text)

    def add(self, event: Event) -> None:  # noqa: C901 - one branch per kind of event
        if isinstance(event, RunStarted):
            self.started, self.run_id, self.final_stage = event, event.run_id, event.final_stage
            self.hosts = list(event.hosts)
        elif isinstance(event, Requested):
            self.requested.append(event.text)
        elif isinstance(event, HostState):
            self.host_states[event.host] = event
        elif isinstance(event, PreflightChecked):
            self.preflight = event.report
        elif isinstance(event, StageStarted):
            self.launches.append(Launch(event))
            self.hosts = list(event.hosts)
            if event.stage == Stage.JOB:  # a relaunch counts steps again
                self.last_window = None
        elif isinstance(event, StageEnded) and self.launches:
            self.launches[-1].result = event.result
        elif isinstance(event, StepWindow):
            self.last_window = event
        else:
            self._incident(event)

    def _incident(self, event: Event) -> None:
        if isinstance(event, Localized):
            self.localization = event.localization
        elif isinstance(event, HostsExcluded):
            self.excluded += [h for h in event.hosts if h not in self.excluded]
        elif isinstance(event, SparesRejected):
            self.rejected_spares += [h for h in event.hosts if h not in self.rejected_spares]
        elif isinstance(event, Replanned):
            self.requested.append(REPLANNED)
        elif isinstance(event, GateStopped):
            self.blocked = self.blocked or event.gate
        elif isinstance(event, RecoveryStarted):
            self._recovery(event.recovery)
            self.hosts = list(event.hosts)
            if self.launches and self.launches[-1].result is not None:
                self.launches[-1].recovered = event.recovery.number
        elif isinstance(event, RecoveryUpdated):
            self._recovery(event.recovery)
        elif isinstance(event, NotRecovered):
            self.unrecovered = event.why
        elif isinstance(event, StragglerNamed):
            self.stragglers.append(event.straggler)
        elif isinstance(event, SpareDropped):
            self.spares_dropped[event.host] = event.why
        elif isinstance(event, HostBack):
            self.hosts_back.append(event)
        elif isinstance(event, RanksSilent):
            self.silent.setdefault(event.host, []).extend(r for r in event.ranks if r not in self.silent[event.host])
        elif isinstance(event, RanksFrozen):
            self.frozen.pop(event.host, None)
            self.frozen.update({event.host: event.ranks} if event.ranks else {})
        elif isinstance(event, HostQuiet):
            self.quiet += [] if event.host in self.quiet else [event.host]
        elif isinstance(event, Requeued):
            self.requeues, self._try_start = event.restart, len(self.launches)
        elif isinstance(event, Allocated):
            self.allocation = event
        elif isinstance(event, RunEnded):
            self.ended = event

    def _recovery(self, recovery: Recovery) -> None:
        """A recovery, or the same one again (a dead spare's place taken, its resumption known)."""
        for i, known in enumerate(self.recoveries):
            if known.number == recovery.number:
                self.recoveries[i] = recovery
                return
        self.recoveries.append(recovery)

    # ------------------------------------------------------------------ what readers ask

    @property
    def stages(self) -> list[StageResult]:
        """The ended launches of the allocation's current try, in order."""
        return [r for r in (launch.outcome for launch in self.launches[self._try_start:]) if r is not None]

    @property
    def running(self) -> Optional[StageStarted]:
        """The launch that runs now, if one does."""
        return self.launches[-1].started if self.launches and self.launches[-1].result is None else None

    @property
    def healthcheck(self) -> Optional[HealthVerdict]:
        """The verdict of the newest launch that ran the health check."""
        ran = [s for s in self.stages if s.ran_healthcheck]
        return ran[-1].healthcheck if ran else None

    @property
    def passed(self) -> list[str]:
        """The hosts the run's final launch ran on, when it passed (for `check`: the hosts its
        health check passed; none when it failed or never ran)."""
        last = self.launches[-1] if len(self.launches) > self._try_start else None
        if last is None or last.result is None or last.started.stage != self.final_stage or not last.result.ok:
            return []
        return list(last.started.hosts)

    @property
    def plan_text(self) -> str:
        """Everything the backend executed, as the dry run prints it (a dry run: what it would)."""
        return self.dry_run if self.dry_run is not None else "".join(self.requested)

    @property
    def exit_code(self) -> int:
        """0, 1 or 130, as `ddplaunch up` exits (a dry run: 0, it ran nothing)."""
        if self.dry_run is not None:
            return EXIT_OK
        if self.ended is not None:
            return self.ended.exit_code
        return exit_code(self.stages, self.final_stage, self.blocked)

    @property
    def state(self) -> RunState:
        """The run's state as its log says it (a writer that died is the reader's to tell)."""
        if self.ended is not None:
            return self.ended.state
        return RunState.RUNNING if self.started is not None else RunState.SUBMITTED

    @property
    def wall_s(self) -> float:
        """Seconds from the run's start to its end (or its newest event)."""
        if self.started is None:
            return 0.0
        return max(0.0, (self.ended.t if self.ended is not None else self.started.t) - self.started.t)


def exit_code(stages: list[StageResult], final_stage: Stage = Stage.JOB, blocked: Optional[Gate] = None) -> int:
    """130 when the user interrupted; 0 when the last launch was the final one and passed and no
    gate stopped the run (a failed health check whose bad hosts were excluded does not count);
    else 1."""
    if any(s.interrupted for s in stages):
        return EXIT_INTERRUPTED
    if blocked or not stages or stages[-1].stage != final_stage:
        return EXIT_FAILURE
    return EXIT_OK if stages[-1].ok else EXIT_FAILURE


def run_state(code: int) -> RunState:
    """The final state a run's exit code says."""
    return {EXIT_OK: RunState.OK, EXIT_INTERRUPTED: RunState.INTERRUPTED}.get(code, RunState.FAILED)
