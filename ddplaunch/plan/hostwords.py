"""Words of a command line whose value only the host knows, resolved there by the backend's
renderer (plan/shellword.py for a shell): the plan and the container wrapper hold them as data."""

from __future__ import annotations

from typing import Any


class HostWord(str):
    """A value only the host knows, resolved there by the backend's renderer (plan/shellword.py)."""


class HostPath(HostWord):
    """A path relative to the home directory on the host (the run's files there); each backend
    renders it for its host (a shell: `"$HOME"/PATH`)."""


class GpuCount(HostWord):
    """`nproc_per_node: auto`: as many processes as this interpreter (the word's value) sees GPUs,
    at least one, counted on the host when the node's command starts (no interpreter, the word
    empty: as many as nvidia-smi lists, for ranks in a container)."""


class CpuShare(HostWord):
    """The host's cores divided among its processes (the word's value: how many), at least one:
    OMP_NUM_THREADS, which torchrun would otherwise set to 1 with a banner on every launch."""


class HostFlags(HostWord):
    """Flags (the word's value, several words) given only where the shell test `test` holds on the
    host: a GPU there, an InfiniBand device, a user that is not root. `test` is ddplaunch's own."""

    test: str

    def __new__(cls, flags: str, test: str) -> "HostFlags":
        obj = super().__new__(cls, flags)
        obj.test = test
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (HostFlags, (str(self), self.test))


class HomeBind(HostWord):
    """A bind mount of a path under the host's home directory (the word's value, relative to it)
    at the same path inside the container: `"$HOME"/PATH:"$HOME"/PATH`."""


class HostUser(HostWord):
    """The launching user's uid:gid on the host, after the word's value (`--user=`): files the
    ranks write are the user's, not root's; a label with it tells the user's containers apart."""
