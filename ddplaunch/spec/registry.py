"""Which backends exist: one registration each, as data, read by the spec and by `make_backend`.

A registration names the backend (`backend:` in a spec), the spec sections only it reads (`ssh:`,
`slurm:`; another backend's spec setting them is refused), the keys it cannot honour and why
(refused by `validate` before anything runs), how many hosts it can drive and the container
runtimes it can run. What makes a shipped backend is backends/__init__.py's `SHIPPED` (real
imports, which the layer test sees); a backend registered from outside (a test's fake) brings its
own `factory`. Adding a backend is its own package, one `register(...)` line here and one entry
in `SHIPPED`; nothing else asks which backend it holds. Data only: this module imports nothing of
ddplaunch but the spec's value types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ddplaunch.spec.values import PER_NODE_RUNTIMES, Runtime


@dataclass(frozen=True)
class Registration:
    """One backend."""

    name: str
    #: `(spec, run) -> Launcher` for a backend ddplaunch does not ship (a test's fake); None: the
    #: shipped one of this name (backends/__init__.py `SHIPPED`).
    factory: Optional[Callable[..., Any]] = None
    #: Spec sections only this backend reads.
    sections: tuple[str, ...] = ()
    #: Key path (dotted; `hosts[]` is every host; a section name is every key in it) -> why this
    #: backend cannot honour it and what to do. Refused only when set to a non-default value.
    limits: Mapping[str, str] = field(default_factory=dict)
    #: At most this many hosts (None: any number).
    max_hosts: Optional[int] = None
    #: Runs on this machine: its files are checked here when the spec is read.
    runs_here: bool = False
    #: Its nodes come from an allocation it makes: spares may be a count of extra nodes.
    allocates: bool = False
    #: The container runtimes it can run ranks in (`container.runtime`).
    runtimes: tuple[Runtime, ...] = PER_NODE_RUNTIMES
    one_line: str = ""


_REGISTRY: dict[str, Registration] = {}


def register(registration: Registration) -> Registration:
    """Make a backend known (a later registration of the same name replaces the earlier one)."""
    _REGISTRY[registration.name] = registration
    return registration


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registration(name: str) -> Registration:
    """The backend called `name`. Raises KeyError naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(names())}") from None


def names() -> list[str]:
    return list(_REGISTRY)


def section_owner(section: str) -> Optional[str]:
    """The backend whose section this is, if any."""
    return next((r.name for r in _REGISTRY.values() if section in r.sections), None)


register(Registration(
    "local", max_hosts=1, runs_here=True,
    one_line="this machine, one process group",
    limits={"sync": "the local backend runs in place: the files are already here",
            "recovery": "one host, this machine: there is no other to go on with"}))
register(Registration(
    "ssh", sections=("ssh", "supervisor"),
    one_line="Fabric, one connection per host"))
register(Registration(
    "slurm", sections=("slurm",), allocates=True,
    runtimes=tuple(Runtime),
    one_line="srun steps of one allocation",
    limits={"sync": "Slurm jobs read the shared file system: put the files there",
            "hosts[].user": "Slurm starts every step as the submitting user",
            "hosts[].port": "Slurm reaches its nodes itself; no SSH port is used",
            "hosts[].python": "use `python:` for every node",
            "master.addr": "Slurm's first allocated node is the master"}))
