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
from typing import Any, Iterator, Optional

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


def latest_run() -> RunRecord:
    """The newest recorded run.

    Raises:
        RunNotFoundError: no run recorded yet.
    """
    runs = list_runs()
    if not runs:
        raise RunNotFoundError(f"no runs recorded under {home() / 'runs'} yet; start one with `ddplaunch up`")
    return runs[0]


def status_lines(record: RunRecord) -> list[str]:
    """A run's state and every host's outcome per stage (Slurm runs: the job's live state too)."""
    lines = [f"{record.run_id}: {record.state} ({record.backend}; hosts {', '.join(record.hosts)})"]
    for stage in record.stages:
        lines.append(f"  stage {stage['stage']}:")
        for o in stage["outcomes"]:
            code = "" if o["exit_code"] is None else f" exit {o['exit_code']}"
            lines.append(f"    {o['host']} (node {o['node_rank']}): {o['state']}{code}")
    if record.backend == "slurm":
        from ddplaunch.backends.slurm import job_status
        from ddplaunch.spec import ClusterSpec

        lines += job_status(ClusterSpec.model_validate(record.spec), record.run_id)
    return lines


def log_lines(run_id: str, host: Optional[str] = None, follow: bool = False) -> Iterator[str]:
    """A run's log lines (only `host`'s when given); with `follow`, until the run ends."""
    record = load_run(run_id)
    mine = (lambda line: True) if host is None else (lambda line: line.startswith((f"[{host}:", f"[{host}]")))
    if record.backend == "slurm" and (follow or not record.log_path.exists()):
        from ddplaunch.backends.slurm import job_logs
        from ddplaunch.spec import ClusterSpec

        yield from filter(mine, job_logs(ClusterSpec.model_validate(record.spec), run_id, follow))
        return
    with open(record.log_path) as f:
        while True:
            line = f.readline()
            if line:
                if mine(line):
                    yield line.rstrip("\n")
            elif follow and load_run(run_id).state == "running":
                time.sleep(0.2)
            else:
                return
