"""The node agent (hostside/agent.py) as a process: what its node's ranks send it, folded into one
line per window of steps; a message from another user's process is not heard; it ends with its
parent, saying its ranks' newest step first; it says which of its ranks froze, and when they run
again."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ddplaunch.hostside import payloads as P

AGENT = Path(P.__file__).with_name("agent.py")


def _start(parent: int, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(AGENT), "--window", "2", "--warmup", "0", name, str(parent)],
                            stdout=subprocess.PIPE, text=True)


def _send(name: str, message: dict, user: str | None = None) -> None:
    """`message` sent to agent `name` as a rank sends it (by a process of `user`, if given: the
    system's python, a datagram to the agent's address)."""
    if user is None:
        assert P.to_agent(message) == P.SENT
        return
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
            "s.sendto(sys.argv[2].encode(), chr(0) + sys.argv[1])")
    subprocess.run(["runuser", "-u", user, "--", "/usr/bin/python3", "-c", code, P.agent_address(name)[1:],
                    json.dumps(message)], check=True, timeout=60)


def _windows(agent: subprocess.Popen[str], count: int) -> list[P.HostWindow]:
    assert agent.stdout is not None
    found = []
    while len(found) < count:
        line = agent.stdout.readline()
        assert line, "the agent ended before its windows"
        if line.startswith("DDPLAUNCH_WINDOW_JSON "):
            found.append(P.read_payload("WINDOW", line.split(" ", 1)[1]))
    return found


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None or not Path("/usr/bin/python3").exists(),
                    reason="needs root, runuser and /usr/bin/python3")
def test_the_agent_folds_its_ranks_steps_per_window_and_hears_only_its_user(monkeypatch):
    name = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(P.AGENT_ENV, name)
    parent = subprocess.Popen(["sleep", "120"])
    agent = _start(parent.pid, name)
    try:
        time.sleep(0.5)  # its socket bound (a datagram sent before is refused: the sender says ABSENT)
        for rank in (0, 1):
            _send(name, {"kind": "start", "rank": rank})
        # another user's process says rank 7 stepped: not heard
        _send(name, {"rank": 7, "steps": [[1, 9.0, 0.0], [2, 9.0, 0.0]]}, user="nobody")
        _send(name, {"rank": 0, "steps": [[1, 0.30, 0.10], [2, 0.32, 0.12], [3, 0.3, 0.1]]})
        _send(name, {"rank": 1, "steps": [[1, 0.30, 0.25], [2, 0.32, 0.27], [3, 0.3, 0.2]]})
        (window,) = _windows(agent, 1)
        assert (window.first, window.last, sorted(window.ranks)) == (1, 2, ["0", "1"])
        compute, wait, step = window.ranks["0"][:3]
        assert (round(compute, 3), round(wait, 3), round(step, 3)) == (0.2, 0.11, 0.31)
        assert round(window.ranks["1"][0], 3) == 0.05
        parent.kill()
        parent.wait(timeout=10)
        rest, _ = agent.communicate(timeout=15)  # ends within a look or two at its parent (each second)
        # having said its ranks' newest step (3), whenever its last status line was
        said = [P.read_payload("HOSTSTEPS", line.split(" ", 1)[1]) for line in rest.splitlines()
                if line.startswith("DDPLAUNCH_HOSTSTEPS_JSON ")]
        assert said and said[-1].step == 3, rest
    finally:
        for proc in (agent, parent):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _said(agent: subprocess.Popen[str], kind: str, timeout: float) -> object:
    """The next payload of `kind` the agent prints, within `timeout` seconds (a hang guard)."""
    assert agent.stdout is not None
    fd, buffer, deadline = agent.stdout.fileno(), b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if ready and not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(f"DDPLAUNCH_{kind}_JSON ".encode()):
                return P.read_payload(kind, line.decode().split(" ", 1)[1])
    raise AssertionError(f"no {kind} from the agent in {timeout:g}s")


RANK_PROCESS = """
import sys, time
from ddplaunch.hostside import payloads as P
while P.to_agent({"kind": "start", "rank": int(sys.argv[1])}) != P.SENT:  # until the agent's socket is bound
    time.sleep(0.05)
print("sent", flush=True)
sys.stdin.read()
"""


def test_the_agent_says_which_of_its_ranks_froze_and_when_they_run_again(monkeypatch):
    name = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(P.AGENT_ENV, name)
    parent = subprocess.Popen(["sleep", "120"])
    agent = _start(parent.pid, name)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROCESS, str(r)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline() == "sent\n"
        os.kill(ranks[1].pid, signal.SIGSTOP)  # as a hung device leaves a rank
        # said at the second look that finds it stopped (looks 2 s apart): 3x that as the guard
        frozen = _said(agent, "FROZEN", timeout=12.0)
        assert isinstance(frozen, P.HostFrozen)
        assert (frozen.ranks, frozen.of) == ({"1": ["T", ranks[1].pid]}, 2)
        os.kill(ranks[1].pid, signal.SIGCONT)
        again = _said(agent, "FROZEN", timeout=12.0)
        assert isinstance(again, P.HostFrozen) and (again.ranks, again.of) == ({}, 2)
    finally:
        for proc in (*ranks, agent, parent):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)
