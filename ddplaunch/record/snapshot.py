"""Where readers of a long run start: the fold of its event log so far, saved beside the log.

The event log only grows (by hosts / window, never by ranks / second: record/events.py), but a
reader that folds a day of it from its first line would take minutes. So the supervisor saves
the run loop's own fold (`RunView`) now and then — every `SNAPSHOT_BYTES` of log, and when the
run ends — as `view.json` with the log's length at that moment and the screen's first and last
lines; a reader (`status`, `top`, `attach`) starts from it and folds only the events after it
(`LogReader`, the one way to read a run's log: the snapshot, then the rest, once or live). A
snapshot that is missing, torn, of another format or longer than the log is not used: the reader
folds the whole log, as it would without one. Pure except `save`, `load` and `LogReader`.
"""

from __future__ import annotations

import json
import os
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Optional

from ddplaunch.record.codec import from_data, to_data
from ddplaunch.record.events import EVENTS_FILE, Event, EventLog, HostState, RunEnded, Shown, events_from, follow
from ddplaunch.record.view import RunView

SNAPSHOT_FILE = "view.json"
#: Log bytes between two snapshots (at 8,192 ranks the log grows ~12 KB/s: one every ~6 minutes).
SNAPSHOT_BYTES = 4 << 20
#: The screen lines a snapshot keeps: the first ones (how the run began) and the newest.
HEAD_LINES, TAIL_LINES = 30, 200
FORMAT = 1


@dataclass
class Snapshot:
    """The fold of the log's first `offset` bytes, and the screen so far: its first lines, its
    newest ones, how many lines came between (shown by `ddplaunch logs`)."""

    offset: int
    view: RunView
    head: list[Shown] = field(default_factory=list)
    tail: list[Shown] = field(default_factory=list)
    skipped: int = 0
    format: int = FORMAT


class Snapshots:
    """The supervisor's side: a listener of the run's event log that keeps the screen's head and
    tail and saves a snapshot of `view` (the run loop's fold, fed by the same log) every
    SNAPSHOT_BYTES of log and at the run's end."""

    def __init__(self, run_dir: Path, view: RunView, log: EventLog, every: int = SNAPSHOT_BYTES):
        self.path, self.view, self.log, self.every = run_dir / SNAPSHOT_FILE, view, log, every
        self.head: list[Shown] = []
        self.tail: deque[Shown] = deque(maxlen=TAIL_LINES)
        self.skipped = 0
        self._saved_at = log.offset

    def __call__(self, event: Event) -> None:
        """Each event, as it is appended (under the log's lock: `log.offset` is just past it)."""
        if isinstance(event, Shown):
            if len(self.head) < HEAD_LINES:
                self.head.append(event)
            else:
                if len(self.tail) == self.tail.maxlen:
                    self.skipped += 1
                self.tail.append(event)
        if isinstance(event, RunEnded) or self.log.offset - self._saved_at >= self.every:
            self._saved_at = self.log.offset
            save(self.path, Snapshot(self.log.offset, self.view, self.head, list(self.tail), self.skipped))


def save(path: Path, snapshot: Snapshot) -> None:
    """Written whole (a new file renamed over the old, 0600): a reader finds the old or the new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(to_data(snapshot), f, separators=(",", ":"))
    os.replace(tmp, path)


def load(run_dir: Path) -> Optional[Snapshot]:
    """The run's snapshot, if there is a usable one (else None: fold the whole log)."""
    try:
        with open(run_dir / SNAPSHOT_FILE) as f:
            snapshot = from_data(Snapshot, json.load(f))
        size = (run_dir / EVENTS_FILE).stat().st_size
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return snapshot if snapshot.format == FORMAT and 0 <= snapshot.offset <= size else None


class LogReader:
    """A reader of a run's event log: `view` starts as the fold its snapshot saved (an empty
    fold without one); `events` reads the log after it, each event folded into `view` before it
    is yielded; `screen` is what the run's screen showed up to the snapshot."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.snapshot = load(run_dir)
        self.view = self.snapshot.view if self.snapshot is not None else RunView()
        self.offset = self.snapshot.offset if self.snapshot is not None else 0

    def screen(self) -> Iterable[Event]:
        """The run up to the snapshot, as a follower shows it (nothing without one): its start,
        the screen's first and newest lines, each host's state, its end if it had ended."""
        if self.snapshot is None:
            return ()
        started, ended = self.snapshot.view.started, self.snapshot.view.ended
        if started is None:
            return screen_from(self.snapshot)
        return chain([started], screen_from(self.snapshot), [ended] if ended is not None else [])

    def events(self, alive: Optional[Callable[[], bool]] = None,
               lock: AbstractContextManager[Any] = nullcontext()) -> Iterator[Event]:
        """Each event after the snapshot, folded into `view` first (holding `lock`, which a
        reader that draws `view` in another thread holds too): those logged so far, or with
        `alive`, each new one too until the run ends or `alive()` says its writer is gone
        (record/events.follow)."""
        for event in events_from(self.run_dir, self.offset) if alive is None else \
                follow(self.run_dir, alive, self.offset):
            with lock:
                self.view.add(event)
            yield event


def read_view(run_dir: Path) -> RunView:
    """The fold of the run's whole event log, from its snapshot on when it has one."""
    reader = LogReader(run_dir)
    for _ in reader.events():
        pass
    return reader.view


def screen_from(snapshot: Snapshot) -> Iterator[Event]:
    """What a reader shows of the run up to the snapshot: the screen's first lines, a line that
    says how many are left out, its newest lines, then each host's state as it is."""
    yield from snapshot.head
    if snapshot.skipped:
        yield Shown(f"[ddplaunch] ... {snapshot.skipped} lines not shown here (ddplaunch logs "
                    f"{snapshot.view.run_id} has them all)", t=snapshot.tail[0].t if snapshot.tail else 0.0)
    yield from snapshot.tail
    states: list[HostState] = list(snapshot.view.host_states.values())
    yield from states
