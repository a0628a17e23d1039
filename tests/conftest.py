"""Shared fixtures and the suite's rules: the simulated cluster (real namespaces, sshd, Slurm) for
integration tests; with CI=true a skipped test FAILS, unless it needs a GPU (CI has none): a green
CI run means every real-system test ran (they skip elsewhere: no root, sshd, Slurm, runuser, iperf3);
every test's launchers, tagged processes and Slurm jobs are ended after
it, pass or fail, so one failure never cascades into the next test."""

from __future__ import annotations

import os
import signal

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
