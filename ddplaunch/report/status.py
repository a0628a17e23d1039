"""`ddplaunch status` read from the run's event log alone (events.py): the run's state, where its
supervisor runs, the stage it is in and the newest step any rank reported, every recovery and
straggler, and each stage's nodes as they ended (or, for the stage that runs, as they are now).

Pure: events in, lines out. What the log cannot say — that its writer died without ending it —
is the caller's `supervisor_alive` (None: not known from here, e.g. the job of a scheduler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ddplaunch.record.events import (Event, HostState, RankSteps, RecoveryStarted, RunEnded, RunStarted, StageEnded,
                                     StageStarted, StragglerNamed)


@dataclass
class _Stage:
    started: StageStarted
    ended: Optional[StageEnded] = None


@dataclass
class RunStatus:
    """The events folded into what `status` says."""

    started: Optional[RunStarted] = None
    stages: list[_Stage] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)
    recoveries: list[RecoveryStarted] = field(default_factory=list)
    stragglers: list[StragglerNamed] = field(default_factory=list)
    newest: Optional[RankSteps] = None
    ended: Optional[RunEnded] = None

    @classmethod
    def of(cls, events: Iterable[Event]) -> "RunStatus":
        view = cls()
        for event in events:
            view.add(event)
        return view

    def add(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.started = event
        elif isinstance(event, StageStarted):
            self.stages.append(_Stage(event))
            self.newest = None if event.stage == "job" else self.newest  # a relaunch counts steps again
        elif isinstance(event, StageEnded) and self.stages:
            self.stages[-1].ended = event
        elif isinstance(event, HostState):
            self.states[event.host] = event.text
        elif isinstance(event, RecoveryStarted):
            self.recoveries.append(event)
        elif isinstance(event, StragglerNamed):
            self.stragglers.append(event)
        elif isinstance(event, RankSteps) and (self.newest is None or event.step >= self.newest.step):
            self.newest = event
        elif isinstance(event, RunEnded):
            self.ended = event

    def state(self, supervisor_alive: Optional[bool], final: Optional[str] = None) -> str:
        if self.ended is not None:
            return self.ended.state
        if final is not None:
            return final
        if supervisor_alive is False:
            pid = self.started.supervisor_pid if self.started else "?"
            return f"supervisor died without ending the run (pid {pid} gone)"
        return "running"

    def lines(self, supervisor_alive: Optional[bool], final: Optional[str] = None,
              now: Optional[float] = None) -> list[str]:
        """What `status` prints (the first line starts with the run id and its state); `final`: the
        state a scheduler gave a run whose log has no end (its job was ended whole)."""
        if self.started is None:
            return []
        s, now = self.started, time.time() if now is None else now
        lines = [f"{s.run_id}: {self.state(supervisor_alive, final)} ({s.backend}; hosts {', '.join(s.hosts)}; "
                 f"supervisor pid {s.supervisor_pid} on {s.supervisor_host})"]
        if self.ended is None and final is not None:
            lines.append("  its job ended without its supervisor logging the end (the scheduler's word)")
        elif self.ended is None and self.stages and self.stages[-1].ended is None:
            now_line = f"  now: stage {self.stages[-1].started.stage}"
            if self.newest is not None:
                now_line += (f", step {self.newest.step} (newest of any rank, reported "
                             f"{max(0.0, now - self.newest.t):.0f}s ago)")
            lines.append(now_line)
        for r in self.recoveries:
            replaced = ", ".join(f"{lost} -> {spare}" for lost, spare in r.replaced.items())
            lines.append(f"  recovery {r.number}: lost {', '.join(r.lost)}"
                         + (f"; replaced {replaced}" if replaced else f"; went on with {len(r.hosts)} hosts"))
        for st in self.stragglers:
            lines.append(f"  straggler: {st.host} (ranks {', '.join(map(str, st.ranks))}) computes "
                         f"{st.slowdown:+.0%} against its peers since step {st.since_step}")
        for stage in self.stages:
            lines += _stage_lines(stage, self.states)
        return lines


def _stage_lines(stage: _Stage, states: dict[str, str]) -> list[str]:
    started, ended = stage.started, stage.ended
    lines = [f"  stage {started.stage}:" + ("" if ended is not None else " (running)")]
    for node, host in enumerate(started.hosts):
        if ended is None:
            lines.append(f"    {host} (node {node}): {states.get(host, 'starting')}")
            continue
        state = ended.states.get(host)
        code = ended.exit_codes.get(host)
        lines.append(f"    {host} (node {node}): {state.value if state is not None else '?'}"
                     + ("" if code is None else f" exit {code}"))
    return lines
