"""Bad hosts remembered across runs: the host-health file.

A host a run named lost (crashed, frozen, cut off), failed the health check, or evicted as a
straggler is recorded with its cause, the run and the time, in one JSON file (`$DDPLAUNCH_HOME/
host-health.json` by default; `recovery.host_health_file` names a team's shared one). The next
`up` skips a recorded host, or refuses to start with it (run/begin.py), until the entry expires
(`recovery.remember_bad_hosts` seconds), `ddplaunch hosts clear HOST` readmits it, or a `ddplaunch
check` that passes on it does. Writers take an exclusive lock on a sidecar file and replace the
file whole, so concurrent runs (a team's) never lose or tear an entry. Data and file I/O only.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

from ddplaunch.record.runs import home

#: The user's own file, when the spec names none.
DEFAULT_NAME = "host-health.json"
#: Hosts never recorded: the machine the launcher runs on (its loss is the launcher's own).
LOCAL = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class BadHost:
    """Why a host is remembered: what the run named (`cause`), which run, when (epoch s), and the
    run's backend (a Slurm node's name is only excluded from Slurm allocations)."""

    host: str
    cause: str
    run_id: str
    at: float
    backend: str = ""


def health_file(path: Optional[str] = None) -> Path:
    """The host-health file: `path` (the spec's shared one) or the user's own."""
    return Path(path).expanduser() if path else home() / DEFAULT_NAME


def recorded(path: Path, ttl: float, now: Optional[float] = None) -> dict[str, BadHost]:
    """Every host recorded and not expired (`ttl` seconds old at most): label -> entry. A file
    that is missing, torn or not ours reads as empty: the memory helps, it never stops a run."""
    now = time.time() if now is None else now
    return {h: e for h, e in _read(path).items() if now - e.at <= ttl}


def remember(path: Path, hosts: dict[str, str], run_id: str, backend: str, now: Optional[float] = None) -> None:
    """Record `hosts` (label -> cause) as bad, now; a host recorded before gets the new entry."""
    hosts = {h: c for h, c in hosts.items() if h not in LOCAL}
    if not hosts:
        return
    at = time.time() if now is None else now
    with _locked(path):
        entries = _read(path)
        entries.update({h: BadHost(h, cause[:300], run_id, at, backend) for h, cause in hosts.items()})
        _write(path, entries)


def clear(path: Path, hosts: list[str]) -> list[str]:
    """Readmit `hosts`: the ones that were recorded (expired or not)."""
    with _locked(path):
        entries = _read(path)
        gone = [h for h in hosts if h in entries]
        if gone:
            _write(path, {h: e for h, e in entries.items() if h not in gone})
    return gone


def _read(path: Path) -> dict[str, BadHost]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, BadHost] = {}
    for host, entry in (data.get("hosts") or {}).items() if isinstance(data, dict) else ():
        try:
            out[host] = BadHost(host, str(entry["cause"]), str(entry["run_id"]), float(entry["at"]),
                                str(entry.get("backend", "")))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _write(path: Path, entries: dict[str, BadHost]) -> None:
    data = {"hosts": {h: {k: v for k, v in asdict(e).items() if k != "host"} for h, e in sorted(entries.items())}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 if path.parent != home() else 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s sidecar `.lock` (held by one writer at a time, any process)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
