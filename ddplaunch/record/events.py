"""A run's event log: typed events appended to `events.jsonl` in the run directory, one per line.

The process that runs the run loop (the supervisor, or `ddplaunch.up` in-process) appends every
line the screen shows (`Shown`), each host's live state (`HostState`), stage boundaries, recoveries
each rank's step timing (`RankSteps`), a straggler named (`StragglerNamed`) and the end (`RunEnded`:
state, exit code, summary). Readers (`attach`, `up` in the foreground,
`ddplaunch.submit(...).events()`) replay the file and follow it; it is fsynced at stage boundaries,
recoveries and the end. Each event carries the wall time (`t`) and the writer's monotonic clock
(`mono`, for intervals). Data and file I/O only: no backend, no console.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Callable, ClassVar, Iterator, Optional, Union

from ddplaunch.record.results import NodeState

EVENTS_FILE = "events.jsonl"
#: Seconds between reads of a log that has nothing new (a line reaches a follower within this).
FOLLOW_POLL = 0.02


@dataclass
class _Event:
    KIND: ClassVar[str] = ""
    t: float = field(default_factory=time.time, kw_only=True)
    mono: float = field(default_factory=time.monotonic, kw_only=True)


@dataclass
class RunStarted(_Event):
    """The supervisor took the run: where it runs (pid and host), on which backend and hosts."""

    KIND: ClassVar[str] = "run-started"
    run_id: str
    backend: str
    hosts: list[str]
    supervisor_pid: int
    supervisor_host: str


@dataclass
class Shown(_Event):
    """A line the screen showed (a rank's line, folded lines, a note, a table)."""

    KIND: ClassVar[str] = "shown"
    text: str


@dataclass
class HostState(_Event):
    """A host's current state, as the live table shows it (connecting, running job, ok (exit 0))."""

    KIND: ClassVar[str] = "host-state"
    host: str
    text: str


@dataclass
class StageStarted(_Event):
    KIND: ClassVar[str] = "stage-started"
    stage: str
    master: str
    port: int
    hosts: list[str]


@dataclass
class StageEnded(_Event):
    """A launch ended: every node's state and whether the stage passed."""

    KIND: ClassVar[str] = "stage-ended"
    stage: str
    ok: bool
    states: dict[str, NodeState]
    host_failure: bool = False
    #: each node's torchrun exit code, where it ended with one (older logs: none)
    exit_codes: dict[str, Optional[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:  # read back from the log: the values as the enum again
        self.states = {host: NodeState(state) for host, state in self.states.items()}


@dataclass
class RecoveryStarted(_Event):
    """Hosts were lost and the run relaunches on `hosts` (spares at the lost node ranks)."""

    KIND: ClassVar[str] = "recovery"
    number: int
    lost: list[str]
    replaced: dict[str, str]
    hosts: list[str]


@dataclass
class RankSteps(_Event):
    """A rank's timing report (hostside/steptiming.py): its newest step and, over the steps it
    reported since its last, the median step time and wait at the collectives."""

    KIND: ClassVar[str] = "rank-steps"
    host: str
    rank: int
    step: int
    step_s: float
    wait_s: float


@dataclass
class StragglerNamed(_Event):
    """A host whose ranks compute slower than their peers (stragglers.Straggler's fields)."""

    KIND: ClassVar[str] = "straggler"
    host: str
    ranks: list[int]
    slowdown: float
    since_step: int
    compute_s: float
    peers_compute_s: float
    peers_wait_s: float


@dataclass
class RunEnded(_Event):
    """The run's end: its final state and exit code, the summary people read, `--json`'s object;
    `error` when it ended on an error before or between stages (what `ddplaunch: error:` says)."""

    KIND: ClassVar[str] = "run-ended"
    state: str
    exit_code: int
    summary: str = ""
    summary_json: str = ""
    error: str = ""


Event = Union[RunStarted, Shown, HostState, StageStarted, StageEnded, RecoveryStarted, RankSteps, StragglerNamed,
              RunEnded]
KINDS: dict[str, type] = {c.KIND: c for c in (RunStarted, Shown, HostState, StageStarted, StageEnded,
                                                RecoveryStarted, RankSteps, StragglerNamed, RunEnded)}
#: Events after which the log is fsynced: a reader on another machine, or after a crash, finds them.
DURABLE = (RunStarted, StageStarted, StageEnded, RecoveryStarted, StragglerNamed, RunEnded)


def to_line(event: Event) -> str:
    return json.dumps({"kind": event.KIND, **asdict(event)}, sort_keys=True)


def from_line(line: str) -> Optional[Event]:
    """The event a log line holds; None for a line that is not one (torn, or of a newer kind)."""
    try:
        data = json.loads(line)
        cls = KINDS[data.pop("kind")]
        names = {f.name for f in fields(cls)}
        event: Event = cls(**{k: v for k, v in data.items() if k in names})
        return event
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class EventLog:
    """The writer: appends events to the run's `events.jsonl` (0600), thread-safe."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / EVENTS_FILE
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file: IO[str] = os.fdopen(fd, "a")
        self._lock = threading.Lock()

    def append(self, event: Event) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write(to_line(event) + "\n")
            self._file.flush()
            if isinstance(event, DURABLE):
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(run_dir: Path) -> list[Event]:
    """Every event logged so far (none when the log does not exist yet)."""
    try:
        with open(run_dir / EVENTS_FILE) as f:
            return [e for e in map(from_line, f) if e is not None]
    except FileNotFoundError:
        return []


def follow(run_dir: Path, alive: Callable[[], bool]) -> Iterator[Event]:
    """Every event from the first, then each new one as it is appended, until `RunEnded` (the last
    one yielded), or until `alive()` says to stop following (the writer is gone) and what it wrote
    has been read. A torn last line is read again once complete."""
    path = run_dir / EVENTS_FILE
    pending = ""
    f: Optional[IO[str]] = None
    try:
        while True:
            if f is None and path.exists():
                f = open(path)
            chunk = f.readline() if f is not None else ""
            if chunk:
                pending += chunk
                if not pending.endswith("\n"):
                    continue
                event, pending = from_line(pending), ""
                if event is None:
                    continue
                yield event
                if isinstance(event, RunEnded):
                    return
                continue
            if not alive():
                rest = f.read() if f is not None else ""
                for line in (pending + rest).splitlines():
                    last_event = from_line(line)
                    if last_event is not None:
                        yield last_event
                return
            time.sleep(FOLLOW_POLL)
    finally:
        if f is not None:
            f.close()
