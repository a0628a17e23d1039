"""Where a run's wall time went: the goodput ledger, from the one fold of its events.

The wall time from `up` to the run's end is cut into causes along one timeline, so the parts add
up to the wall time exactly:

- `startup`: from `up` to the job's first completed step (pre-flight, health check, rendezvous,
  the job's imports and its first step);
- `training`: from each launch's first completed step to its last, less what was redone, saved
  and slowed;
- `checkpoint`: the time rank 0 spent inside the job's checkpoint saves between its steps
  (torch.save, torch.distributed.checkpoint.save, seen by the entry's hooks);
- `redone`: steps trained again after a resume (the steps between the checkpoint the relaunched
  job loaded and the step the lost launch had reached), at that launch's pace;
- `slow`: what a straggler cost while it held the run: from the first step it was slow in to the
  end of its launch, each step the excess of its compute over its peers' (the judge's evidence);
- `detection`: from a failed launch's last step to the host failure being named;
- `recovery`: from the failure named to the relaunched job's first completed step (the survivors
  stopped, the relaunch, the job's start and its checkpoint load);
- `other`: the rest (a relaunch after a requeue, the end of the run after its last step).

Steps are what the entry counts inside rank 0's process (record/results.Progress), never a print
convention. Goodput = training / wall. Pure: a view in, seconds out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ddplaunch.plan.launch import Stage
from ddplaunch.record.incidents import Recovery, Straggler
from ddplaunch.record.results import Progress
from ddplaunch.record.view import RunView

#: The causes, in the order of a run's life.
CAUSES = ("startup", "training", "checkpoint", "redone", "slow", "detection", "recovery", "other")
#: Causes a run has only when it met them: said when they cost a second (rounded), fault or not.
MET = ("checkpoint", "slow")


@dataclass(frozen=True)
class Ledger:
    """Seconds of a run's wall time per cause (they add up to `wall_s`), and its host failures."""

    wall_s: float
    parts: dict[str, float]
    faults: int = 0
    #: Relaunches whose checkpoint step is not known (the job loaded it with torch.load and said no
    #: step): their redone steps are not counted, so `redone` is a lower bound.
    unknown_resumes: int = 0

    @property
    def goodput(self) -> float:
        return self.parts["training"] / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """`goodput 72% of 3m39s wall: training 2m38s; lost to startup 22s, redone 4s, detection 6s,
        recovery 25s (2 faults), other 4s` — the causes in a run's order, each one after a fault
        (a healthy run's: those it had)."""
        said = []
        for cause in (c for c in CAUSES if c != "training"):
            if (self.parts[cause] >= 0.5) if cause in MET else (self.parts[cause] > 0 or self.faults):
                faults = f" ({self.faults} fault{'s' if self.faults > 1 else ''})" if cause == "recovery" else ""
                unknown = f" + ? ({self.unknown_resumes} resume's step unknown)" \
                    if cause == "redone" and self.unknown_resumes else ""
                said.append(f"{cause} {duration(self.parts[cause])}{faults}{unknown}")
        return (f"goodput {100 * self.goodput:.0f}% of {duration(self.wall_s)} wall: training "
                f"{duration(self.parts['training'])}" + (f"; lost to {', '.join(said)}" if said else ""))

    def to_dict(self) -> dict[str, object]:
        return {"wall_s": round(self.wall_s, 3), "goodput": round(self.goodput, 4), "faults": self.faults,
                "parts_s": {c: round(s, 3) for c, s in self.parts.items()}, "unknown_resumes": self.unknown_resumes}


def total(ledgers: list[Ledger]) -> Ledger:
    """Runs' ledgers added up: their wall times, seconds per cause and faults (`runs --goodput`)."""
    return Ledger(sum(led.wall_s for led in ledgers), {c: sum(led.parts[c] for led in ledgers) for c in CAUSES},
                  sum(led.faults for led in ledgers), sum(led.unknown_resumes for led in ledgers))


def ledger(view: RunView) -> Optional[Ledger]:
    """The ledger of a run that ended (None before its end, or for a run that never started)."""
    if view.started is None or view.ended is None:
        return None
    timeline = _Timeline(view.started.t, view.ended.t)
    stepped = [r.progress for r in view.stages if r.stage == Stage.JOB and r.progress is not None]
    faults = unknown = 0
    for i, progress in enumerate(stepped):
        timeline.upto(progress.first_at, "startup" if i == 0 else "other")
        timeline.upto(progress.last_at, "training")
        timeline.move("training", "checkpoint", progress.saving_s)
        timeline.move("training", "slow", sum(_slow_s(progress, s) for s in view.stragglers))
        if i + 1 < len(stepped):
            after = stepped[i + 1]
            recovery = _recovery_before(view.recoveries, after)
            if recovery is not None:
                faults += not recovery.grown  # growing back is a planned relaunch, not a fault
                timeline.upto(recovery.detected_at, "detection")
                timeline.upto(after.first_at, "recovery")
                redone = _redone_s(progress, recovery)
                unknown += redone is None
                timeline.move("training", "redone", redone or 0.0)
    timeline.upto(timeline.end, "other" if stepped else "startup")
    return Ledger(timeline.end - timeline.start, timeline.parts, faults, unknown)


#: The job saves "much less often than the optimum" past this many times the optimum's interval;
#: an optimum under MIN_ADVISED_S (a stall of milliseconds: the memory tier's) is no advice.
ADVISE_PAST, MIN_ADVISED_S = 2.0, 10.0


def save_advice(view: RunView, spent: Ledger) -> list[str]:
    """What the job's checkpoint saves cost (their stall, measured inside rank 0) and, where it
    saves much less often than the interval that maximises goodput, that interval (Young/Daly:
    sqrt(2 x stall x MTBF), the MTBF this run's wall time over its host failures), inputs shown."""
    stepped = [s.progress for s in view.stages if s.stage == Stage.JOB and s.progress is not None]
    saves = sum(p.saves for p in stepped)
    if not saves:
        return []
    stall = sum(p.saving_s for p in stepped) / saves
    out = [f"checkpoint saves: {saves}, each stalled training {stall:.2f}s"]
    if spent.faults:
        mtbf = spent.wall_s / spent.faults
        optimum = math.sqrt(2 * stall * mtbf)
        every = sum(p.training_s for p in stepped) / saves
        if every > ADVISE_PAST * optimum and optimum >= MIN_ADVISED_S:
            out.append(f"  saving every {duration(optimum)} instead of every {duration(every)} would maximise goodput "
                       f"(Young/Daly: sqrt(2 x {stall:.2f}s stall x {duration(mtbf)} between failures, this run's "
                       f"{spent.faults} in {duration(spent.wall_s)}))")
    return out


def worth_saying(view: RunView) -> Optional[Ledger]:
    """The ledger the summary and `status` say: of a run that ended having trained (a second at
    least; otherwise the stages' lines say what happened)."""
    spent = ledger(view)
    return spent if spent is not None and spent.parts["training"] >= 1 else None


class _Timeline:
    """Consecutive intervals from `start`, each given to a cause; none runs backwards or past `end`."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, max(start, end)
        self.cursor = start
        self.parts = {cause: 0.0 for cause in CAUSES}

    def upto(self, t: float, cause: str) -> None:
        t = min(max(t, self.cursor), self.end)
        self.parts[cause] += t - self.cursor
        self.cursor = t

    def move(self, src: str, dst: str, seconds: float) -> None:
        seconds = min(max(0.0, seconds), self.parts[src])
        self.parts[src] -= seconds
        self.parts[dst] += seconds


def _recovery_before(recoveries: list[Recovery], after: Progress) -> Optional[Recovery]:
    """The recovery whose relaunch made `after` (its first step is the one the recovery says)."""
    return next((r for r in recoveries if r.first_step_at is not None and abs(r.first_step_at - after.first_at) < 1e-6),
                None)


def _slow_s(launch: Progress, straggler: Straggler) -> float:
    """Seconds `straggler` cost `launch` (0 when it was named in another): the excess of its
    compute over its peers' on every step from the first it was slow in to the launch's last."""
    if not launch.first_at <= straggler.named_at <= launch.last_at:
        return 0.0
    steps = launch.last_step - max(straggler.since_step, launch.first_step) + 1
    return max(0, steps) * max(0.0, straggler.compute_s - straggler.peers_compute_s)


def _redone_s(lost: Progress, recovery: Recovery) -> Optional[float]:
    """Seconds of `lost`'s steps trained again: the steps past the checkpoint the relaunch resumed
    from (its `ddplaunch.checkpoint` load's step, the step the job said, 0 from scratch), at
    `lost`'s pace; None where the step it resumed from is not known."""
    resumed = recovery.resumed_from if recovery.resumed_from is not None else 0 if recovery.from_scratch else None
    if resumed is None:
        return None
    if lost.optimizer_steps is None or lost.last_step <= lost.first_step:
        return 0.0
    reached = (lost.resumed_from or 0) + lost.optimizer_steps
    per_step = lost.training_s / (lost.last_step - lost.first_step)
    return max(0, reached - resumed) * per_step


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
