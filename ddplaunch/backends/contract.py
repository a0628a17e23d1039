"""The contract every backend fills: the one door through which ddplaunch executes anything.

`up` never asks which backend it holds. It plans a stage (plan.py, pure), asks the backend to
`render` it into a request (pure: the dry run prints exactly `request.text()`), and has the
backend `launch` exactly that request; `probe` runs short host programs (pre-flight, stack
dumps, reaping, restart counts) on every node at once. Run records are data: `status`, `logs`
and `down` take a record and answer from it. What a backend cannot do is declared in
spec.BACKEND_LIMITS, so the spec is refused before anything runs.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

from ddplaunch.console import LineSink
from ddplaunch.plan import LaunchPlan
from ddplaunch.results import StageResult
from ddplaunch.spec import HostSpec

#: One host's answer to a short command: (host, (exit status, output) or None, error or None).
HostResult = tuple[HostSpec, Optional[tuple[int, str]], Optional[Exception]]
#: Builds the short command for one host.
CommandFor = Callable[[HostSpec], str]


class Request(Protocol):
    """A rendered stage: what the backend executes, as data."""

    plan: LaunchPlan

    def text(self) -> str:
        """The request as the dry run prints it (secrets as <secret>, values probed at launch marked)."""


class Backend(Protocol):
    """What `up`, `check`, `status`, `logs` and `down` need from a backend."""

    name: str
    #: How many hosts `probe` and `launch` talk to at once (the pre-flight's master listens long
    #: enough for every wave of them): SSH 64, local 1, Slurm every node of the step.
    max_parallel: int

    def start_run(self, run_id: str, run_dir: Path, stop: threading.Event) -> None:
        """A run begins: where its record lives (Slurm records its allocation there) and the event
        that ends it (waiting for an allocation stops on it)."""

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        """The nodes stages run on (Slurm: the allocation's nodes, allocated on first use; without
        `allocate`, as far as known without asking anyone — for the dry run)."""

    def allocation_text(self) -> str:
        """What the backend does before any stage (Slurm: the allocation request), for the dry run."""

    def render(self, plan: LaunchPlan) -> Request:
        """The request that runs `plan` (pure)."""

    def launch(self, request: Request, sink: LineSink, stop: threading.Event) -> StageResult:
        """Run every node of the request to the end, lines to `sink`; when one node fails or
        `stop` is set, end the rest. One outcome per node, never just the first exception."""

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        """Run a short command, built per host, on every host (or `hosts`) at once."""

    def port_free(self, addr: str, port: int) -> bool:
        """Whether `port` can be bound on the master host."""

    def render_detached(self, plans: list[LaunchPlan]) -> Request:
        """The request that hands every stage, in order, to a scheduler that runs them without
        the launcher (pure: `up --dry-run --detach` prints its text). Backends without a
        scheduler raise PlanError saying so."""

    def detach(self, request: Request, run_dir: Path) -> str:
        """Submit a `render_detached` request (the job is recorded in `run_dir`); where it went."""

    def final_state(self, record: dict) -> Optional[str]:
        """A detached run's final state ("ok", "failed", "cancelled") once its scheduler has
        finished it; None while it runs, or when the backend detaches nothing."""

    def status(self, record: dict) -> list[str]:
        """Lines on the live state of a recorded run beyond its record (Slurm: the job)."""

    def logs(self, record: dict, follow: bool) -> Optional[Iterator[str]]:
        """A run's output lines when the backend keeps them elsewhere than the record (None: use
        the record's log)."""

    def down(self, record: dict) -> list[str]:
        """End every process left of a recorded run; one line per host on what was done."""

    def close(self) -> None:
        """Release connections (and an allocation the backend made); once, when the run is over."""
