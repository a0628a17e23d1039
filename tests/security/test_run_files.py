"""Nothing secret at rest or on screen, and every run file private: after a run — ok, failed or
interrupted, local and over SSH — no file under the run's directories (the launcher's record and
every host's run dir) holds a secret's value, a job that prints a secret shows `<secret>` on screen
and in the log, every file is 0600 and every directory 0700. A corrupt run record is one line."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ssh_util import ROOT, launcher_env, popen_ddplaunch, read_until, run_processes, wait_for

SECRET = "hunter2-Zq8-not-for-your-eyes"
JOB = """import os, sys, time
print("the token is", os.environ["API_TOKEN"], flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail":
    raise SystemExit(f"failing with {os.environ['API_TOKEN']}")
if mode == "hang":
    print("hanging now", flush=True)
    time.sleep(300)
"""


def _spec(tmp_path: Path, mode: str, base: dict) -> Path:
    job = tmp_path / "leaky.py"
    job.write_text(JOB)
    data = {**base, "env": {"API_TOKEN": {"value": SECRET, "secret": True}},
            "healthcheck": {"enabled": False}, "workdir": str(tmp_path),
            "job": {"script": "leaky.py", "args": [mode]}}
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _run(spec: Path, tmp_path: Path, run_id: str, mode: str) -> tuple[int, str]:
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    if mode == "hang":
        out = "".join(read_until(proc, "hanging now", timeout=120))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        return proc.returncode, out + rest
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


def _private_and_clean(*roots: Path) -> None:
    """No file under `roots` holds the secret; every file 0600, every directory 0700."""
    for root in roots:
        assert root.is_dir(), root
        for path in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(path.lstat().st_mode)
            if path.is_dir():
                assert mode == 0o700, f"{path}: directory mode {mode:04o}"
            else:
                assert mode == 0o600, f"{path}: file mode {mode:04o}"
                assert SECRET.encode() not in path.read_bytes(), f"{path} holds the secret"


@pytest.mark.parametrize("mode, code", [("ok", 0), ("fail", 1), ("hang", 130)])
def test_local_run_leaves_no_secret_and_only_private_files(tmp_path, mode, code):
    run_id = f"sec-local-{mode}"
    spec = _spec(tmp_path, mode, {"backend": "local", "nproc_per_node": 1})
    rc, out = _run(spec, tmp_path, run_id, mode)
    assert rc == code, out[-3000:]
    assert "the token is <secret>" in out and SECRET not in out
    state = tmp_path / "state"
    assert SECRET not in (state / "runs" / run_id / "output.log").read_text()
    _private_and_clean(state, Path.home() / ".ddplaunch" / "runs" / run_id)


@pytest.mark.parametrize("mode, code", [("ok", 0), ("hang", 130)])
def test_ssh_run_leaves_no_secret_on_any_host(sim_cluster, tmp_path, mode, code):
    run_id = f"sec-ssh-{mode}"
    base = yaml.safe_load(sim_cluster.spec_path.read_text())
    base.update(hosts=base["hosts"][:2], nproc_per_node=1)
    rc, out = _run(_spec(tmp_path, mode, base), tmp_path, run_id, mode)
    assert rc == code, out[-3000:]
    assert "the token is <secret>" in out and SECRET not in out  # once: both ranks' lines folded
    log = (tmp_path / "state" / "runs" / run_id / "output.log").read_text()
    assert log.count("the token is <secret>") == 2 and SECRET not in log
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)
    # the sim's hosts share this machine's file system: their run dirs are this one
    _private_and_clean(tmp_path / "state", Path.home() / ".ddplaunch" / "runs" / run_id)


CORRUPT = {
    "placement": {"kind": "nowhere"},
    "hosts": ["a", 3],
    "started_at": "yesterday",
    "spec": [],
}


@pytest.mark.parametrize("key", sorted(CORRUPT))
def test_a_corrupt_record_is_one_line_naming_the_file_and_the_key(tmp_path, key):
    record = {"run_id": "bad", "spec_path": "x", "backend": "local", "hosts": ["localhost"],
              "spec": {"backend": "local"}, "started_at": 1.0,
              "placement": {"kind": "local", "pid": 1, "start": 1, "host": "h"}, key: CORRUPT[key]}
    path = tmp_path / "state" / "runs" / "bad" / "record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    env = launcher_env(tmp_path)
    for command in (["status", "bad"], ["logs", "bad"], ["down", "bad"]):
        proc = subprocess.run([sys.executable, "-m", "ddplaunch", *command], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (command, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and repr(key) in lines[0], lines
