"""What a stage left behind: one `NodeOutcome` per node, gathered in a `StageResult`; the run's
and its nodes' states as values (`RunState`, `NodeState`).

Every backend returns these, whatever it drives: the nodes' outcomes and everything the stage's
ranks reported (the health check's verdict, each rank's exit, PyTorch's findings). The gates, the
run loop and the event log read them; nothing reads the console. Data only: no I/O, no backend.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from ddplaunch.hostside.payloads import Durable, Loaded, RankExit, RankFailed, RankStart
from ddplaunch.plan.launch import Stage
from ddplaunch.record.codec import to_data
from ddplaunch.record.diagnosis import HealthVerdict


class RunState(StrEnum):
    """Where a run stands: handed to a scheduler whose job has not started it, running, or how it
    ended (its scheduler's word when its supervisor could not say: cancelled, unknown). A str:
    the event log and `--json` hold its value."""

    SUBMITTED = "submitted"
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def active(self) -> bool:
        return self in (RunState.SUBMITTED, RunState.RUNNING)


class NodeState(StrEnum):
    """How a node of a stage stands, in the order a report lists them (worst first). A str: the
    record, the event log and `--json` hold its value."""

    FAILED = "failed"
    LOST = "lost"
    UNREACHABLE = "unreachable"
    INTERRUPTED = "interrupted"
    RUNNING = "running"
    NOT_STARTED = "not-started"
    OK = "ok"


FAILED, LOST, UNREACHABLE, INTERRUPTED, RUNNING, NOT_STARTED, OK = NodeState
STATE_ORDER = tuple(NodeState)
#: States that say the host, not the job, failed: the host is gone or cannot be reached.
HOST_STATES = (LOST, UNREACHABLE)


@dataclass
class NodeOutcome:
    """How one node's torchrun ended."""

    node_rank: int
    host: str
    state: NodeState = NOT_STARTED
    exit_code: Optional[int] = None
    detail: str = ""
    failed_rank: Optional[int] = None
    failed_local_rank: Optional[int] = None
    rank_exit_code: Optional[int] = None
    ended_at: Optional[float] = None
    tail: list[str] = field(default_factory=list)
    #: The failing rank's own last lines (its exception), from its per-rank output.
    cause: list[str] = field(default_factory=list)
    #: The failing rank only saw a peer die (its own words say so): it did not fail by itself.
    victim: bool = False
    #: What the failing rank's script raised (its type, message and line), as the rank said it.
    failure: Optional[RankFailed] = None
    #: Times torchrun restarted this node's workers (`job.max_restarts`).
    restarts: int = 0
    #: The run ended before this node's torchrun started (its setup lines were still running).
    never_started: bool = False
    #: For a lost host: when it was last heard from (its last heartbeat or line).
    last_heard_at: Optional[float] = None
    #: The node's command ended without an exit status on a host that answers: a signal ended it
    #: there (a SIGKILLed or OOM-killed torchrun, srun's "Killed").
    signalled: bool = False
    #: Its host's kernel log says the OOM killer ended these of the node's processes (diagnose/oom.py).
    oom_killed: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: host, node, state, exit code or signal, failing rank."""
        if self.never_started:
            return (f"{self.host} (node {self.node_rank}): torchrun never started (blocked before launch)"
                    + (f"; {self.detail}" if self.detail else ""))
        text = f"{self.host} (node {self.node_rank}): {self.state}"
        if self.exit_code is not None:
            text += f", exit code {self.exit_code}"
        if self.failed_rank is not None:
            text += (f"; rank {self.failed_rank} (local rank {self.failed_local_rank}) "
                     f"{describe_exit(self.rank_exit_code)}")
        if self.restarts:
            text += f"; workers restarted {self.restarts}x"
        if self.detail:
            text += f"; {self.detail}"
        return text


@dataclass
class StageResult:
    """Every node's outcome of one stage, and what its ranks reported."""

    stage: Stage
    outcomes: list[NodeOutcome]
    interrupted: bool = False
    started_at: float = field(default_factory=time.time)
    ended_at: Optional[float] = None
    #: What ddplaunch found out about the failure (hang stacks, collective mismatches), for the report.
    diagnosis: list[str] = field(default_factory=list)
    #: The backend's hosts were taken away and given back under the stage (a scheduler requeued
    #: the allocation): every stage runs again.
    rescheduled: bool = False
    #: Whether this launch ran the health check (the plan said so), and rank 0's verdict if it
    #: reported one (`DDPLAUNCH_HEALTHCHECK_JSON`).
    ran_healthcheck: bool = False
    healthcheck: Optional[HealthVerdict] = None
    #: Each rank's `DDPLAUNCH_RANKEXIT_JSON` report: its script returned with this code.
    rank_exits: list[RankExit] = field(default_factory=list)
    #: Each rank's start (`DDPLAUNCH_RANKSTART_JSON`): its pid and host, its restart count.
    rank_starts: list[RankStart] = field(default_factory=list)
    #: Each rank's exception that ended its script (`DDPLAUNCH_RANKFAILED_JSON`): type, message, where.
    rank_failures: list[RankFailed] = field(default_factory=list)
    #: Lines worth repeating however far they scrolled (collective mismatches, store errors).
    findings: list[str] = field(default_factory=list)
    #: The job's progress as its ranks printed it (torchrun_logs.STEP_RE), if they did.
    progress: Optional["Progress"] = None
    #: The hosts it lost were replaced and the stage launched again (the number of that recovery).
    recovered: Optional[int] = None

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.rescheduled and all(o.state == OK for o in self.outcomes)

    @property
    def first_failure(self) -> Optional[NodeOutcome]:
        """The node that failed first, if any did: by end time, but a node whose failing rank only
        saw a peer die (its own words say so) comes after one that failed by itself."""
        bad = [o for o in self.outcomes if o.state in (FAILED, LOST, UNREACHABLE)]
        return min(bad, key=lambda o: (o.victim, o.ended_at or float("inf"))) if bad else None

    @property
    def lost_hosts(self) -> list[NodeOutcome]:
        """Nodes whose host was lost or unreachable (not a failure of the job's own code)."""
        return [o for o in self.outcomes if o.state in HOST_STATES]

    @property
    def host_failure(self) -> bool:
        """The stage failed because hosts were lost, not because the job failed: some host is
        lost, and every node that failed only saw a peer die (its rank's own words), never
        started, or was stopped. A rank that failed by itself on a host that answers is the
        job's failure, whatever else happened."""
        if not self.lost_hosts or self.interrupted:
            return False
        return all(o.state != FAILED or o.never_started or o.victim for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        """The stage as `--json` shows it."""
        data: dict[str, Any] = to_data(self)
        data["healthcheck"] = self.healthcheck.to_dict() if self.healthcheck is not None else None
        return data


@dataclass
class Progress:
    """When a launch's job made progress: its first and last completed step (optimizer steps its
    rank 0 reported from inside the process, hostside/entry.py, or else `step=N` lines), the step a
    resumed job said it resumed from, and the checkpoints it loaded."""

    first_at: float
    first_step: int
    last_at: float
    last_step: int
    resumed_from: Optional[int] = None
    #: Optimizer steps rank 0 took in this launch (None: not seen, e.g. no torch.optim).
    optimizer_steps: Optional[int] = None
    #: What rank 0 loaded (torch.load, torch.distributed.checkpoint.load): paths.
    loaded: list[str] = field(default_factory=list)
    #: Rank 0's newest load through ddplaunch.checkpoint: its step, where it was read (a host's
    #: memory, and whose save it was; or the durable dir). None when no load said a step.
    checkpoint: Optional[Loaded] = None
    #: Seconds rank 0 spent inside checkpoint saves between its first and last step (torch.save,
    #: torch.distributed.checkpoint.save: the training stood still meanwhile).
    saving_s: float = 0.0
    #: The checkpoint saves those seconds were spent in (torch.save, dcp, ddplaunch.checkpoint.save).
    saves: int = 0
    #: Rank 0's word at its exit that its newest ddplaunch.checkpoint save is durable (or why not).
    durable: Optional[Durable] = None

    @property
    def training_s(self) -> float:
        return self.last_at - self.first_at


def job_failure(node: NodeOutcome) -> tuple[str, str]:
    """What a failed node's failing rank did, for people, and what makes a repeat the same failure:
    the exception's type and line, or the signal that ended it ("" for an exit code alone, which
    says too little to call two failures the same)."""
    who = f"rank {node.failed_rank} on {node.host}" if node.failed_rank is not None else node.host
    raised = node.failure
    if raised is not None:
        message = raised.message.splitlines()[0][:200] if raised.message else ""
        where = f" ({raised.file.rsplit('/', 1)[-1]}:{raised.line})" if raised.file else ""
        return (f"{who} raised {raised.exc_type}{': ' + message if message else ''}{where}",
                f"{raised.exc_type} at {raised.file}:{raised.line}")
    code = node.rank_exit_code if node.failed_rank is not None else node.exit_code
    return f"{who} {describe_exit(code)}", (f"signal {-code}" if code is not None and code < 0 else "")


def describe_exit(code: Optional[int]) -> str:
    """`exit code 3`, or `killed by SIGKILL` for torchrun's negative codes."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
