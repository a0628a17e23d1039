"""What happened to the run's hosts while it ran, as data: a survived failure (`Recovery`: a host
lost, why, what took its place, or the job's own failure restarted on the same hosts; when training
resumed) and a host named slower than its peers (`Straggler`, with the evidence). The run loop and
its judges fill them; readers render them. Data only."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ddplaunch.hostside.payloads import Loaded
from ddplaunch.record.results import Progress


@dataclass
class Recovery:
    """One survived failure, each a relaunch of the job: hosts lost (what, why, what took their
    place), or the job's own failure restarted on the same hosts (`job.max_restarts`: `failure`
    says what failed); when training resumed."""

    number: int
    lost: list[str]
    causes: dict[str, str]
    #: When the first lost host was last heard from (the crash, as near as the launcher knows),
    #: and when the launcher knew it was gone.
    lost_at: float
    detected_at: float
    #: lost host -> the spare put at its node rank (a host left out has none)
    replaced: dict[str, str] = field(default_factory=dict)
    hosts_after: int = 0
    #: The relaunched job's first completed step: seconds after `lost_at`, and the step it resumed from.
    resumed_after_s: Optional[float] = None
    resumed_from: Optional[int] = None
    #: Spares the relaunch could not reach (they died while they waited) -> why; skipped, not counted.
    dead_spares: dict[str, str] = field(default_factory=dict)
    #: Optimizer steps the job had taken in the launch that lost the host (its rank 0's count).
    steps_before: Optional[int] = None
    #: When the failed launch had ended (every survivor stopped), when the relaunch started, and
    #: when its first step completed: with lost_at and detected_at, the recovery's phases.
    stopped_at: Optional[float] = None
    relaunched_at: Optional[float] = None
    first_step_at: Optional[float] = None
    #: What the relaunched job loaded (its checkpoint, if it resumed), and whether it trained
    #: with no load and no word of resuming: restarted from scratch.
    loaded: list[str] = field(default_factory=list)
    from_scratch: bool = False
    #: What it loaded through ddplaunch.checkpoint: the step, and where it was read (a host's
    #: memory, whose save that was; or the durable dir). None when its load said no step.
    checkpoint: Optional[Loaded] = None
    #: A restart (no host lost): what the job's failing rank did, for people (`rank 1 on dlr2 raised
    #: ValueError: boom (train.py:52)`), and what makes a later failure the same one (its
    #: exception's type and line, or its signal; "" when neither is known).
    failure: str = ""
    failure_key: str = ""
    #: Growing back (no host lost): the hosts that came back, added at new node ranks once the
    #: job held at its checkpoint; the world grows from hosts_after - len(grown) to hosts_after.
    grown: list[str] = field(default_factory=list)

    def what(self) -> str:
        """`dlr1, dlr2 lost`, `rank 1 on dlr2 raised ...` (a restart), `dlr3 back` (growing): the cause."""
        return self.failure or (f"{', '.join(self.grown)} back" if self.grown else f"{', '.join(self.lost)} lost")

    def since(self) -> str:
        """What the phases count from: `dlr1 was last heard from`, or `the job failed`."""
        if self.grown:
            return "the job held at its checkpoint"
        return "the job failed" if self.failure else f"{', '.join(self.lost)} was last heard from"

    def describe(self) -> str:
        """`dlr1 lost (no heartbeat for 2s and ...) → replaced by dlr3, resumed after 41s from step 15`,
        or `the job failed (rank 1 on dlr2 raised ...) → restarted on the same 3 hosts, ...`."""
        parts = [f"the job failed ({self.failure}) → restarted on the same {self.hosts_after} hosts"] \
            if self.failure else []
        if self.grown:
            parts.append(f"{', '.join(self.grown)} back → the world grows from {self.hosts_after - len(self.grown)} "
                         f"to {self.hosts_after} hosts")
        for host in self.lost:
            spare = self.replaced.get(host)
            parts.append(f"{host} lost ({self.causes.get(host, '?')}) → "
                         + (f"replaced by {spare}" if spare else f"left out ({self.hosts_after} hosts go on)"))
        parts += [f"spare {spare} skipped ({why})" for spare, why in self.dead_spares.items()]
        text = "; ".join(parts)
        if self.resumed_after_s is not None:
            text += f", {'trained again' if self.from_scratch else 'resumed'} after {self.resumed_after_s:.0f}s"
            where = self.loaded_from()
            text += f" {where}" if where else f" from step {self.resumed_from}" if self.resumed_from is not None else ""
        if self.steps_before is not None:
            text += f"; at least {self.steps_before} optimizer steps done before"  # rank 0 says them once a second
        if self.loaded and not self.loaded_from():
            text += f"; the relaunched job loaded {self.loaded[-1]}"
        elif self.from_scratch:
            text += "; training restarted from scratch: the job did not resume (see job.resume_args)"
        return text

    def loaded_from(self) -> str:
        """`at step 15 from gpu2's memory (gpu1 lost)`, `at step 15 from the durable dir`: the step the
        relaunched job loaded through ddplaunch.checkpoint, and where it was read ("" when unknown)."""
        got = self.checkpoint
        if got is None or got.step is None or not got.source:
            return ""  # a job's own load (its step known: resumed_from) is said by its path
        if got.source == "memory":
            where = f"{got.host}'s memory" if got.host else "a host's memory"
            if got.origin and got.origin != got.host:
                where += f" ({got.origin} lost)" if got.origin in self.lost else f" (a copy of {got.origin}'s save)"
        else:
            where = "the durable dir" if got.source == "durable" else got.path
        return f"at step {got.step} from {where}"

    def resumed(self, progress: Optional[Progress]) -> None:
        """The relaunched job's progress: when its first step completed, and from which step."""
        if progress is not None:
            self.first_step_at = progress.first_at
            self.resumed_after_s = max(0.0, progress.first_at - self.lost_at)
            self.checkpoint = progress.checkpoint
            self.resumed_from = progress.resumed_from
            if self.resumed_from is None and self.checkpoint is not None:
                self.resumed_from = self.checkpoint.step  # what it loaded, when it said no word of resuming
            self.loaded = list(progress.loaded)
            self.from_scratch = (not progress.loaded and progress.resumed_from is None
                                 and progress.optimizer_steps is not None)

    def phases(self) -> str:
        """`named 7s, stopped 9s, relaunched 10s, first step 18s`: each phase's end, in seconds
        after the lost host was last heard from (a restart: after the job failed)."""
        marks = (("named", self.detected_at), ("stopped", self.stopped_at), ("relaunched", self.relaunched_at),
                 ("first step", self.first_step_at))
        return ", ".join(f"{name} {max(0.0, at - self.lost_at):.1f}s" for name, at in marks if at is not None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Straggler:
    """A host found slower than its peers, with the evidence."""

    host: str
    ranks: list[int]
    #: how much longer its ranks compute than their peers' median (0.5: 50 % slower)
    slowdown: float
    #: the first step of the windows it was slow in, and when it was named (wall time)
    since_step: int
    named_at: float
    #: per step, medians over the windows: its ranks' compute share, the peers' compute share,
    #: and the peers' wait at the collectives (what it costs every other rank)
    compute_s: float
    peers_compute_s: float
    peers_wait_s: float
    ranks_slow: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        return (f"{self.host} (rank{'s' if len(self.ranks) > 1 else ''} {ranks}) computes {self.slowdown:.0%} slower "
                f"than its peers since step {self.since_step}: {self.compute_s * 1e3:.0f} ms a step against "
                f"{self.peers_compute_s * 1e3:.0f} ms; every other rank waits {self.peers_wait_s * 1e3:.0f} ms "
                "a step for it")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
