"""The node agent: one per node of a stage, beside torchrun (the node's shell starts it).

It is where the node's ranks send what they measure (``DDPLAUNCH_AGENT``: a Unix datagram socket in the abstract namespace, its
name in the ranks' environment; only this user's processes are heard): each rank's start and its
step timing (steptiming.py). The agent folds them, so that the supervisor reads a few lines per
host and not a line per rank per second:

- one ``DDPLAUNCH_WINDOW_JSON`` per window of ``--window`` steps (the straggler judge's unit):
  every rank's median compute (step time minus its wait at the collectives) and wait over those
  steps, and the ranks that went silent (started, yet no report for SILENT_S while others report);
- one ``DDPLAUNCH_HOSTSTEPS_JSON`` every STATUS_S seconds while the ranks step: the newest step, the
  median step time and wait over the last interval, and the rank that computes longest;
- one ``DDPLAUNCH_FROZEN_JSON`` when the ranks that cannot run change (stopped, or in an
  uninterruptible wait, at two looks STATUS_S apart: a checkpoint's write to a slow disk is not
  one): the hang watchdog names them from it, with no stack dump of a thousand hosts needed. The
  agent knows its ranks' pids from their messages' credentials.

When the node's environment names checkpoint buddies (a memory tier with `replicas`), the agent
also copies this host's sealed checkpoint versions to them and takes theirs (``ckpt/replicas.py``);
with ``checkpoint.watch`` it watches the job's own checkpoint dir (``ckpt/jobwatch.py``).

The heartbeat that says the host lives is not the agent's (the node's shell says it, apart from
any parsing). It ends when its parent (the node's shell, then torchrun) does. Standard library
only: ``python agent.py [--window N] [--warmup N] NAME PARENT_PID``.
"""

import json
import os
import socket
import struct
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script: its siblings
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt"))  # (in the package: ckpt/)
sys.dont_write_bytecode = True  # no __pycache__ left in the run dir
import fold  # type: ignore[import-not-found]  # noqa: E402  (the folding, beside it)
import payloads as P  # type: ignore[import-not-found]  # noqa: E402  (the payload schema, beside it)
import procs  # type: ignore[import-not-found]  # noqa: E402  (process states, beside it)
import replicas  # type: ignore[import-not-found]  # noqa: E402  (the checkpoints' buddy copies, beside it)

try:
    import jobwatch  # type: ignore[import-not-found]  # noqa: E402  (checkpoint.watch: staged only then)
except ImportError:
    jobwatch = None

#: Seconds between two looks at the parent, and between two status lines.
ALIVE_S, STATUS_S = 1.0, 2.0


def open_socket(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(P.agent_address(name))
    return sock


def receive(sock: socket.socket) -> tuple[Optional[dict[str, Any]], int]:
    """One message from a rank of this user (others' are dropped) and its sender's pid; None when
    none came."""
    try:
        data, ancillary, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(12))
    except (socket.timeout, BlockingIOError, InterruptedError):
        return None, 0
    pid, uid = 0, None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
            pid, uid, _ = struct.unpack("iII", payload[:12])
    if uid != os.getuid():
        return None, 0
    try:
        message = json.loads(data)
    except ValueError:
        return None, 0
    return (message, pid) if isinstance(message, dict) else (None, 0)


class Frozen:
    """The node's ranks that cannot run: each rank's pid, and which were frozen at the last look."""

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}
        self.seen: dict[int, str] = {}  # frozen at the last look
        self.said: dict[int, str] = {}

    def look(self) -> Optional[dict[str, Any]]:
        """The ranks frozen at this look and the one before, when that changed since it was last said."""
        now = {r: s for r, pid in self.pids.items() if (s := procs.state_of(pid)) in procs.FROZEN}
        held = {r: s for r, s in now.items() if r in self.seen}
        self.seen = now
        if held == self.said:
            return None
        self.said = held
        return {"ranks": {str(r): [s, self.pids[r]] for r, s in sorted(held.items())}, "of": len(self.pids)}


def run(name: str, parent: int, window: int, warmup: int) -> None:
    sock = open_socket(name)
    replicas.start(os.environ, replicas.say_stderr)  # threads; they end with this process
    if jobwatch is not None:  # the job's own checkpoint dir, sealed, copied and persisted as it writes it
        jobwatch.start(os.environ, replicas.say_stderr)
    windows, status, frozen = fold.StepWindows(window, warmup), fold.Status(), Frozen()
    next_alive = next_status = time.monotonic()
    while True:
        # asleep until a rank's message or the next look: not a wake-up every few hundred ms
        sock.settimeout(max(0.01, min(next_alive, next_status) - time.monotonic()))
        message, pid = receive(sock)
        now = time.monotonic()
        if message is not None and isinstance(message.get("rank"), int):
            rank = message["rank"]
            if pid > 0:
                frozen.pids[rank] = pid
            if message.get("kind") == "start":
                windows.start(rank, now)
            elif isinstance(message.get("steps"), list):
                windows.add(rank, message["steps"], now)
                status.add(rank, message["steps"])
                for done in windows.done():
                    P.say(P.HostWindow(**done))
        if now >= next_alive:
            next_alive = now + ALIVE_S
            if not procs.proc_alive(parent):
                say_status(status)  # the ranks' last steps, not lost to the 2 s pace
                return
        if now >= next_status:
            next_status = now + STATUS_S
            say_status(status)
            change = frozen.look()
            if change is not None:
                P.say(P.HostFrozen(**change))


def say_status(status: "fold.Status") -> None:
    line = status.line()
    if line is not None:
        P.say(P.HostSteps(**line))


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="agent.py")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("name")
    parser.add_argument("parent", type=int)
    args = parser.parse_args(argv)
    try:
        run(args.name, args.parent, args.window, args.warmup)
    except (BrokenPipeError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
