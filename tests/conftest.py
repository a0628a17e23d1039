"""Shared fixtures and the suite's rules: the simulated cluster (real namespaces, sshd, Slurm) for
integration tests; with CI=true a skipped test FAILS, unless it needs a GPU (CI has none): a green
CI run means every real-system test ran (they skip elsewhere: no root, sshd, Slurm, runuser, iperf3);
every test's launchers, tagged processes and Slurm jobs are ended after
it, pass or fail, so one failure never cascades into the next test."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import ssh_util
from tests.simfixture import image, noisy_sim_cluster, sim_cluster, slurm_cluster  # noqa: F401  (re-exported fixtures)
from tests.simfixture import slurm_nodes_idle

#: Fixtures that stand for a real system (root, sshd, Slurm): a test using one is a real-system test.
REAL_FIXTURES = {"sim_cluster", "slurm_cluster", "bed", "noisy_sim_cluster", "image"}
#: A real-system test is marked `slurm` too when it uses the Slurm sim (the fixture, or the fault
#: matrix's `bed` on Slurm), so .ci/run can run those in a process of their own beside the SSH ones:
#: the two sim clusters share nothing (prefixes, subnets, daemons) and each process owns its own.
STRICT = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_ran: list[str] = []
_skipped_real: list[tuple[str, str]] = []


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if REAL_FIXTURES & names:
            item.add_marker(pytest.mark.root)
        callspec = getattr(item, "callspec", None)
        if "slurm_cluster" in names or (callspec is not None and callspec.params.get("bed") == "slurm"):
            item.add_marker(pytest.mark.slurm)
    if os.geteuid() == 0 and any(item.get_closest_marker("root") for item in items):
        _stale_rehash_lock()
        _remote_shell_starts()


#: How long root's shell may take to start as sshd starts it before the real-system tests are
#: refused: every SSH command of every test runs in such a shell.
SHELL_START_LIMIT_S = 15.0


#: pyenv's rehash lock in root's home: a rehash holds it for well under a second and waits at most
#: 60 s for it (PYENV_REHASH_TIMEOUT), so one older than this was left by a shell killed inside it.
REHASH_LOCK, REHASH_LOCK_STALE_S = ".pyenv/shims/.pyenv-shim", 120.0


def _stale_rehash_lock() -> None:
    """Remove pyenv's rehash lock when a killed shell left it (a crashed sim host kills every process
    on it, a shell reading root's rc file among them): while it stays, every later SSH session of
    every test waits 60 s in root's ~/.bashrc (`pyenv init -`) and times out."""
    lock = Path(pwd.getpwuid(0).pw_dir) / REHASH_LOCK
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > REHASH_LOCK_STALE_S:
        lock.unlink(missing_ok=True)
        print(f"note: removed {lock}, left {age:.0f} s ago by a shell killed in `pyenv rehash`")


def _remote_shell_starts() -> None:
    """Stop the run at once when root's shell, started as sshd starts it (its rc files read), takes
    longer than SHELL_START_LIMIT_S: every real-system test would then time out one by one for an
    hour and a half. Seen: an rc file that runs `pyenv init -` waits 60 s on a lock file its last
    rehash left behind when a shell was killed inside it."""
    shell = pwd.getpwuid(0).pw_shell or "/bin/sh"
    env = {"HOME": pwd.getpwuid(0).pw_dir, "PATH": "/usr/bin:/bin", "SHLVL": "0", "SSH_CLIENT": "127.0.0.1 1 22"}
    start = time.monotonic()
    try:
        subprocess.run([shell, "-c", "true"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=SHELL_START_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.exit(f"root's shell ({shell}) did not start within {SHELL_START_LIMIT_S:.0f} s as sshd starts it "
                    f"(its rc files read): every SSH test would time out. Time `SSH_CLIENT=x SHLVL=0 {shell} -c true` "
                    "and fix the rc file (e.g. a stale lock file: /root/.pyenv/shims/.pyenv-shim)", returncode=3)
    else:
        took = time.monotonic() - start
        if took > SHELL_START_LIMIT_S / 3:
            print(f"note: root's shell took {took:.1f} s to start as sshd starts it (rc files)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and STRICT and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped_real.append((item.nodeid, reason))
        report.outcome = "failed"
        report.longrepr = f"real-system test could not run in CI (CI=true): {reason}"
    elif report.when == "call" and report.passed and item.get_closest_marker("root") is not None:
        _ran.append(item.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(f"real-system tests that ran and passed: {len(_ran)}")
    for nodeid, reason in _skipped_real:
        terminalreporter.write_line(f"COULD NOT RUN (CI=true makes this a failure): {nodeid}: {reason}")


@pytest.fixture(autouse=True)
def _slurm_nodes_idle_first(request):
    """A test of the Slurm sim starts on idle nodes: in CI the Slurm tests run back to back, and
    the one before may have left a node completing a cancelled job or coming back from a crash."""
    if "slurm_cluster" in request.fixturenames:
        slurm_nodes_idle(request.getfixturevalue("slurm_cluster"))


@pytest.fixture(autouse=True)
def _end_what_the_test_started():
    """After every test: launchers it started are interrupted (then killed), so are the supervisors
    of its runs that still run, processes tagged with its run ids are killed, and Slurm jobs named
    after them are cancelled."""
    ssh_util.started.clear()
    yield
    for proc in ssh_util.started.launchers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                proc.kill()
                proc.wait(timeout=10)
    ssh_util.started.end_supervisors()
    for run_id in ssh_util.started.run_ids:
        ssh_util.kill_run(run_id)
    if os.geteuid() == 0:
        _stale_rehash_lock()
