"""Backends: the only code that executes a run's work on its hosts (stages, probes, teardown).
`make_backend(spec, run)` makes the one the spec names: what a backend is (its spec sections,
its limits) is its registration's (spec/registry.py); the code that makes it is `SHIPPED` here,
real imports, inside functions so that a run imports only its own backend (Fabric loads slowly).
It connects to nothing until asked. (Beside them, supervise/remote.py runs ddplaunch's own
commands on `supervisor.host`, and sim/ builds the test cluster.)"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ddplaunch.backends.contract import Launcher, RunContext, Scheduler
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.spec.registry import registration

Factory = Callable[[ClusterSpec, RunContext], Launcher[Any]]


def _local(spec: ClusterSpec, run: RunContext) -> Launcher[Any]:
    from ddplaunch.backends.local import LocalBackend
    return LocalBackend(spec, run)


def _ssh(spec: ClusterSpec, run: RunContext) -> Launcher[Any]:
    from ddplaunch.backends.ssh import SshBackend
    return SshBackend(spec, run)


def _slurm(spec: ClusterSpec, run: RunContext) -> Launcher[Any]:
    from ddplaunch.backends.slurm import SlurmBackend
    return SlurmBackend(spec, run)


#: The backends ddplaunch ships, by their registered name (spec/registry.py): what makes each.
SHIPPED: dict[str, Factory] = {"local": _local, "ssh": _ssh, "slurm": _slurm}


def make_backend(spec: ClusterSpec, run: RunContext) -> Launcher[Any]:
    """The backend that drives `spec.backend` for `run` (its module is imported here, not before):
    a registration's own factory (a backend registered from outside, a test's fake), else the
    shipped one's."""
    factory: Optional[Factory] = registration(spec.backend).factory or SHIPPED.get(spec.backend)
    if factory is None:
        raise KeyError(f"backend {spec.backend!r} is registered without a factory, and ddplaunch ships none by that name")
    return factory(spec, run)


def scheduler_of(backend: Launcher[Any]) -> Optional[Scheduler]:
    """The backend as a Scheduler when it can own a detached run, else None."""
    return backend if isinstance(backend, Scheduler) else None
