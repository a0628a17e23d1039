"""Run records: one JSON file per `up`, written atomically under `$DDPLAUNCH_HOME/runs/<id>/`.

A record holds the spec (secrets redacted), the requests that were executed, the hosts, who
launched it (pid, its start time, host), each stage's per-node outcome and the run's state — so
`status`, `logs` and `down` work after ddplaunch has exited. Data only: no backend is imported
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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from ddplaunch.errors import PlanError, RunNotFoundError

#: Every run id, wherever it comes from (generated, --run-id, status/logs/down arguments).
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
ACTIVE_STATES = ("starting", "running", "submitted")
#: The record's key naming the host its supervisor runs on (`supervisor.host`), when not this machine.
REMOTE_HOST = "supervisor_host"


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


@dataclass
class RunRecord:
    """What is known about one run; `save()` after every change."""

    run_id: str
    spec_path: str
    backend: str
    hosts: list[str]
    spec: dict[str, Any]
    plan_text: str
    started_at: float = field(default_factory=time.time)
    state: str = "starting"
    launcher_pid: int = field(default_factory=os.getpid)
    launcher_start: Optional[int] = field(default_factory=lambda: process_start_time(os.getpid()))
    launcher_host: str = field(default_factory=socket.gethostname)
    stages: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    ended_at: Optional[float] = None

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
        """Write the record atomically (0600 temp file + rename): a reader never sees half of it."""
        self.make_dir()
        write_private(self.dir / "record.json", json.dumps(asdict(self), indent=2, sort_keys=True))

    def launcher_alive(self) -> Optional[bool]:
        """Whether the launching process still runs (None: launched on another machine)."""
        if self.launcher_host != socket.gethostname():
            return None
        start = process_start_time(self.launcher_pid)
        return start is not None and (self.launcher_start is None or start == self.launcher_start)

    def shown_state(self) -> str:
        """The state, with a launcher that died without writing a final state said plainly."""
        if self.extra.get(REMOTE_HOST) and self.state == "submitted":
            return f"supervised on {self.extra[REMOTE_HOST]} (ddplaunch status {self.run_id})"
        if self.state in ACTIVE_STATES and self.state != "submitted" and self.launcher_alive() is False:
            return f"launcher died (pid {self.launcher_pid} gone; last state {self.state})"
        return self.state


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically through a 0600 temp file in the same directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_private(path: Path, mode: str = "a"):
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


#: What each field of a record must be; a record that says otherwise is corrupt (never half-read).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,), "spec_path": (str,), "backend": (str,), "hosts": (list,), "spec": (dict,),
    "plan_text": (str,), "started_at": (int, float), "state": (str,), "launcher_pid": (int,),
    "launcher_start": (int, type(None)), "launcher_host": (str,), "stages": (list,), "extra": (dict,),
    "ended_at": (int, float, type(None))}
_OUTCOME_TYPES: dict[str, tuple[type, ...]] = {"host": (str,), "node_rank": (int,), "state": (str,),
                                               "exit_code": (int, type(None))}


def _record(data: Any) -> RunRecord:
    """A RunRecord from a record file's JSON, every field of the type it must have.

    Raises:
        TypeError: naming the first key that is missing or of the wrong type.
    """
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    for key, types in _FIELD_TYPES.items():
        if key in data and not isinstance(data[key], types) or isinstance(data.get(key), bool):
            raise TypeError(f"key {key!r} is {type(data[key]).__name__}, not {' or '.join(t.__name__ for t in types)}")
    for i, stage in enumerate(data.get("stages") or []):
        _check_stage(stage, f"stages[{i}]")
    if not all(isinstance(h, str) for h in data.get("hosts") or []):
        raise TypeError("key 'hosts' holds something other than host names")
    for i, rec in enumerate((data.get("extra") or {}).get("recoveries") or []):
        if not isinstance(rec, dict):
            raise TypeError(f"key 'extra.recoveries[{i}]' is not an object")
    known = {f.name for f in fields(RunRecord)}
    return RunRecord(**{k: v for k, v in data.items() if k in known})


def _check_stage(stage: Any, where: str) -> None:
    if not isinstance(stage, dict) or not isinstance(stage.get("stage"), str) \
            or not isinstance(stage.get("outcomes"), list):
        raise TypeError(f"key {where!r} is not a stage (an object with 'stage' and 'outcomes')")
    for j, outcome in enumerate(stage["outcomes"]):
        for key, types in _OUTCOME_TYPES.items():
            value = outcome.get(key) if isinstance(outcome, dict) else None
            if not isinstance(outcome, dict) or not isinstance(value, types) or isinstance(value, bool):
                raise TypeError(f"key '{where}.outcomes[{j}].{key}' is missing or not "
                                f"{' or '.join(t.__name__ for t in types)}")


def list_runs() -> list[RunRecord]:
    """Every readable recorded run, newest first."""
    root = home() / "runs"
    records = []
    for path in sorted(root.glob("*/record.json")) if root.is_dir() else []:
        try:
            records.append(_record(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.started_at, reverse=True)


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


def status_lines(record: RunRecord) -> list[str]:
    """A run's state and every host's outcome per stage."""
    lines = [f"{record.run_id}: {record.shown_state()} ({record.backend}; hosts {', '.join(record.hosts)})"]
    for r in record.extra.get("recoveries") or []:
        replaced = ", ".join(f"{lost} -> {spare}" for lost, spare in (r.get("replaced") or {}).items())
        resumed = r.get("resumed_after_s")
        lines.append(f"  recovery {r.get('number')}: lost {', '.join(r.get('lost') or [])}"
                     + (f"; replaced {replaced}" if replaced else f"; went on with {r.get('hosts_after')} hosts")
                     + (f"; resumed after {resumed:.0f}s" if isinstance(resumed, (int, float)) else ""))
    for stage in record.stages:
        lines.append(f"  stage {stage['stage']}:")
        for o in stage["outcomes"]:
            code = "" if o["exit_code"] is None else f" exit {o['exit_code']}"
            lines.append(f"    {o['host']} (node {o['node_rank']}): {o['state']}{code}")
    return lines
