"""Run records: one JSON file per `up`, written atomically under `$DDPLAUNCH_HOME/runs/<id>/`.

A record holds the spec, the rendered plan, the hosts, the start time, each stage's per-node
outcome and the run's state, so `status`, `logs` and `down` work after ddplaunch has exited.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ddplaunch.errors import RunNotFoundError


def home() -> Path:
    """ddplaunch's state directory (`$DDPLAUNCH_HOME`, default `~/.ddplaunch`)."""
    return Path(os.environ.get("DDPLAUNCH_HOME", "~/.ddplaunch")).expanduser()


def new_run_id(name: str) -> str:
    """`<spec name>-<UTC time>-<4 hex>`: sortable, unique, and safe in shell words."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


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
    stages: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    ended_at: Optional[float] = None

    @property
    def dir(self) -> Path:
        return home() / "runs" / self.run_id

    @property
    def log_path(self) -> Path:
        return self.dir / "output.log"

    def save(self) -> None:
        """Write the record atomically (temp file + rename): a reader never sees half of it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".record.")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "record.json")


def load_run(run_id: str) -> RunRecord:
    """The record of `run_id`.

    Raises:
        RunNotFoundError: no such run under `home()`.
    """
    path = home() / "runs" / run_id / "record.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunNotFoundError(f"no run {run_id!r} under {home() / 'runs'}; `ddplaunch runs` lists them") from None
    return RunRecord(**data)


def list_runs() -> list[RunRecord]:
    """Every recorded run, newest first."""
    root = home() / "runs"
    records = []
    for path in sorted(root.glob("*/record.json")) if root.is_dir() else []:
        try:
            records.append(RunRecord(**json.loads(path.read_text())))
        except (ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.started_at, reverse=True)
