"""The nodes' lease loop (backends/shell.py `lease_loop`) in a real bash on this machine: a node
that reads no line on its session's input for the lease ends its command (SIGTERM); one renewed
keeps running; a command that ignores SIGTERM is killed after the grace; a session that ended
(its input at an end) still ends the node after the lease, without the loop spinning."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from ddplaunch.backends.shell import HEARTBEAT_LOOP, RENEWAL, lease_loop
from ddplaunch.output.torchrun import HEARTBEAT
from tests.timing import no_hang


def _node(tmp_path: Path, lease: int, grace: int, command: str) -> subprocess.Popen:
    """`bash -c` as a node runs it: the lease loop, then exec of the command (its pid is $$), its
    input a pipe as the session's pty is (the supervisor's end: the Popen's stdin)."""
    line = f"{lease_loop(lease, grace)} && exec {command} < /dev/null"
    return subprocess.Popen(["bash", "-c", line], env=dict(os.environ, HOME=str(tmp_path)), stdin=subprocess.PIPE)


def _renew(node: subprocess.Popen) -> None:
    """As the supervisor renews (backends/ssh/lease.py `renew`): one line into the session."""
    assert node.stdin is not None
    node.stdin.write(RENEWAL)
    node.stdin.flush()


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
            _renew(node)
            time.sleep(0.5)  # the renewal interval of this test
            assert node.poll() is None, f"ended at renewal {i}"
        stopped = time.monotonic()
        assert node.wait(timeout=60) == -15
        assert time.monotonic() - stopped >= 3  # never less than the lease
    finally:
        if node.poll() is None:
            node.kill()


def test_a_session_that_ended_ends_the_node_after_the_lease_without_spinning(tmp_path):
    """The supervisor's end closed (a killed supervisor's connection): the loop's input is at its
    end and every read returns at once; it waits its second on its nap and stops the node after
    the lease, having used next to no CPU in that time (a loop that spun on the end would use most
    of a core for all of it)."""
    node = _node(tmp_path, lease=3, grace=30, command="sleep 300")
    assert node.stdin is not None
    t0 = time.monotonic()  # before the last renewal: the lease counts from its reading, after this
    _renew(node)
    node.stdin.close()
    loops = set()
    while not loops and time.monotonic() - t0 < 10:
        loops = _children({node.pid})
    assert loops, "no lease loop found"
    (loop,) = loops
    code = node.wait(timeout=60)
    took = time.monotonic() - t0
    assert code == -15
    assert took >= 3, took  # never before the lease, however loaded the machine
    no_hang(took, 15, "a node whose session ended ends after the lease (3 s; 5x)")
    assert _cpu_s(loop) < 0.1 * took, "the lease loop spun on its input's end"


def test_a_node_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    node = _node(tmp_path, lease=1, grace=2, command="bash -c \"trap '' TERM; exec sleep 300\"")
    t0 = time.monotonic()
    assert node.wait(timeout=60) == -9
    took = time.monotonic() - t0
    assert took >= 3, took  # the lease, then the grace
    no_hang(took, 20, "SIGKILL after the grace")


def test_a_fenced_host_is_asked_until_it_answers_then_left_alone(monkeypatch):
    """The supervisor's side of fencing (backends/ssh/lease.py `Fence`): a lost host that does not
    answer is asked again every RETRY_S; once it answered (its ranks ended) it is asked no more."""
    from ddplaunch.backends.ssh.lease import Fence

    monkeypatch.setattr(Fence, "RETRY_S", 0.01)
    calls, done = [], threading.Event()

    def reap() -> None:
        calls.append(time.monotonic())
        if len(calls) < 4:
            raise OSError("no route to host")  # cut off: not answering yet
        done.set()
    fence = Fence(until_s=60)
    fence.add("h1", reap)
    assert done.wait(timeout=30)
    time.sleep(0.2)  # 20 more retry intervals: none comes
    fence.close()
    assert len(calls) == 4


def test_fencing_gives_up_after_the_hosts_own_lease_and_on_close(monkeypatch):
    from ddplaunch.backends.ssh.lease import Fence

    monkeypatch.setattr(Fence, "RETRY_S", 0.01)
    calls: list[float] = []

    def never() -> None:
        calls.append(time.monotonic())
        raise OSError("no route to host")
    fence = Fence(until_s=0.3)  # by then the host's own lease has stopped its ranks
    fence.add("h1", never)
    time.sleep(1.0)
    asked = len(calls)
    assert asked >= 2 and calls[-1] - calls[0] < 0.3, (asked, calls[-1] - calls[0])
    time.sleep(0.2)
    assert len(calls) == asked  # gave up
    fence = Fence(until_s=60)
    fence.add("h2", never)
    time.sleep(0.1)
    fence.close()
    time.sleep(0.1)
    after = len(calls)
    time.sleep(0.2)
    assert len(calls) == after  # closed: asked no more


def _children(pids: set[int]) -> set[int]:
    """The live (not zombie) processes whose parent is one of `pids`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) in pids and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_nodes_loops_fork_nothing_while_they_wait(tmp_path):
    """The heartbeat and lease loops wait their second with bash's own `read -t` on a pipe nobody
    writes to: no process of theirs runs but themselves, where `sleep 1` forked and exec'd every
    second in each loop (two a second a host: 2,000 a second on 1,000 hosts)."""
    line = f"{HEARTBEAT_LOOP} && {lease_loop(60, 30)} && exec sleep 300 < /dev/null"
    node = subprocess.Popen(["bash", "-c", line], env=dict(os.environ, HOME=str(tmp_path)), stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        assert [node.stdout.readline().strip() for _ in range(3)] == [HEARTBEAT] * 3  # beating, a second apart
        no_hang(time.monotonic() - t0, 15, "three heartbeats")
        loops = _children({node.pid})
        assert len(loops) == 2, loops  # the two loops' subshells
        for _ in range(20):
            assert _children(loops) == set()
            time.sleep(0.1)
    finally:
        node.kill()
        node.wait(timeout=30)
