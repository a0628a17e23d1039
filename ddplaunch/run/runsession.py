"""One run's context: what every part of the run loop shares, passed as one typed object.

`RunSession` holds the spec the run was begun with, the backend that executes it, the options of
`up`, the console, the stop event, the run's id and directory, and its event log with the fold of
it. What a part really decides (the spec of one launch after exclusions and recoveries, a plan, a
timeout) stays its own parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddplaunch.backends.contract import Launcher, StopEvent
from ddplaunch.output.console import Console
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import EventLog
from ddplaunch.record.view import RunView
from ddplaunch.spec.model import ClusterSpec


@dataclass(frozen=True)
class RunSession:
    """A begun run, as its loop and gates see it."""

    spec: ClusterSpec
    backend: Launcher[Any]
    opts: UpOptions
    console: Console
    stop: StopEvent
    run_id: str
    run_dir: Path
    events: EventLog
    view: RunView

    @property
    def emulated(self) -> bool:
        """Whether the ranks are emulated (`up --emulate`: no torch on the hosts)."""
        return self.opts.emulate is not None
