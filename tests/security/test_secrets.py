"""Secrets stay secret: a token taken from the launcher's environment reaches every rank, yet never
appears on any command line (`ps` as another user, polled through the whole run), in any file of
the run's record, in the output, the dry run, `validate` or `--json`; run files are 0600 in 0700
directories."""

from __future__ import annotations

import os
import sys
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from tests.ssh_util import ROOT, launcher_env, ranks_showing

SECRET = "tok-5f3a-very-secret-9c1e"
SHOW = "import os; print('token length', len(os.environ['HF_TOKEN']), os.environ['HF_TOKEN'] == os.environ['WANT'])"


class PsWatcher:
    """`ps -eo args` as user nobody, over and over, until stopped: every command line it saw."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        argv = ["runuser", "-u", "nobody", "--", "ps", "-eo", "args"] if os.geteuid() == 0 else ["ps", "-eo", "args"]
        while not self._stop.is_set():
            self.seen.append(subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout)

    def __enter__(self) -> "PsWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "show_token.py"
    script.write_text(SHOW + "\n")
    return script


def _run(spec: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, PsWatcher]:
    env = dict(launcher_env(tmp_path), SECRET_FOR_TEST=SECRET, WANT=SECRET)
    with PsWatcher() as ps:
        proc = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), *extra], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, env=env)
    return proc, ps


def _assert_nowhere(tmp_path: Path, proc: subprocess.CompletedProcess, ps: PsWatcher, ranks: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert ranks_showing(proc.stdout, "token length 25 True") == ranks, proc.stdout[-2000:]
    assert len(ps.seen) > 5, "ps was not polled during the run"
    assert not [snap for snap in ps.seen if SECRET in snap], "the secret was on a command line"
    assert SECRET not in proc.stdout + proc.stderr
    runs = tmp_path / "state" / "runs"
    files = [p for p in runs.rglob("*") if p.is_file()]
    assert files and not [p for p in files if SECRET.encode() in p.read_bytes()]
    for p in [runs, *runs.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, f"{p} is {oct(mode)}"


def test_secret_from_env_local(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "sec", "workdir": str(ROOT), "nproc_per_node": 2,
        "healthcheck": {"enabled": False}, "job": {"script": str(_script(tmp_path))},
        "env": {"HF_TOKEN": {"from_env": "SECRET_FOR_TEST"}, "WANT": {"from_env": "WANT"}}}))
    proc, ps = _run(spec, tmp_path, "--json")
    _assert_nowhere(tmp_path, proc, ps, ranks=2)
    env = dict(launcher_env(tmp_path), SECRET_FOR_TEST=SECRET, WANT=SECRET)
    for args in (["up", str(spec), "--dry-run"], ["validate", str(spec)]):
        out = subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True,
                             timeout=60, cwd=ROOT, env=env)
        assert out.returncode == 0 and SECRET not in out.stdout + out.stderr, args
    host_files = [p for p in (tmp_path / ".ddplaunch").rglob("*.env")] if (tmp_path / ".ddplaunch").exists() else []
    for p in host_files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600


@pytest.mark.root
@pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser to look as another user")
def test_secret_from_env_ssh(sim_cluster, tmp_path):
    data = yaml.safe_load(sim_cluster.spec_path.read_text())
    data.update(hosts=data["hosts"][:2], workdir=str(ROOT), nproc_per_node=1, healthcheck={"enabled": False},
                job={"script": str(_script(tmp_path))},
                env={"HF_TOKEN": {"from_env": "SECRET_FOR_TEST"}, "WANT": {"from_env": "WANT"}})
    spec = tmp_path / "ssh.yaml"
    spec.write_text(yaml.safe_dump(data))
    proc, ps = _run(spec, tmp_path)
    _assert_nowhere(tmp_path, proc, ps, ranks=2)
