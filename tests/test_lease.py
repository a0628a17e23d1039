"""The nodes' lease loop (backends/shell.py `lease_loop`) in a real bash on this machine: a node
whose lease file stops changing ends its command (SIGTERM) after the lease; one renewed keeps
running; a command that ignores SIGTERM is killed after the grace."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from ddplaunch.backends.shell import LEASE_FILE, lease_loop
from tests.timing import no_hang

RUN = "lease-t"


def _node(tmp_path: Path, lease: int, grace: int, command: str) -> subprocess.Popen:
    """`bash -c` as a node runs it: the lease loop, then exec of the command (its pid is $$)."""
    (tmp_path / ".ddplaunch" / "runs" / RUN).mkdir(parents=True)
    line = f"{lease_loop(RUN, lease, grace)} && exec {command}"
    return subprocess.Popen(["bash", "-c", line], env=dict(os.environ, HOME=str(tmp_path)))


def _lease(tmp_path: Path) -> Path:
    return tmp_path / ".ddplaunch" / "runs" / RUN / LEASE_FILE


def test_a_lease_not_renewed_ends_the_node(tmp_path):
    node = _node(tmp_path, lease=2, grace=30, command="sleep 300")
    t0 = time.monotonic()
    code = node.wait(timeout=60)
    took = time.monotonic() - t0
    assert code == -15  # SIGTERM: torchrun would stop its workers
    assert took >= 2, took
    no_hang(took, 12, "a node whose lease is not renewed ends after the lease (2 s)")


def test_a_renewed_lease_keeps_the_node_running_until_renewals_stop(tmp_path):
    node = _node(tmp_path, lease=3, grace=30, command="sleep 300")
    try:
        for i in range(18):  # 9 s of renewals, three leases long; one missed renewal is not an end
            _lease(tmp_path).write_text(str(i))
            time.sleep(0.5)  # the renewal interval of this test
            assert node.poll() is None, f"ended at renewal {i}"
        stopped = time.monotonic()
        assert node.wait(timeout=60) == -15
        assert time.monotonic() - stopped >= 3  # never less than the lease
    finally:
        if node.poll() is None:
            node.kill()


def test_a_node_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    node = _node(tmp_path, lease=1, grace=2, command="bash -c \"trap '' TERM; exec sleep 300\"")
    t0 = time.monotonic()
    assert node.wait(timeout=60) == -9
    took = time.monotonic() - t0
    assert took >= 3, took  # the lease, then the grace
    no_hang(took, 20, "SIGKILL after the grace")
