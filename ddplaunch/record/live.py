"""What each host's ranks are doing now, as their node agents last said it (`HostSteps` every few
seconds): the newest step, the median step time and wait, the rank that computes longest. Kept
apart from the event log — at 1,000 hosts these lines are hundreds a second, and only the newest
matters — in one small file of the run directory, `live.json`, rewritten whole (atomically) at
most once a second by the process that runs the run loop; `top` and `status` read it. Bounded by
the run's hosts. Data and file I/O only.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ddplaunch.record.codec import from_data, to_data

LIVE_FILE = "live.json"
#: Seconds between two writes of the file, at most one.
WRITE_EVERY = 1.0


@dataclass
class HostNow:
    """One host's ranks as its agent last said them (`at`: wall time it was heard)."""

    step: int
    step_s: float
    wait_s: float
    ranks: int
    worst_rank: int
    worst_compute_s: float
    at: float


@dataclass
class LiveSteps:
    """Every host's newest status in the job launch that runs."""

    stage_started: float = 0.0
    hosts: dict[str, HostNow] = field(default_factory=dict)

    @property
    def newest(self) -> Optional[tuple[int, float]]:
        """(the newest step any host reported, when it was reported)."""
        if not self.hosts:
            return None
        host = max(self.hosts.values(), key=lambda h: (h.step, h.at))
        return host.step, host.at


class LiveWriter:
    """Keeps the hosts' newest status and writes it to `live.json` at most once a second
    (thread-safe: the readers of the hosts' lines call `update`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LIVE_FILE
        self.live = LiveSteps(stage_started=time.time())
        self._lock = threading.Lock()
        self._written = 0.0
        self._dirty = False  # an update came that is not written yet

    def update(self, host: str, now: HostNow) -> None:
        with self._lock:
            self.live.hosts[host] = now
            self._dirty = True
            due = time.monotonic() - self._written >= WRITE_EVERY
        if due:
            self.flush()

    def flush(self) -> None:
        """Write what came since the last write (also when the launch ends: its last status is not
        lost to the once-a-second limit)."""
        with self._lock:
            if not self._dirty:
                return
            self._written, self._dirty = time.monotonic(), False
            text = json.dumps(to_data(self.live), separators=(",", ":"))
        _replace(self.path, text)


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` whole, through a 0600 temp file renamed over it (no fsync: a
    snapshot of now, not a record)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_live(run_dir: Path) -> Optional[LiveSteps]:
    """The newest `live.json` of a run, None when there is none (or it cannot be read)."""
    try:
        return from_data(LiveSteps, json.loads((run_dir / LIVE_FILE).read_text()))
    except (OSError, ValueError):
        return None
