"""The contracts backends fill: the one door through which ddplaunch executes anything.

Every backend is a `Launcher`. `up` never asks which one it holds: it plans a stage (plan/launch.py,
pure), asks the backend to `render` it into a request (pure: the dry run prints exactly
`request.text()`), and has the backend `launch` exactly that request, which returns everything
the stage produced as a `StageResult`; `probe` runs short host programs (pre-flight, stack dumps,
reaping) on every host at once; `down` ends what is left of a recorded run. A backend whose
scheduler can own a whole run without the launcher (Slurm's batch jobs) is also a `Scheduler`
(TorchX's shape: submit, describe, logs, cancel). A backend is made for one run (`RunContext`)
by `backends.make_backend`, from its registration (spec/registry.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, TypeVar, runtime_checkable

from ddplaunch.errors import BackendError
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.launch import LaunchPlan
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import Event
from ddplaunch.record.results import RunState, StageResult
from ddplaunch.record.runs import InJob, RunRecord
from ddplaunch.spec.model import HostSpec


class StopEvent(threading.Event):
    """The event that ends a run early; `cause` says why when ddplaunch itself stopped it (a hang):
    such a run failed, while a stop without a cause is the user's interrupt."""

    def __init__(self) -> None:
        super().__init__()
        self.cause: Optional[str] = None
        #: Hosts ddplaunch found at fault while stopping (label -> why, e.g. its ranks are frozen):
        #: the watcher counts them lost, so a run with recovery replaces them.
        self.lost: dict[str, str] = {}

    def stop(self, cause: str, lost: Optional[dict[str, str]] = None) -> None:
        self.cause = cause
        self.lost = dict(lost or {})
        self.set()

    def reset(self) -> None:
        """Clear a stop ddplaunch made (a hang whose frozen host the run then replaced)."""
        self.cause, self.lost = None, {}
        self.clear()

    @property
    def by_user(self) -> bool:
        """Set, and by the user (Ctrl-C, SIGTERM), not by ddplaunch."""
        return self.is_set() and self.cause is None


@dataclass(frozen=True)
class JobEnd:
    """How a scheduler ended a detached run's job: the run's final state as far as the scheduler
    knows it, and what it said."""

    state: RunState
    detail: str = ""


class HostResult(NamedTuple):
    """One host's answer to a short command: (exit status, output), or the error that kept it
    from answering (its `fix` says what to do)."""

    host: HostSpec
    answer: Optional[tuple[int, str]]
    error: Optional[BackendError]


#: Builds the short command for one host.
CommandFor = Callable[[HostSpec], str]


def _unheard(event: Event) -> None:
    """A backend's word for the run's event log, made where no run is logged (dry run, `status`)."""


@dataclass(frozen=True)
class RunContext:
    """The run a backend is made for: its id, its record's directory, the event that ends it
    (waiting for an allocation stops on it), and where the backend says what only it knows (the
    run's event log: Slurm's allocation, `Allocated`)."""

    run_id: str
    run_dir: Path
    stop: StopEvent
    say: Callable[[Event], None] = field(default=_unheard)


class Request(Protocol):
    """A rendered stage: what the backend executes, as data."""

    plan: LaunchPlan

    def text(self) -> str:
        """The request as the dry run prints it (secrets as <secret>, values probed at launch marked)."""


R = TypeVar("R", bound=Request)


class Launcher(Protocol[R]):
    """What `up`, `check` and `down` need from every backend."""

    name: str

    @property
    def max_parallel(self) -> int:
        """How many hosts `probe` and `launch` talk to at once (the pre-flight's master listens long
        enough for every wave of them): SSH 64, local 1, Slurm every node of the step."""

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        """The nodes stages run on (Slurm: the allocation's nodes, allocated on first use; without
        `allocate`, as far as known without asking anyone — for the dry run)."""

    def spares(self) -> list[HostSpec]:
        """The hosts held in reserve for the run (`recovery.spares`; Slurm: nodes of the allocation,
        known once `hosts()` allocated it)."""

    def allocation_text(self) -> str:
        """What the backend does before any stage (Slurm: the allocation request; else nothing),
        for the dry run."""

    def render(self, plan: LaunchPlan) -> R:
        """The request that runs `plan` (pure)."""

    def launch(self, request: R, lines: StageLines, stop: StopEvent) -> StageResult:
        """Run every node of the request to the end, lines to `lines`; when one node fails or
        `stop` is set, end the rest (backends/failfast.py). One outcome per node, and everything the
        stage's ranks reported, in the result."""

    def reach(self, hosts: list[HostSpec], timeout: float = 30) -> list[HostResult]:
        """Whether each host can be reached at all (SSH: connected, the connection kept for what
        follows), at once; a host that cannot be gets its error. No command needs to run."""

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        """Run a short command, built per host, on every host (or `hosts`) at once."""

    def port_free(self, addr: str, port: int) -> bool:
        """Whether `port` can be bound on the master host."""

    def down(self, record: RunRecord) -> list[str]:
        """End every process left of a recorded run; one line per host on what was done."""

    def close(self) -> None:
        """Release connections (and an allocation the backend made); once, when the run is over."""


@dataclass(frozen=True)
class Admitted:
    """A start gate's yes: the stage starts, its ranks on `socket_ifname` (Gloo's and NCCL's
    interface) where the gate found the one every host reaches the master through."""

    socket_ifname: Optional[str] = None


class StartGate(Protocol):
    """A check that rides in a launch's own sessions before anything starts (the pre-flight's
    probe: one SSH round per host, not one for the probe and one for the stage)."""

    #: Seconds a host's check may take (the master's probe listens for every wave of hosts).
    timeout: float

    def command(self, host: HostSpec) -> str:
        """The shell command that checks `host`, run in its session before the stage's line."""

    def admit(self, outputs: dict[str, tuple[int, str]], errors: dict[str, BackendError]) -> Optional[Admitted]:
        """Every host's (exit status, output) of its check, or the error that kept it from
        answering: whether the stage starts (None: every session ends, nothing started)."""


@runtime_checkable
class SessionGated(Protocol):
    """A launcher whose stage sessions can run a `StartGate` before the stage starts (SSH)."""

    def launch_gated(self, request: Any, lines: StageLines, stop: StopEvent, gate: StartGate
                     ) -> Optional[StageResult]:
        """`launch`, with `gate` checked in the nodes' sessions first; None when it said no."""


@runtime_checkable
class Scheduler(Protocol):
    """A backend whose scheduler can own a whole run without the launcher: a job of its own that
    runs the run's supervisor where the run's nodes are."""

    def render_detached(self, spec_path: str, opts: UpOptions) -> Request:
        """The request that hands the run (the backend's spec and run id, `opts` the command
        line's options) to the scheduler (pure: `up --dry-run --detach`)."""

    def submit(self, request: Request, record: RunRecord) -> InJob:
        """Submit a `render_detached` request (the job is recorded in the run's directory): the
        job the run's supervisor runs in, and where it went and how to follow it."""

    def final_state(self, record: RunRecord) -> Optional[JobEnd]:
        """How its scheduler ended a detached run's job (ok, failed, cancelled, or unknown when it
        no longer knows the job); None while it runs (or for a run that was not detached)."""

    def describe(self, record: RunRecord) -> list[str]:
        """Lines on the live state of a recorded run's job."""

    def log_lines(self, record: RunRecord, follow: bool) -> Optional[Iterator[str]]:
        """A detached run's output lines from where its scheduler keeps them (None: the record's log)."""

    def job_running(self, record: RunRecord) -> bool:
        """Whether a detached run's job is queued or running (may still write to the run)."""

    def cancel(self, record: RunRecord) -> list[str]:
        """End the run's job."""
