"""Typed events for tests of the readers (status, top, the page), built from a few values."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from ddplaunch.plan.launch import Stage
from ddplaunch.record.events import RecoveryStarted, StageEnded, StragglerNamed
from ddplaunch.record.incidents import Recovery, Straggler
from ddplaunch.record.results import NodeOutcome, NodeState, StageResult


def stage_ended(states: dict[str, NodeState], codes: Optional[dict[str, Optional[int]]] = None,
                stage: Stage = Stage.JOB, t: Optional[float] = None, interrupted: bool = False) -> StageEnded:
    """A launch that ended with each host's node in `states` (node ranks in the dict's order)."""
    outcomes = [NodeOutcome(node, host, state, (codes or {}).get(host)) for node, (host, state) in enumerate(states.items())]
    at = time.time() if t is None else t
    result = StageResult(stage, outcomes, interrupted=interrupted, started_at=at, ended_at=at)
    return StageEnded(result, t=at)


def recovery_started(number: int, lost: list[str], replaced: dict[str, str], hosts: list[str],
                     t: Optional[float] = None) -> RecoveryStarted:
    at = time.time() if t is None else t
    recovery = Recovery(number, lost, {h: "lost" for h in lost}, lost_at=at, detected_at=at, replaced=replaced,
                        hosts_after=len(hosts))
    return RecoveryStarted(recovery, hosts, t=at)


def straggler_named(host: str, ranks: list[int], slowdown: float, since_step: int, compute_s: float,
                    peers_compute_s: float, peers_wait_s: float, t: Optional[float] = None) -> StragglerNamed:
    at = time.time() if t is None else t
    return StragglerNamed(Straggler(host, ranks, slowdown, since_step, at, compute_s, peers_compute_s, peers_wait_s),
                          t=at)


class Agents:
    """The node agents' part, in-process: each host's ranks' reports folded per window of steps as
    an agent folds them (hostside/fold.py), each host's part handed to `judge`, judged at once.
    `feed` returns the straggler a report makes named, as the run loop would say it."""

    def __init__(self, judge: "StragglerJudge"):
        from ddplaunch.diagnose.stragglers import WARMUP
        from ddplaunch.hostside.fold import StepWindows

        self.judge, self.clock = judge, 0.0
        self.folds: dict[str, StepWindows] = {}
        self._new = lambda: StepWindows(judge.window, WARMUP)
        self.silent: dict[str, list[int]] = {}

    def start(self, host: str, rank: int) -> None:
        self.folds.setdefault(host, self._new()).start(rank, self.clock)

    def feed(self, host: str, timing: "Timing", clock: Optional[float] = None) -> Optional["Straggler"]:
        from ddplaunch.hostside.payloads import HostWindow

        self.clock = self.clock if clock is None else clock
        fold = self.folds.setdefault(host, self._new())
        fold.add(timing.rank, timing.steps, self.clock)
        for part in fold.done():
            self.judge.add(host, HostWindow(**part))
        verdicts = self.judge.judge()
        for h, ranks in verdicts.silent.items():
            self.silent.setdefault(h, []).extend(ranks)
        return verdicts.stragglers[0] if verdicts.stragglers else None


if TYPE_CHECKING:
    from ddplaunch.diagnose.stragglers import StragglerJudge
    from ddplaunch.hostside.payloads import Timing
    from ddplaunch.record.incidents import Straggler
