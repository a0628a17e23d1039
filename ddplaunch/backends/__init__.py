"""Backends: the only code that executes. `get_backend(spec)` picks one by `spec.backend`."""

from __future__ import annotations

from ddplaunch.backends.contract import Backend
from ddplaunch.spec import ClusterSpec


def get_backend(spec: ClusterSpec) -> Backend:
    """The backend that drives `spec.backend`; imported lazily (fabric loads slowly). Making one
    connects to nothing."""
    if spec.backend == "local":
        from ddplaunch.backends.local import LocalBackend

        return LocalBackend(spec)
    if spec.backend == "ssh":
        from ddplaunch.backends.ssh import SshBackend

        return SshBackend(spec)
    from ddplaunch.backends.slurm import SlurmBackend

    return SlurmBackend(spec)
