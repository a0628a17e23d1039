"""One run in progress: the stages, their gates, and every fact appended to the run's event log.

`RunLoop` asks the backend for its hosts (Slurm: the allocation), runs the pre-flight gate, then
each stage: plan (pure) -> `backend.render` -> `backend.launch`, the job under the hang watch,
the health check followed by its gate (which may stop the run or drop hosts). Everything a stage
produced comes back in its `StageResult`, and everything the run establishes is appended to its
event log, once (record/events.py): the loop keeps no record or report of its own. Hosts given
back by a scheduler (a requeued allocation) run every stage again. A launch that lost hosts is
launched again on the survivors and spares while `recovery.max_host_failures` lasts; one whose job
failed by itself, on the same hosts while `job.max_restarts` lasts (run/recovery.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

from ddplaunch.backends.contract import SessionGated
from ddplaunch.diagnose.oom import name_oom_kills
from ddplaunch.diagnose.preflight import PreflightReport, reach_hosts
from ddplaunch.errors import PlanError
from ddplaunch.output.console import hosts_named
from ddplaunch.output.stagelines import StageLines
from ddplaunch.output.torchrun import finding_lines
from ddplaunch.plan.hostwords import CpuShare
from ddplaunch.plan.launch import LaunchPlan, Stage, derive_port, master_addr, stage_port_key
from ddplaunch.plan.stages import plan_stage, preflight_wanted, stages_of
from ddplaunch.record.events import (Event, GateStopped, HostsExcluded, Localized, NotRecovered,
                                     PreflightChecked, RecoveryStarted, RecoveryUpdated, Replanned, Requested, Requeued,
                                     SparesRejected, StageEnded, StageStarted)
from ddplaunch.record.incidents import Straggler
from ddplaunch.record.results import Progress, StageResult, describe_exit
from ddplaunch.run.eviction import Eviction
from ddplaunch.run.gates import Decision, InStagePreflight, healthcheck_gate, preflight_gate
from ddplaunch.run.hangwatch import HangWatchdog
from ddplaunch.run.hostmemory import HostMemory
from ddplaunch.run.recovery import RecoveryBudget
from ddplaunch.run.runsession import RunSession
from ddplaunch.run.spares import SpareWatch
from ddplaunch.run.steps import StepsWatch
from ddplaunch.spec.model import ClusterSpec, HostSpec

PORT_ATTEMPTS = 20
#: The hang watchdog's timeout when the spec sets none and recovery is on: a host whose ranks
#: froze is found (diagnose/stacks.frozen_hosts) and replaced, not waited for until the job's timeout.
RECOVERY_HANG_S = 60.0


class RunLoop:
    """One run in progress: the stages and their gates; what happens goes to `events`, whose
    fold (`view`) is all the loop reads back."""

    def __init__(self, session: RunSession):
        self.session = session
        self.spec, self.backend, self.opts, self.console = session.spec, session.backend, session.opts, session.console
        self.stop, self.run_id, self.run_dir = session.stop, session.run_id, session.run_dir
        self.events, self.view = session.events, session.view
        self._moved: set[tuple[str, int]] = set()  # (stage, port) taken instead of a busy derived port
        #: (stage, master, port) the pre-flight just found free (the master listened on it): that
        #: launch takes it without probing it again
        self._proven: Optional[tuple[str, str, int]] = None
        #: The pre-flight rides in the next launch's own sessions (`InStagePreflight`)
        self._preflight_in_stage = False
        self.budget = RecoveryBudget(self.spec.recovery, [])
        #: the job launch's hold at its checkpoint (run/eviction.py): a straggler evicted, or growing back
        self._eviction: Optional[Eviction] = None
        self.memory = HostMemory(self.spec, self.run_id)  # bad hosts, remembered for the next runs
        #: The values of the spec's secrets, masked in everything the ranks print.
        names = self.spec.secret_names()
        self._secrets = [v for k, v in self.spec.env_values(os.environ).items() if k in names]

    def say(self, event: Event) -> None:
        """Append `event` to the run's log (the fold `view` takes it too); the hosts it names bad
        are remembered across runs."""
        self.events.append(event)
        self.memory.note(event)

    def run(self) -> None:
        rescheduled = 0
        while True:
            spec = self._gated_spec()
            if spec is None or not self._stages(spec):
                return
            rescheduled += 1
            self.console.note(f"allocation requeued (restart {rescheduled}): every stage runs again")
            self.say(Requeued(rescheduled))

    def _gated_spec(self) -> Optional[ClusterSpec]:
        """The spec on the backend's hosts, through the pre-flight gate (None: stop)."""
        hosts = self.backend.hosts()
        spec = self.spec.model_copy(update={"hosts": hosts})
        if [h.label for h in hosts] != self.view.hosts:
            self.console.note(f"hosts: {hosts_named([h.label for h in hosts])}")
        text = self.backend.allocation_text()
        if text and not self.view.requested:
            self.say(Requested(text))
        spares = self.backend.spares()
        self.budget.spares = spares
        if not preflight_wanted(spec, self.opts.healthcheck_only):
            return spec
        # a derived port is probed (and moved on when busy) first, so the pre-flight tests the
        # port the launch uses; an explicit master.port is the pre-flight's to report
        stage = stages_of(spec, self.opts)[0]
        first = spec.master.port or self._free_port(spec, stage)
        reached = None
        if isinstance(self.backend, SessionGated) and not spares and spec.container is None:
            # one SSH round per host: the probe runs in the first launch's sessions, once every
            # host is known to answer (the master's probe would wait for one that never comes)
            reached = reach_hosts(spec, self.backend)
            if all(r.error is None for r in reached):
                self._preflight_in_stage = True
                self._proven = (stage, master_addr(spec), first)
                return spec
        decision, report = preflight_gate(self.session, spec, first, spares, reached)
        self.say(PreflightChecked(report))
        self.budget.spares = decision.spares
        gated = self._decided(decision)
        if gated is not None:
            self._proven = (stage, master_addr(gated), first)
        return gated

    def _decided(self, decision: Decision) -> Optional[ClusterSpec]:
        """A gate's decision, said as events: the spares it rejected, the hosts it excluded (the
        run planned again without them) or its stop. The spec to go on with (None: stop)."""
        if decision.rejected_spares:
            self.say(SparesRejected(decision.rejected_spares, decision.gate))
        if decision.spec is None:
            self.say(GateStopped(decision.gate))
        elif decision.excluded:
            self.say(HostsExcluded(decision.excluded, decision.gate))
            self.say(Replanned([h.label for h in decision.spec.hosts]))
        return decision.spec

    def _stages(self, spec: ClusterSpec) -> bool:
        """Every launch in order; True when the backend's hosts were rescheduled under one (start
        over). A launch that ran the health check is gated: stop, go on, or launch again without
        the hosts it found bad (`healthcheck.on_fail: exclude`)."""
        stages = stages_of(spec, self.opts)
        self.budget.size = self.budget.size or len(spec.hosts)
        while stages:
            stage = stages[0]
            recovery = len(self.budget.done)
            port = self._free_port(spec, stage, recovery)
            plan = plan_stage(spec, self.run_id, stage, port, self.opts, recovery)
            gate, self._preflight_in_stage = (self._in_stage(spec, plan) if self._preflight_in_stage else None), False
            result = self._launch(spec, plan, gate)
            if gate is not None:
                gated = self._decided(gate.outcome)
                if gated is None:
                    return False
                spec = gated  # the interface every host reaches the master through, hosts excluded
                if result is None:  # it excluded hosts before anything started: launch on the others
                    stages = stages_of(spec, self.opts)
                    continue
            assert result is not None
            if recovery:
                self._resumed(result)
            if result.rescheduled:
                return True
            grown = self._grown(spec, result)
            if grown is not None:
                spec, stages = grown, stages_of(grown, self.opts)
                continue
            if result.host_failure:
                recovered = self._recover(spec, result)
                if recovered is None:
                    return False
                # the new set is checked as the first was: a separate health check launches again first
                spec, stages = recovered, stages_of(recovered, self.opts)
                continue
            passed = stage == Stage.JOB and result.healthcheck is not None and result.healthcheck.ok
            if result.ran_healthcheck and not passed:
                gated = self._healthcheck_gate(spec, result)
                if gated is None:
                    return False
                if gated is not spec:
                    spec = gated
                    if stage == Stage.JOB:  # the job never started: launch it again on the hosts left
                        continue
            elif not result.ok:
                if stage == Stage.JOB and self._restart(spec, result):
                    continue
                return False
            stages = stages[1:]
        return False

    def _recover(self, spec: ClusterSpec, result: StageResult) -> Optional[ClusterSpec]:
        """After a launch that lost hosts: the spec to launch again with (None: the run ends, and
        the summary says why)."""
        hosts, why = self.budget.next_hosts(spec.hosts, result, spec.master.addr)
        if hosts is None:
            self.console.note(f"not recovering: {why}")
            self.say(NotRecovered(why))
            return None
        if self.stop.is_set() and not self.stop.by_user:  # the hang watchdog stopped it, naming the host
            self.stop.reset()
        self._relaunching(result, hosts, f"recovery {self.budget.host_recoveries} of at most "
                                         f"{spec.recovery.max_host_failures}: {why}")
        return spec.model_copy(update={"hosts": hosts})

    def _grow_by(self, spec: ClusterSpec, host: str) -> None:
        """A host is back as a spare: a run that shrank grows back by it at the job's next checkpoint."""
        if self._eviction is not None and self.budget.can_grow(spec.hosts):
            self._eviction.grow(host)

    def _grown(self, spec: ClusterSpec, result: StageResult) -> Optional[ClusterSpec]:
        """After a launch stopped at its checkpoint to grow back: the spec on the grown set (None: it was not)."""
        held = self._eviction.grown_at if self._eviction is not None else None
        if held is None or self.stop.by_user or result.host_failure:
            return None
        self.stop.reset()
        hosts, why = self.budget.grow(spec.hosts, held)
        self._relaunching(result, hosts, f"growing back: {why}")
        return spec.model_copy(update={"hosts": hosts})

    def _restart(self, spec: ClusterSpec, result: StageResult) -> bool:
        """After a launch whose job failed by itself on hosts that answer: True when it launches
        again on the same hosts (`job.max_restarts`); a stop, a hang or a lost host is not restarted."""
        if not spec.job.max_restarts or result.interrupted or result.rescheduled or result.lost_hosts \
                or result.first_failure is None or self.stop.is_set():
            return False
        hosts, why = self.budget.restart(spec.hosts, result, spec.job.max_restarts)
        if hosts is None:
            self.console.note(f"not restarted: {why}")
            self.say(NotRecovered(why))
            return False
        self._relaunching(result, hosts, f"restart {self.budget.restarts} of at most {spec.job.max_restarts} "
                                         f"(job.max_restarts): {why}")
        return True

    def _relaunching(self, result: StageResult, hosts: list[HostSpec], why: str) -> None:
        """The budget's newest relaunch decided on: what the failed launch had done, said and logged."""
        recovery = self.budget.done[-1]
        if recovery.steps_before is None and result.progress is not None:
            recovery.steps_before = result.progress.optimizer_steps
        recovery.stopped_at = recovery.stopped_at or result.ended_at
        self.console.note(f"{why}; relaunching on {hosts_named([h.label for h in hosts])}")
        self.say(RecoveryStarted(recovery, [h.label for h in hosts]))

    def _resumed(self, result: StageResult) -> None:
        """The launch after a recovery ended: when its job completed its first step, from which step."""
        if result.progress is not None:  # said already, unless it ended before its start was known
            self._first_step(result.progress)
        self.say(RecoveryUpdated(self.budget.done[-1]))

    def _healthcheck_gate(self, spec: ClusterSpec, result: StageResult) -> Optional[ClusterSpec]:
        """After a launch that ran the health check: the spec to go on with (None: stop)."""
        decision, loc = healthcheck_gate(self.session, spec, result)
        if loc is not None:
            self.say(Localized(loc))
        return self._decided(decision)

    def _in_stage(self, spec: ClusterSpec, plan: LaunchPlan) -> InStagePreflight:
        """The pre-flight of `plan`'s hosts in its launch's sessions; its verdict is logged, and
        the stage announced once it starts."""
        def verdict(report: PreflightReport, decision: Decision) -> None:
            self.say(PreflightChecked(report))
            if gate.starts:
                self._announce(plan)
        gate = InStagePreflight(self.session, spec, plan.master_port, verdict)
        return gate

    def _announce(self, plan: LaunchPlan) -> None:
        self.console.note(f"stage {plan.stage}: master {plan.master_addr}:{plan.master_port}")
        self.say(StageStarted(plan.stage, plan.master_addr, plan.master_port, [n.host_label for n in plan.nodes]))

    def _launch(self, spec: ClusterSpec, plan: LaunchPlan, gate: Optional[InStagePreflight] = None
                ) -> Optional[StageResult]:
        """Render and launch one stage (the job under the hang watchdog); log what it produced.
        With a `gate`, the pre-flight runs in the stage's sessions first: None when it said no."""
        request = self.backend.render(plan)
        self.say(Requested(request.text()))
        if gate is None:
            self._announce(plan)
        omp = plan.nodes[0].env_dict().get("OMP_NUM_THREADS")
        if self.console.verbose and isinstance(omp, CpuShare) and self.console.first_time("omp"):
            self.console.note(f"OMP_NUM_THREADS: each host's cores / {omp} processes, at least 1 (torchrun would "
                              "set 1 and say so on every launch); env.OMP_NUM_THREADS in the spec chooses")
        job = plan.stage == Stage.JOB
        self._eviction = None
        steps = self._steps_of(spec, plan) if job else None
        lines = StageLines(self.console, plan.stage, on_first_step=self._first_step if self.budget.done else None,
                           secrets=self._secrets, on_report=steps.report if steps is not None else None)
        watchdog = None
        hang_timeout = spec.job.hang_timeout or (RECOVERY_HANG_S if spec.recovery.max_host_failures else None)
        if job and hang_timeout:
            watchdog = HangWatchdog(self.session, spec, plan, lines, hang_timeout, witnesses=self.budget.spares,
                                    frozen=steps.frozen if steps is not None else dict)
        if self.budget.done and self.budget.done[-1].relaunched_at is None:
            self.budget.done[-1].relaunched_at = time.time()
            self.say(RecoveryUpdated(self.budget.done[-1]))
        spares = SpareWatch(self.backend, self.budget, plan.nodes[0].host, self.console, self.say,
                            cleared=self.memory.cleared, on_back=lambda label: self._grow_by(spec, label)) \
            if job and (self.budget.spares or self.budget.comeback()) else contextlib.nullcontext()
        with watchdog or contextlib.nullcontext(), spares, steps or contextlib.nullcontext():
            if gate is not None and isinstance(self.backend, SessionGated):
                gated = self.backend.launch_gated(request, lines, self.stop, gate)
                if gated is None:
                    return None
                result = gated
            else:
                result = self.backend.launch(request, lines, self.stop)
        result.diagnosis += watchdog.diagnosis if watchdog else []
        result.diagnosis += _aborted_after_return(result)
        result.diagnosis += finding_lines(lines.findings)
        result.diagnosis += self._oom_kills(spec, plan, result)
        self.say(StageEnded(result))
        return result

    def _oom_kills(self, spec: ClusterSpec, plan: LaunchPlan, result: StageResult) -> list[str]:
        """What the kernel's OOM killer ended (diagnose/oom.py); a failed read costs the report nothing."""
        try:
            return name_oom_kills(self.backend, spec, plan, result)
        except Exception as err:  # noqa: BLE001 - the failure is reported without it
            self.console.note(f"kernel log not read: {type(err).__name__}: {err}")
            return []

    def _steps_of(self, spec: ClusterSpec, plan: LaunchPlan) -> StepsWatch:
        """What takes a job launch's step reports (run/steps.py): the hosts' windows judged for
        stragglers, their status kept live; a straggler named is, where recovery.evict_stragglers,
        a spare and the budget allow, evicted at the next checkpoint."""
        eviction = self._eviction = Eviction(self.backend, plan, self.stop, self.console)

        def on_straggler(found: Straggler) -> None:
            if spec.recovery.evict_stragglers and self.budget.spares and \
                    len(self.budget.lost) < spec.recovery.max_host_failures:
                eviction.start(found)

        return StepsWatch(plan, spec.stragglers.threshold, spec.stragglers.window, self.run_dir, self.console,
                          self.say, on_straggler, eviction.held)

    def _first_step(self, progress: Progress) -> None:
        """The relaunched job completed a step: say when training resumed, live."""
        recovery = self.budget.done[-1]
        if recovery.resumed_after_s is None:
            recovery.resumed(progress)
            self.say(RecoveryUpdated(recovery))
            where = recovery.loaded_from()  # a ddplaunch.checkpoint load: its step, and whose RAM or disk
            step = f" {where}" if where else f" at step {recovery.resumed_from}" \
                if recovery.resumed_from is not None else ""
            loaded = f" (it loaded {recovery.loaded[-1]})" if recovery.loaded and not where else ""
            scratch = ": the job did not resume (see job.resume_args)" if recovery.from_scratch else ""
            self.console.note(f"training {'restarted from scratch' if recovery.from_scratch else 'resumed'}{step}"
                              f"{loaded}, {recovery.resumed_after_s:.0f}s after {recovery.since()}{scratch}")

    def _free_port(self, spec: ClusterSpec, stage: Stage, recovery: int = 0) -> int:
        """A free master port for `stage`: the one the pre-flight proved, `master.port`, or one
        derived from the run id (and the recovery: a relaunch takes a fresh port)."""
        addr = master_addr(spec)
        proven, self._proven = self._proven, None
        if proven is not None and proven[:2] == (stage, addr):
            return proven[2]
        if spec.master.port:
            if not self.backend.port_free(addr, spec.master.port):
                raise PlanError(f"master.port {spec.master.port} is already in use on {addr}; free it or "
                                "remove master.port so ddplaunch picks a free one")
            return spec.master.port
        key = stage_port_key(self.run_id, stage) + (f":recovery{recovery}" if recovery else "")
        for attempt in range(PORT_ATTEMPTS):
            port = derive_port(key, attempt)
            if self.backend.port_free(addr, port):
                if attempt and (stage, port) not in self._moved:
                    self._moved.add((stage, port))
                    self.console.note(f"master port {derive_port(key)} is in use on {addr}: using port {port}")
                return port
        raise PlanError(f"no free master port on {addr} after {PORT_ATTEMPTS} tries; set master.port")


def _aborted_after_return(result: StageResult) -> list[str]:
    """Ranks whose script had returned (the entry script said so) yet died by a signal: the job
    finished, the process did not (torch's threads at interpreter exit)."""
    finished = {e.rank: e.code for e in result.rank_exits}
    out = []
    for o in result.outcomes:
        if o.failed_rank is not None and o.rank_exit_code is not None and o.rank_exit_code < 0 \
                and finished.get(o.failed_rank) == 0:
            out.append(f"rank {o.failed_rank} on {o.host} finished its script (exit 0), then died at "
                       f"interpreter exit ({describe_exit(o.rank_exit_code)}): the job's work is done")
    return out
