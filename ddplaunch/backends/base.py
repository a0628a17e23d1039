"""The backend contract and the per-node results every backend returns.

A backend is the only code that executes anything. It takes a pure `LaunchPlan`, runs every
node's command, streams whole output lines to a `LineSink`, and returns a `StageResult` with
one `NodeOutcome` per node — never just the first exception.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO, Callable, Optional, Protocol

from ddplaunch.plan import LaunchPlan
from ddplaunch.spec import HostSpec

TAIL_LINES = 40

# Node states, in the order a report lists them (worst first).
FAILED, LOST, UNREACHABLE, INTERRUPTED, RUNNING, NOT_STARTED, OK = (
    "failed", "lost", "unreachable", "interrupted", "running", "not-started", "ok")
STATE_ORDER = (FAILED, LOST, UNREACHABLE, INTERRUPTED, RUNNING, NOT_STARTED, OK)


@dataclass
class NodeOutcome:
    """How one node's torchrun ended."""

    node_rank: int
    host: str
    state: str = NOT_STARTED
    exit_code: Optional[int] = None
    detail: str = ""
    failed_rank: Optional[int] = None
    failed_local_rank: Optional[int] = None
    rank_exit_code: Optional[int] = None
    ended_at: Optional[float] = None
    tail: list[str] = field(default_factory=list)
    #: Times torchrun restarted this node's workers (`job.max_restarts`).
    restarts: int = 0
    #: The run ended before this node's torchrun started (its setup lines were still running).
    never_started: bool = False

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
    """Every node's outcome of one stage."""

    stage: str
    outcomes: list[NodeOutcome]
    interrupted: bool = False
    started_at: float = field(default_factory=time.time)
    ended_at: Optional[float] = None
    #: What ddplaunch found out about the failure (hang stacks, collective mismatches), for the report.
    diagnosis: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(o.state == OK for o in self.outcomes)

    @property
    def first_failure(self) -> Optional[NodeOutcome]:
        """The node that failed first (by end time), if any did."""
        bad = [o for o in self.outcomes if o.state in (FAILED, LOST, UNREACHABLE)]
        return min(bad, key=lambda o: o.ended_at or float("inf")) if bad else None

    def to_dict(self) -> dict:
        return asdict(self)


def describe_exit(code: Optional[int]) -> str:
    """`exit code 3`, or `killed by SIGKILL` for torchrun's negative codes."""
    import signal

    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class StopEvent(threading.Event):
    """The event that ends a run early; `cause` says why when ddplaunch itself stopped it (a hang):
    such a run failed, while a stop without a cause is the user's interrupt."""

    cause: Optional[str] = None

    def stop(self, cause: str) -> None:
        self.cause = cause
        self.set()


def stop_cause(stop: threading.Event) -> Optional[str]:
    """Why ddplaunch stopped the run, or None for a user interrupt (or no stop at all)."""
    return getattr(stop, "cause", None)


_PAYLOAD_RE = re.compile(r"\bDDPLAUNCH_([A-Z]+)_JSON (\{.*\})\s*$")
_RANK_RE = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT_RE = re.compile(r"\bexitcode\s*:\s*(-?\d+)")
#: Lines worth repeating in the summary however far they scrolled: PyTorch's collective
#: consistency check (TORCH_DISTRIBUTED_DEBUG=DETAIL) and rendezvous/store timeouts.
FINDING_RE = re.compile(r"Detected mismatch between collectives|DistStoreError|DistNetworkError")
MAX_FINDINGS = 50


def parse_torchrun_failure(lines: list[str]) -> Optional[tuple[int, int, int]]:
    """(global rank, local rank, exit code) of torchrun's "Root Cause" report, if present."""
    for i, line in enumerate(lines):
        if "Root Cause" in line:
            rest = lines[i:]
            rank = next((m for m in map(_RANK_RE.search, rest) if m), None)
            code = next((m for m in map(_EXIT_RE.search, rest) if m), None)
            if rank:
                return int(rank.group(1)), int(rank.group(2)), int(code.group(1)) if code else None
    return None


class LineSink:
    """Writes whole lines from every node, each carrying its host, to a stream and a log file.

    torchrun prefixes worker lines with `[host:rank] ` itself; lines of torchrun or the shell
    get `[host] ` here, so every line says where it came from.
    """

    def __init__(self, stream: Optional[IO[str]] = None, log: Optional[IO[str]] = None):
        self._stream = stream if stream is not None else sys.stdout
        self._log = log
        self._lock = threading.Lock()
        self._tails: dict[int, deque[str]] = {}
        #: Payloads of `DDPLAUNCH_<NAME>_JSON {...}` lines (the health check's result), by NAME.
        self.payloads: dict[str, str] = {}
        #: When the last line from any node arrived (the hang watchdog's clock).
        self.last_line_at = time.time()
        #: Lines matching FINDING_RE, in arrival order (at most MAX_FINDINGS).
        self.findings: list[str] = []

    def emit(self, node_rank: int, host: str, line: str) -> None:
        line = line.rstrip("\r\n")
        if not line.startswith(f"[{host}:"):
            line = f"[{host}] {line}"
        marker = _PAYLOAD_RE.search(line)
        with self._lock:
            self.last_line_at = time.time()
            if FINDING_RE.search(line) and len(self.findings) < MAX_FINDINGS:
                self.findings.append(line)
            if marker:  # machine-readable: kept and logged, not shown on the console
                self.payloads[marker.group(1)] = marker.group(2)
            else:
                self._tails.setdefault(node_rank, deque(maxlen=TAIL_LINES)).append(line)
                self._write(line)
            if self._log is not None:
                self._log.write(line + "\n")
                self._log.flush()

    def note(self, text: str) -> None:
        """A line from ddplaunch itself."""
        self.block(f"[ddplaunch] {text}")

    def block(self, text: str) -> None:
        """Lines from ddplaunch as they are (tables, summaries)."""
        text = text.rstrip("\n")
        with self._lock:
            self._write(text)
            if self._log is not None:
                self._log.write(text + "\n")
                self._log.flush()

    def payload(self, name: str) -> Optional[dict]:
        """The last `DDPLAUNCH_<NAME>_JSON` payload, parsed (None if absent or not valid JSON)."""
        raw = self.payloads.get(name)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def state(self, host: str, text: str) -> None:
        """A host's current state (connecting, running a stage, exited): shown live on a
        terminal by `ddplaunch.live.LiveSink`; plain output has the log lines for it."""

    def close(self) -> None:
        """End live output, if any."""

    def _write(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()

    def tail(self, node_rank: int) -> list[str]:
        with self._lock:
            return list(self._tails.get(node_rank, ()))


def finish_outcome(outcome: NodeOutcome, sink: LineSink, exit_code: Optional[int]) -> NodeOutcome:
    """Fill an outcome from an exit code and the node's last lines."""
    outcome.ended_at = time.time()
    outcome.tail = sink.tail(outcome.node_rank)
    outcome.exit_code = exit_code
    if outcome.state in (INTERRUPTED, LOST, UNREACHABLE):
        return outcome
    outcome.state = OK if exit_code == 0 else FAILED
    if exit_code != 0:
        found = parse_torchrun_failure(outcome.tail)
        if found:
            outcome.failed_rank, outcome.failed_local_rank, outcome.rank_exit_code = found
    sink.state(outcome.host, f"{outcome.state} (exit {exit_code})")
    return outcome


StageCallback = Callable[[LaunchPlan, StageResult, LineSink], None]
#: One host's answer to a short command: (host, (exit status, output) or None, error or None).
HostResult = tuple[HostSpec, Optional[tuple[int, str]], Optional[Exception]]


def run_in_order(backend: "Backend", plans: list[LaunchPlan], sink: LineSink, stop: threading.Event,
                 on_stage: StageCallback) -> list[StageResult]:
    """`run_all` of backends that launch stage by stage: stop after the first failed stage."""
    results = []
    for plan in plans:
        sink.note(f"stage {plan.stage}: master {plan.master_addr}:{plan.master_port}")
        result = backend.run(plan, sink, stop)
        results.append(result)
        on_stage(plan, result, sink)
        if not result.ok:
            break
    return results


class Backend(Protocol):
    """What `up` needs from a backend: the one place that executes."""

    def run_all(self, plans: list[LaunchPlan], sink: LineSink, stop: threading.Event,
                on_stage: StageCallback) -> list[StageResult]:
        """Run the stages in order (health check, job); `on_stage` after each one ends."""

    def port_free(self, addr: str, port: int) -> bool:
        """Whether `port` can be bound on the master host."""

    def run(self, plan: LaunchPlan, sink: LineSink, stop: threading.Event) -> StageResult:
        """Run every node of `plan` to the end; when one fails or `stop` is set, end the rest."""

    def down(self, run_id: str) -> list[str]:
        """End every process left of run `run_id`; returns one line per host on what was done."""

    def run_short(self, command: Callable[[HostSpec], str], timeout: float = 30) -> list[HostResult]:
        """Run a short command, built per host, on every host at once (pre-flight probes)."""

    def close(self) -> None:
        """Release connections; called once when the run is over."""
