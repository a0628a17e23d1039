"""A run's event log, its one memory: typed events appended to `events.jsonl` in the run directory.

The process that runs the run loop (the supervisor, or `ddplaunch.up` in-process) appends every
fact the run establishes, once, as it happens: the run taken (`RunStarted`), what the backend
executed (`Requested`), the pre-flight's table, each launch's start and its whole result
(`StageStarted`, `StageEnded`), every host's state, every gate's decision (`HostsExcluded`,
`SparesRejected`, `Replanned`, `GateStopped`), a localization, recoveries and their resumption,
each window of steps as judged (one number per host, not per rank), ranks gone silent, a
straggler named, a spare dropped, a requeued allocation, every line the screen shows (`Shown`)
and the end (`RunEnded`). Everything that reads a run — the summary, `status`, `top`, `attach`,
the page, the Python API — folds these events (record/view.py); nothing keeps a second copy.
Each event carries the wall time (`t`) and the writer's monotonic clock (`mono`, for intervals);
the log is fsynced after the events in `DURABLE`. Data and file I/O only: no backend, no console.
"""

from __future__ import annotations

import json
import os
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, ClassVar, Iterator, Optional, Sequence, Union

from ddplaunch.plan.launch import Stage
from ddplaunch.record.codec import from_data, to_data
from ddplaunch.record.diagnosis import Gate, Localization, PreflightReport
from ddplaunch.record.incidents import Recovery, Straggler
from ddplaunch.record.results import NodeState, RunState, StageResult

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
    """The supervisor took the run: where it runs (pid and host), on which backend and hosts, and
    the launch that ends it (`job`, or `healthcheck` for `check`)."""

    KIND: ClassVar[str] = "run-started"
    run_id: str
    backend: str
    hosts: list[str]
    supervisor_pid: int
    supervisor_host: str
    final_stage: Stage = Stage.JOB


@dataclass
class Requested(_Event):
    """What the backend executed (or was asked to: an allocation, a stage's request, a detached
    run's batch job), as the dry run prints it."""

    KIND: ClassVar[str] = "requested"
    text: str


@dataclass
class Shown(_Event):
    """A line the screen showed (a rank's line, folded lines, a note, a table): display only."""

    KIND: ClassVar[str] = "shown"
    text: str


@dataclass
class HostState(_Event):
    """A host's state in a launch: connecting (not started), running, or how its node ended."""

    KIND: ClassVar[str] = "host-state"
    host: str
    stage: Stage
    state: NodeState
    exit_code: Optional[int] = None


@dataclass
class PreflightChecked(_Event):
    """The pre-flight's table of every host and check."""

    KIND: ClassVar[str] = "preflight"
    report: PreflightReport


@dataclass
class StageStarted(_Event):
    KIND: ClassVar[str] = "stage-started"
    stage: Stage
    master: str
    port: int
    hosts: list[str]


@dataclass
class StageEnded(_Event):
    """A launch ended: every node's outcome and everything its ranks reported."""

    KIND: ClassVar[str] = "stage-ended"
    result: StageResult


@dataclass
class Localized(_Event):
    """A health check that failed (or a pair gate) was narrowed down to hosts."""

    KIND: ClassVar[str] = "localized"
    localization: Localization


@dataclass
class HostsExcluded(_Event):
    """A gate dropped these hosts (`healthcheck.on_fail: exclude`, or hosts an earlier run recorded
    bad); the run goes on without them."""

    KIND: ClassVar[str] = "hosts-excluded"
    hosts: list[str]
    gate: Gate


@dataclass
class SparesRejected(_Event):
    """A gate found these spares wanting (the pre-flight): dropped, the run goes on without them."""

    KIND: ClassVar[str] = "spares-rejected"
    hosts: list[str]
    gate: Gate


@dataclass
class Replanned(_Event):
    """The run was planned again on `hosts`, without the ones a gate excluded."""

    KIND: ClassVar[str] = "replanned"
    hosts: list[str]


@dataclass
class GateStopped(_Event):
    """A gate stopped the run before its last launch."""

    KIND: ClassVar[str] = "gate-stopped"
    gate: Gate


@dataclass
class RecoveryStarted(_Event):
    """Hosts were lost and the run relaunches on `hosts` (spares at the lost node ranks); the same
    recovery again when a spare it put in could not be reached and the next one takes its place."""

    KIND: ClassVar[str] = "recovery"
    recovery: Recovery
    hosts: list[str]


@dataclass
class RecoveryUpdated(_Event):
    """A recovery as it stands now: its relaunch started, its job's start known (when and from
    which step training resumed), its relaunch ended."""

    KIND: ClassVar[str] = "recovery-updated"
    recovery: Recovery


@dataclass
class NotRecovered(_Event):
    """A host failure the run could not survive, and why."""

    KIND: ClassVar[str] = "not-recovered"
    why: str


@dataclass
class StepWindow(_Event):
    """A window of steps, judged: each host's part — its ranks' medians of compute (step time
    minus the wait at the collectives), wait and step time over the window, as its agent folded
    them, and its slowest rank's compute — a few numbers per host, not per rank."""

    KIND: ClassVar[str] = "step-window"
    first: int
    last: int
    hosts: dict[str, list[float]]


@dataclass
class RanksSilent(_Event):
    """Ranks of a host that started and stopped reporting their steps while others go on."""

    KIND: ClassVar[str] = "ranks-silent"
    host: str
    ranks: list[int]


@dataclass
class RanksFrozen(_Event):
    """A host's ranks that cannot run (stopped, or in an uninterruptible wait: rank -> state
    letter), as its node agent said when they changed (empty: they run again)."""

    KIND: ClassVar[str] = "ranks-frozen"
    host: str
    ranks: dict[str, str]


@dataclass
class HostQuiet(_Event):
    """A host whose parts of the windows of steps stopped coming (none from step `first` on, for
    20 s or three windows' time) while the other hosts sent theirs up to step `last` (its agent,
    or its ranks' reports, went quiet; whether the host lives is its heartbeat's to say)."""

    KIND: ClassVar[str] = "host-quiet"
    host: str
    first: int
    last: int


@dataclass
class StragglerNamed(_Event):
    """A host whose ranks compute slower than their peers, with the evidence."""

    KIND: ClassVar[str] = "straggler"
    straggler: Straggler


@dataclass
class HostBack(_Event):
    """A host the run lost answered the probes long enough (or was cleared by `hosts clear`): a
    spare again."""

    KIND: ClassVar[str] = "host-back"
    host: str
    healthy_s: float
    cleared: bool = False


@dataclass
class SpareDropped(_Event):
    """A spare that stopped answering while it waited, dropped at no cost to the budget."""

    KIND: ClassVar[str] = "spare-dropped"
    host: str
    why: str


@dataclass
class Allocated(_Event):
    """The scheduler's job whose nodes an attached run's stages run on: the allocation submitted
    for the run (`owned`: it ends with the run; its output at `output_path`), or the one its
    supervisor runs inside. (A detached run's job is its record's placement: record/runs.InJob.)"""

    KIND: ClassVar[str] = "allocated"
    job_id: str
    owned: bool
    output_path: Optional[str] = None


@dataclass
class Requeued(_Event):
    """The scheduler took the allocation away and gave it back: every stage runs again."""

    KIND: ClassVar[str] = "requeued"
    restart: int


@dataclass
class RunEnded(_Event):
    """The run's end: its final state and exit code; `error` when it ended on an error before or
    between stages (what `ddplaunch: error:` says); `by_scheduler` when the scheduler, not the
    supervisor, ended it (a detached run's job ended whole)."""

    KIND: ClassVar[str] = "run-ended"
    state: RunState
    exit_code: int
    error: str = ""
    by_scheduler: bool = False


Event = Union[RunStarted, Requested, Shown, HostState, PreflightChecked, StageStarted, StageEnded, Localized,
              HostsExcluded, SparesRejected, Replanned, GateStopped, RecoveryStarted, RecoveryUpdated, NotRecovered,
              StepWindow, RanksSilent, RanksFrozen, HostQuiet, StragglerNamed, SpareDropped, HostBack, Allocated,
              Requeued, RunEnded]
KINDS: dict[str, type] = {c.KIND: c for c in typing.get_args(Event)}
#: Events after which the log is fsynced: a reader on another machine, or after a crash, finds them.
DURABLE = (RunStarted, Requested, PreflightChecked, StageStarted, StageEnded, Localized, HostsExcluded, SparesRejected,
           Replanned, GateStopped, RecoveryStarted, RecoveryUpdated, NotRecovered, RanksSilent, HostQuiet,
           StragglerNamed, SpareDropped, HostBack, Allocated, Requeued, RunEnded)


def to_line(event: Event) -> str:
    return json.dumps({"kind": event.KIND, **to_data(event)}, sort_keys=True)


def from_line(line: str) -> Optional[Event]:
    """The event a log line holds; None for a line that is not one (torn, or of a newer kind)."""
    try:
        data = json.loads(line)
        event: Event = from_data(KINDS[data.pop("kind")], data)
        return event
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class EventLog:
    """The writer: appends events to the run's `events.jsonl` (0600), thread-safe; `listeners`
    get each event as it is appended (the run loop's own fold)."""

    def __init__(self, run_dir: Path, listeners: Sequence[Callable[[Event], None]] = ()):
        self.path = run_dir / EVENTS_FILE
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file: IO[bytes] = os.fdopen(fd, "ab")
        self._lock = threading.Lock()
        self._listeners = list(listeners)
        #: The log's length in bytes, just past the newest event (a listener sees it so).
        self.offset = os.fstat(fd).st_size

    def listen(self, listener: Callable[[Event], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def append(self, event: Event) -> None:
        with self._lock:
            if self._file.closed:
                return
            data = (to_line(event) + "\n").encode()
            self._file.write(data)
            self._file.flush()
            self.offset += len(data)
            if isinstance(event, DURABLE):
                os.fsync(self._file.fileno())
            for listener in self._listeners:
                listener(event)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(run_dir: Path) -> list[Event]:
    """Every event logged so far (none when the log does not exist yet)."""
    return list(events_from(run_dir))


def events_from(run_dir: Path, offset: int = 0) -> Iterator[Event]:
    """The events logged so far after the log's first `offset` bytes, one at a time."""
    try:
        with open(run_dir / EVENTS_FILE, "rb") as f:
            f.seek(offset)
            for line in f:
                if line.endswith(b"\n"):
                    event = from_line(line.decode("utf-8", "replace"))
                    if event is not None:
                        yield event
    except FileNotFoundError:
        return


def first_event(run_dir: Path) -> Optional[Event]:
    """The log's first event (`RunStarted` once the supervisor took the run), from its first line."""
    try:
        with open(run_dir / EVENTS_FILE) as f:
            return from_line(f.readline())
    except FileNotFoundError:
        return None


def last_event(run_dir: Path, tail_bytes: int = 1 << 16) -> Optional[Event]:
    """The newest complete event of the log (the end of a finished run), read from its last
    `tail_bytes`: what `ddplaunch runs` needs of each run, without reading whole logs."""
    try:
        with open(run_dir / EVENTS_FILE, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        event = from_line(line)
        if event is not None:
            return event
    return None


def follow(run_dir: Path, alive: Callable[[], bool], offset: int = 0) -> Iterator[Event]:
    """Every event from the first (after the log's first `offset` bytes), then each new one as it
    is appended, until `RunEnded` (the last one yielded), or until `alive()` says to stop
    following (the writer is gone) and what it wrote has been read. A torn last line is read
    again once complete."""
    path = run_dir / EVENTS_FILE
    pending = ""
    f: Optional[IO[str]] = None
    try:
        while True:
            if f is None and path.exists():
                f = open(path, encoding="utf-8", errors="replace")
                f.seek(offset)
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
                    last = from_line(line)
                    if last is not None:
                        yield last
                return
            time.sleep(FOLLOW_POLL)
    finally:
        if f is not None:
            f.close()
