"""Backends: the only code that executes a run's work on its hosts (stages, probes, teardown).
`make_backend(spec, run)` makes the one the spec names, from its registration
(spec/registry.py); it connects to nothing until asked. (Beside them, supervise/remote.py runs
ddplaunch's own commands on `supervisor.host`, and sim/ builds the test cluster.)"""

from __future__ import annotations

from typing import Any, Optional, cast

from ddplaunch.backends.contract import Launcher, RunContext, Scheduler
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.spec.registry import registration


def make_backend(spec: ClusterSpec, run: RunContext) -> Launcher[Any]:
    """The backend that drives `spec.backend` for `run` (its module is imported here, not before)."""
    return cast(Launcher[Any], registration(spec.backend).load()(spec, run))


def scheduler_of(backend: Launcher[Any]) -> Optional[Scheduler]:
    """The backend as a Scheduler when it can own a detached run, else None."""
    return backend if isinstance(backend, Scheduler) else None
