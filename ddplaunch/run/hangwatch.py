"""The hang watch: a job that printed nothing for `job.hang_timeout` seconds is diagnosed and ended.

`HangWatchdog` runs beside the job stage: after `job.hang_timeout` seconds without a line from
any rank (EVIDENT_S, where the node agents say a host's every rank is stopped) it has every
worker's stack dumped (diagnose/stacks.py), prints where each rank is stuck and ends the run.
Ranks the node agents said are frozen are named so whether or not their host's dump answered. A
host whose ranks are frozen, or whose training link a link test finds broken (diagnose/links.py),
is named as lost: with recovery on, a spare takes its place.

At the job's own pace: silent for `Pace` steps of its own (its rank 0's optimizer steps so far),
the job is suspect, and the link test runs then; a host it finds cut off is named at once rather
than after `job.hang_timeout`. A suspicion that finds nothing ends nothing (an evaluation or a
long checkpoint save between steps is silent too): the next one waits twice as long.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from ddplaunch.diagnose.links import broken_links
from ddplaunch.diagnose.stacks import (DUMP_TIMEOUT, collect_stacks, frozen_by_agents, frozen_hosts, save_stacks,
                                       summarize_stacks)
from ddplaunch.hostside.payloads import HostFrozen
from ddplaunch.hostside.procs import STOPPED
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.launch import LaunchPlan
from ddplaunch.spec.model import ClusterSpec, HostSpec
from ddplaunch.run.runsession import RunSession


#: Seconds without a line from any rank after which a host whose every rank its agent says is
#: stopped ends the wait (job.hang_timeout stays the bound otherwise).
EVIDENT_S = 5.0


class Pace:
    """When the job's silence is suspect: after STEPS of its steps (at the pace of its launch so
    far), at least FLOOR_S; each suspicion that found nothing doubles the wait until the job
    speaks again. Pure: seconds in, a decision out."""

    STEPS, FLOOR_S = 10, 4.0

    def __init__(self) -> None:
        self._backoff = 1.0
        self._heard: Optional[float] = None  # the last line before the silence suspected

    def suspect(self, step_s: Optional[float], idle: float, last_line_at: float) -> bool:
        """Whether a silence of `idle` seconds since `last_line_at` is suspect now (`step_s`:
        the job's seconds a step, None while not known)."""
        if last_line_at != self._heard:
            self._heard, self._backoff = last_line_at, 1.0  # it spoke: a new silence
        return step_s is not None and idle >= self.wait_s(step_s)

    def wait_s(self, step_s: float) -> float:
        return max(self.STEPS * step_s, self.FLOOR_S) * self._backoff

    def cleared(self) -> None:
        """The suspicion found nothing: the next waits twice as long."""
        self._backoff *= 2


#: Where in the run directory the hang watch saves every rank's stack.
STACKS_DIR = "stacks"


class HangWatchdog:
    """Ends a job that printed nothing for `timeout` seconds, after naming where every rank is.

    Use as a context manager around the job stage; `diagnosis` holds the report lines once it fired.
    """

    def __init__(self, session: RunSession, spec: ClusterSpec, plan: LaunchPlan, lines: StageLines, timeout: float,
                 poll: float = 0.5, witnesses: Sequence[HostSpec] = (),
                 frozen: Callable[[], dict[str, HostFrozen]] = dict):
        """Watch `plan`'s launch of `spec`'s hosts (the run's `session`): stacks are saved in the
        run directory's `stacks/`."""
        self.backend, self.spec, self.plan, self.lines, self.stop = session.backend, spec, plan, lines, session.stop
        self.out_dir, self.timeout, self.poll = session.run_dir / STACKS_DIR, timeout, poll
        #: what the node agents say of their frozen ranks now (run/steps.StepsWatch.frozen)
        self.frozen = frozen
        #: spares that take part in the link test (never named)
        self.witnesses = list(witnesses)
        self.diagnosis: list[str] = []
        self.fired_after: Optional[float] = None
        self.pace = Pace()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddplaunch-hang-watchdog", daemon=True)

    def __enter__(self) -> "HangWatchdog":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(timeout=DUMP_TIMEOUT + 10)

    def _watch(self) -> None:
        while not self._done.wait(self.poll):
            if self.stop.is_set():
                return
            ranks_spoke = (self.lines.last_rank_line_at or 0) >= self._started
            heard = max(self._started, self.lines.last_line_at)
            idle = time.monotonic() - heard
            # Until a rank has said anything, the ranks are still starting (importing torch on a
            # loaded host can take longer than the hang timeout): they get the rendezvous timeout
            # on top before silence counts as a hang. A job silent for EVIDENT_S while the node
            # agents say some host's every rank is stopped is not waited for any longer: the
            # evidence the hang rule would find is there already.
            if idle >= self.timeout + (0 if ranks_spoke else self.spec.rdzv_timeout) or \
                    ranks_spoke and idle >= min(EVIDENT_S, self.timeout) and self._pinned():
                self._fire(idle)
                return
            step_s = self._step_s()
            if ranks_spoke and idle < self.timeout and self.pace.suspect(step_s, idle, heard):
                assert step_s is not None
                cut = self._cut_off()
                if cut:
                    self._fire(idle, cut, f"{idle:.0f}s is {idle / step_s:.0f} of the job's steps "
                                          f"({step_s:.2g}s each) and a link test found "
                                          f"{', '.join(cut)} cut off: job.hang_timeout={self.timeout:g} not waited for")
                    return
                self.lines.log_note(f"the job silent {idle:.0f}s ({idle / step_s:.0f} of its steps): a link test found "
                                    f"no host cut off; the next suspicion after {2 * self.pace.wait_s(step_s):.0f}s")
                self.pace.cleared()

    def _step_s(self) -> Optional[float]:
        """The job's seconds a step in this launch so far (rank 0's optimizer steps), None until it
        took two."""
        progress = self.lines.progress
        if progress is None or progress.last_step <= progress.first_step:
            return None
        return (progress.last_at - progress.first_at) / (progress.last_step - progress.first_step)

    def _pinned(self) -> bool:
        """Whether the agents say some host's every rank is stopped (SIGSTOP, a debugger) while
        another host's can run. Not a wait in the kernel (D): a checkpoint's write to a slow file
        system looks the same for a while, and gets the whole job.hang_timeout."""
        stopped = {host: said for host, said in self.frozen().items()
                   if all(state in STOPPED for state, _ in said.states().values())}
        return bool(frozen_by_agents(stopped, [], len(self.plan.nodes))[1])

    def _fire(self, idle: float, cut: Optional[dict[str, str]] = None, why: str = "") -> None:
        """Dump every rank's stack, name the hosts at fault (frozen ranks; `cut`: those a link
        test already found cut off, else a link test now) and end the run."""
        t0 = time.time()
        why = why or (f"job.hang_timeout={self.timeout:g}" if idle >= self.timeout else "and a host's every rank "
                      f"stopped, as its node agent saw: job.hang_timeout={self.timeout:g} not waited for")
        self.lines.note(f"no output from any rank for {idle:.0f}s ({why}): dumping every rank's stack with py-spy")
        try:
            stacks, problems, raw = collect_stacks(self.backend, self.spec, self.plan.run_id,
                                                   [n.host for n in self.plan.nodes if n.host is not None])
        except Exception as err:  # noqa: BLE001 - the run must still be ended
            stacks, problems, raw = [], [f"stack dump failed: {type(err).__name__}: {err}"], {}
        said, whole = frozen_by_agents(self.frozen(), stacks, len(self.plan.nodes))
        stacks += said
        headline = f"hang: no output for {idle:.0f}s (" + ("at the job's pace; " if cut else "") + \
            f"job.hang_timeout={self.timeout:g})"
        lines = [headline + (f"; stuck at: {summarize_stacks(stacks)}" if stacks else "")]
        lines += problems
        try:
            saved = save_stacks(stacks, raw, lines, self.out_dir)
            lines.append(f"full stacks: {saved}/ (dumped in {time.time() - t0:.1f}s)")
        except OSError as err:
            lines.append(f"could not save the stacks in {self.out_dir}: {err}")
        culprits = frozen_hosts(raw) or whole or cut or self._cut_off()
        lines += [f"{host}: {why}" for host, why in culprits.items()]
        self.diagnosis = lines
        self.fired_after = time.monotonic() - self._started
        for line in lines:
            self.lines.note(line)
        self.stop.stop(f"hang: no output from any rank for {idle:.0f}s", lost=culprits)

    def _cut_off(self) -> dict[str, str]:
        """Hosts whose training link the link test finds broken (none when it cannot tell)."""
        hosts = [n.host for n in self.plan.nodes if n.host is not None]
        try:
            return broken_links(self.backend, self.spec, hosts, self.plan.run_id, self.witnesses)
        except Exception as err:  # noqa: BLE001 - the hang is still reported
            self.lines.note(f"link test failed: {type(err).__name__}: {err}")
            return {}
