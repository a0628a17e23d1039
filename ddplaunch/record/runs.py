"""Run records: a run's identity and where its supervisor runs, one JSON file per run
(`record.json`), written once, atomically, when the run is handed to its supervisor, under
`$DDPLAUNCH_HOME/runs/<id>/` beside its event log (record/events.py: what the run did, the run's
only memory of its state) and its output log — so `status`, `logs` and `down` work after ddplaunch
has exited. Where the supervisor runs is a value (`Placement`: a process here or elsewhere, a
scheduler's job, a process on `supervisor.host`). Data and file I/O only: no backend is imported
here. Run directories are 0700 and every file in them 0600.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO, Any, ClassVar, Optional, Union

from ddplaunch.errors import PlanError, RunNotFoundError
from ddplaunch.plan.handoff import restored_spec
from ddplaunch.record.codec import from_data, to_data
from ddplaunch.spec.model import ClusterSpec

#: Every run id, wherever it comes from (generated, --run-id, status/logs/down arguments).
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def home() -> Path:
    """ddplaunch's state directory (`$DDPLAUNCH_HOME`, default `~/.ddplaunch`)."""
    return Path(os.environ.get("DDPLAUNCH_HOME", "~/.ddplaunch")).expanduser()


def run_dir(run_id: str) -> Path:
    """Where a run's record, log and evidence live on this machine."""
    return home() / "runs" / run_id


def check_run_id(run_id: str, what: str = "run id") -> str:
    """The run id if it is safe in paths and shell words, else PlanError (exit 2)."""
    if not RUN_ID_RE.fullmatch(run_id) or ".." in run_id:
        raise PlanError(f"{what} {run_id!r}: use 1-100 letters, digits, '.', '_' and '-', starting with "
                        "a letter or digit (no '/', no '..')")
    return run_id


def new_run_id(name: str) -> str:
    """`<spec name>-<UTC time>-<4 hex>`: sortable, unique, and safe in shell words."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def process_start_time(pid: int) -> Optional[int]:
    """A process's start time in clock ticks since boot (pid reuse changes it), None if gone (or
    a zombie: ended, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if stat[0] == "Z" else int(stat[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Local:
    """The run's supervisor is a process on a machine: its pid, its start time (a pid reused by
    another process is not taken for it) and the machine's name."""

    pid: int
    start: Optional[int]
    host: str
    KIND: ClassVar[str] = "local"

    @classmethod
    def this_process(cls) -> "Local":
        return cls(os.getpid(), process_start_time(os.getpid()), socket.gethostname())

    def alive(self) -> Optional[bool]:
        """Whether it still runs (None: it runs on another machine, which this one cannot see)."""
        if self.host != socket.gethostname():
            return None
        start = process_start_time(self.pid)
        return start is not None and (self.start is None or start == self.start)


@dataclass(frozen=True)
class InJob:
    """The run's supervisor runs inside its scheduler's job (Slurm's `up --detach`); `where` says
    where it went and how to follow it."""

    job_id: str
    where: str
    KIND: ClassVar[str] = "in-job"


@dataclass(frozen=True)
class OnHost:
    """The run's supervisor runs on `supervisor.host`, as `pid` there."""

    host: str
    pid: int
    KIND: ClassVar[str] = "on-host"


Placement = Union[Local, InJob, OnHost]
PLACEMENTS: dict[str, type] = {cls.KIND: cls for cls in (Local, InJob, OnHost)}


@dataclass(frozen=True)
class RecordedSpec:
    """The spec a run runs, as its record keeps it: `ClusterSpec.redacted`'s data (secrets as
    `<secret>`, `from_env` values by name) and the directory its relative paths are taken from.
    Validated only when asked (`validated`): the record of a run whose backend was registered
    from Python in another process still reads (`runs`, `status`)."""

    data: dict[str, Any]
    base_dir: str = "."

    @classmethod
    def of(cls, spec: ClusterSpec) -> "RecordedSpec":
        return cls(spec.redacted(), spec.base_dir)

    @property
    def backend(self) -> str:
        return str(self.data.get("backend", ClusterSpec.model_fields["backend"].default))

    @cached_property
    def validated(self) -> ClusterSpec:
        """The spec as a `ClusterSpec` (secrets redacted).

        Raises:
            pydantic.ValidationError (a ValueError): not a valid spec here (its backend unknown).
        """
        return restored_spec(self.data, self.base_dir)


@dataclass
class RunRecord:
    """A run's identity — its id, the spec it runs (secrets redacted), where that spec came from,
    the hosts it was planned on, when it was handed over — and where its supervisor runs. Written
    once, never updated: what the run did, its state included, is its event log's
    (record/events.py), never the record's; the backend is the spec's."""

    run_id: str
    spec_path: str
    hosts: list[str]
    spec: RecordedSpec
    placement: Placement
    started_at: float = field(default_factory=time.time)

    @classmethod
    def planned(cls, run_id: str, spec_path: str, spec: ClusterSpec, placement: Placement,
                hosts: Optional[list[str]] = None) -> "RunRecord":
        """The record of a run of `spec` (its secrets redacted here), planned on `hosts` (default:
        the spec's)."""
        return cls(run_id=run_id, spec_path=str(spec_path),
                   hosts=[h.label for h in spec.hosts] if hosts is None else hosts,
                   spec=RecordedSpec.of(spec), placement=placement)

    @property
    def backend(self) -> str:
        return self.spec.backend

    @property
    def dir(self) -> Path:
        return run_dir(self.run_id)

    @property
    def log_path(self) -> Path:
        return self.dir / "output.log"

    def make_dir(self) -> Path:
        """The run directory, 0700 (created with that mode, not chmodded later), in ddplaunch's
        state directory, 0700 too."""
        home().mkdir(parents=True, exist_ok=True, mode=0o700)
        (home() / "runs").mkdir(exist_ok=True, mode=0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        return self.dir

    def save(self) -> None:
        """Write the record atomically (0600 temp file + rename): a reader never sees half of it.
        The spec is written as `ClusterSpec.redacted` writes it, with the directory its relative
        paths are taken from (`base_dir`)."""
        self.make_dir()
        data = {**to_data(self), "spec": self.spec.data, "base_dir": self.spec.base_dir}
        write_private(self.dir / "record.json", json.dumps(data, indent=2, sort_keys=True))


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically through a 0600 temp file in the same directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_private(path: Path, mode: str = "a") -> IO[str]:
    """Open a file of a run directory, created 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC), 0o600)
    return os.fdopen(fd, mode)


def load_run(run_id: str) -> RunRecord:
    """The record of `run_id`.

    Raises:
        RunNotFoundError: no such run under `home()`, or its record is unreadable.
        PlanError: the id is not a valid run id.
    """
    check_run_id(run_id)
    path = run_dir(run_id) / "record.json"
    try:
        return _record(json.loads(path.read_text()))
    except FileNotFoundError:
        raise RunNotFoundError(f"no run {run_id!r} under {home() / 'runs'}; `ddplaunch runs` lists them") from None
    except (OSError, ValueError, TypeError) as err:
        raise RunNotFoundError(f"run {run_id!r}: record {path} is unreadable ({type(err).__name__}: "
                               f"{str(err)[:200]}); remove the directory or pass another run id") from None


def read_record(directory: Path) -> Optional[RunRecord]:
    """The record in a run directory, None when it has none or it is unreadable."""
    try:
        return _record(json.loads((directory / "record.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _record(data: Any) -> RunRecord:
    """A RunRecord from a record file's JSON, every field of the type it must have.

    Raises:
        ValueError: naming what is missing or of the wrong type.
    """
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if not isinstance(data.get("spec"), dict):
        raise ValueError("key 'spec' is missing or not an object")
    return from_data(RunRecord, {**data, "spec": {"data": data["spec"], "base_dir": data.get("base_dir", ".")}})


def list_runs() -> list[RunRecord]:
    """Every readable recorded run, newest first."""
    root = home() / "runs"
    found = (read_record(path.parent) for path in sorted(root.glob("*/record.json"))) if root.is_dir() else ()
    return sorted((r for r in found if r is not None), key=lambda r: r.started_at, reverse=True)


def latest_run(project_dir: Optional[Path] = None) -> tuple[RunRecord, str]:
    """The newest run of the project in `project_dir` (specs in it or below), else the newest run
    of all; with the words saying which was picked.

    Raises:
        RunNotFoundError: no run recorded yet.
    """
    runs = list_runs()
    if not runs:
        raise RunNotFoundError(f"no runs recorded under {home() / 'runs'} yet; start one with `ddplaunch up`")
    if project_dir is not None:
        here = str(project_dir.resolve())
        mine = [r for r in runs if str(Path(r.spec_path).resolve()).startswith(here + os.sep)]
        if mine:
            return mine[0], f"latest run of {here}: {mine[0].run_id}"
    return runs[0], f"latest run (none of {project_dir or '?'}; newest of all): {runs[0].run_id}"
