"""`down` ends only the run's own processes: they carry the run's tag AND belong to the launching
user; a stale pid file naming an unrelated process gets it no signal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddplaunch.hostside.procs import proc_alive

ROOT = Path(__file__).resolve().parents[2]


def _record(home: Path, run_id: str) -> None:
    import json
    import socket

    d = home / "state" / "runs" / run_id
    d.mkdir(parents=True)
    (d / "record.json").write_text(json.dumps({
        "run_id": run_id, "spec_path": "x", "backend": "local", "hosts": ["localhost"], "spec": {"backend": "local"},
        "placement": {"kind": "local", "pid": 1, "start": 1, "host": socket.gethostname()}}))


@pytest.mark.root
def test_down_spares_other_users_and_untagged_pids(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another user")
    env = dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"), HOME=str(tmp_path))
    _record(tmp_path, "victim-run")
    mine = subprocess.Popen(["env", "DDPLAUNCH_RUN_ID=victim-run", "sleep", "300"])
    theirs = subprocess.Popen(["runuser", "-u", "nobody", "--", "env", "DDPLAUNCH_RUN_ID=victim-run", "sleep", "300"])
    bystander = subprocess.Popen(["sleep", "300"])  # no tag: what a stale pid file may name
    run_dir = tmp_path / ".ddplaunch" / "runs" / "victim-run"
    run_dir.mkdir(parents=True)
    (run_dir / "node0.pid").write_text(f"{bystander.pid}\n")
    try:
        down = subprocess.run([sys.executable, "-m", "ddplaunch", "down", "victim-run"], capture_output=True,
                              text=True, timeout=60, cwd=ROOT, env=env)
        assert down.returncode == 0, down.stderr
        assert mine.wait(timeout=15) is not None  # ours: ended
        assert proc_alive(theirs.pid), "down ended another user's process"
        assert proc_alive(bystander.pid), "down signalled the pid of a stale pid file"
        assert f"ended pids {mine.pid}" in down.stdout
    finally:
        for p in (mine, theirs, bystander):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
