"""The command line as a new user meets it: typos are errors, records never lie, `status`/`logs`
pick the latest run of this project and say so, ids are validated, failures are one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplaunch.record.events import RunStarted, to_line
from tests.ssh_util import run_view
from tests.timing import no_hang

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"), HOME=str(tmp_path))


def run(args, env, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def spec(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "proj" / "c.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"name: t\nworkdir: {ROOT}\nnproc_per_node: 1\nhealthcheck: {{enabled: false}}\n{extra}")
    return path


def test_unknown_option_is_an_error_not_a_job_argument(env, tmp_path):
    proc = run(["up", str(spec(tmp_path)), "--dryrun"], env)
    assert proc.returncode == 2
    assert "No such option '--dryrun'" in proc.stderr and "Did you mean one of: '--dry-run'" in proc.stderr
    assert not (tmp_path / "state").exists()
    ok = run(["up", str(spec(tmp_path)), "--dry-run", "--", "--dryrun"], env)  # after --: the job's
    assert ok.returncode == 0 and "jobs/toy_ddp.py --dryrun" in ok.stdout


def test_early_failure_leaves_a_final_record_and_logs_follow_ends(env, tmp_path):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run(["up", str(spec(tmp_path, f"master: {{port: {port}}}\n")), "--run-id", "early"], env)
    assert proc.returncode == 2 and f"master.port {port} is already in use" in proc.stderr
    logged = run_view(tmp_path, "early")
    assert logged.state == "failed" and logged.ended is not None
    t0 = time.monotonic()
    logs = run(["logs", "early", "-f"], env, timeout=30)
    assert logs.returncode == 0
    no_hang(time.monotonic() - t0, 20, "`logs -f` of a run that has ended returns instead of following")


def test_status_and_logs_default_to_this_projects_latest_run(env, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.yaml").write_text(f"name: o\nworkdir: {ROOT}\nnproc_per_node: 1\nhealthcheck: {{enabled: false}}\n")
    assert run(["up", str(spec(tmp_path)), "--run-id", "mine-1"], env).returncode == 0
    assert run(["up", str(other / "c.yaml"), "--run-id", "other-1"], env).returncode == 0
    status = run(["status"], env, cwd=tmp_path / "proj")
    assert status.stdout.startswith("mine-1: ok") and "mine-1" in status.stderr, status.stdout + status.stderr
    logs = run(["logs"], env, cwd=tmp_path / "proj")
    assert "[localhost:0] rank=0 mean_grad=2.0 updated_weight=0.8" in logs.stdout and "latest run of" in logs.stderr
    again = run(["up", str(spec(tmp_path)), "--run-id", "mine-1"], env)
    assert again.returncode == 2 and "a run with this id exists" in again.stderr


def test_a_launcher_that_died_is_reported(env, tmp_path):
    runs = tmp_path / "state" / "runs" / "ghost"
    runs.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (runs / "record.json").write_text(json.dumps({
        "run_id": "ghost", "spec_path": "x", "backend": "local", "hosts": ["localhost"], "spec": {},
        "placement": {"kind": "local", "pid": dead.pid, "start": 1, "host": socket.gethostname()}}))
    (runs / "events.jsonl").write_text(to_line(RunStarted("ghost", "local", ["localhost"], dead.pid,
                                                          socket.gethostname())) + "\n")
    status = run(["status", "ghost"], env)
    assert status.stdout.startswith(f"ghost: supervisor died without ending the run (pid {dead.pid} gone)"), \
        status.stdout + status.stderr


@pytest.mark.parametrize("run_id", ["../etc", "/abs", "a/b", "$(touch x)", ".hidden", ""])
def test_bad_run_ids_are_refused(env, run_id):
    for cmd in (["status", run_id], ["logs", run_id], ["down", run_id]):
        if not run_id and cmd[0] != "down":
            continue
        proc = run(cmd, env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (cmd, proc.stderr)


def test_corrupt_record_is_one_line(env, tmp_path):
    path = tmp_path / "state" / "runs" / "bad" / "record.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    proc = run(["status", "bad"], env)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "unreadable" in proc.stderr


def test_runs_table_lines_up(env, tmp_path):
    for rid in ("a", "a-much-longer-run-id-than-the-other"):
        assert run(["up", str(spec(tmp_path)), "--run-id", rid], env).returncode == 0
    lines = run(["runs"], env).stdout.splitlines()
    starts = {line.index(" ok ") for line in lines[1:]}
    assert len(lines) == 3 and len(starts) == 1, lines


@pytest.mark.parametrize("args, says", [
    (["--emulate-slow", "3:2@10"], "need --emulate RANKS_PER_HOST"),
    (["--emulate", "8", "--emulate-slow", "3@10"], "--emulate-slow '3@10': write it RANK:FACTOR@STEP (e.g. 3:2.5@100)"),
    (["--emulate", "8", "--emulate-freeze", "x@1"], "--emulate-freeze 'x@1': write it RANK@STEP"),
    (["--emulate", "8", "--emulate-exit", "1:2"], "--emulate-exit '1:2': write it RANK:CODE@STEP"),
    (["--emulate", "0"], "--emulate"),
    (["--emulate", "2", "--emulate-freeze", "2@5"], "--emulate-freeze '2@5': the run has ranks 0-1 (1 host x 2)"),
])
def test_emulation_refuses_what_it_cannot_do_in_one_line(env, tmp_path, args, says):
    out = run(["up", str(spec(tmp_path)), "--dry-run", *args], env)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
