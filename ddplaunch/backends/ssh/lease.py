"""The supervisor's side of the nodes' leases (backends/shell.py `lease_loop`): while a stage runs,
every node's lease is renewed every lease/4 seconds (at most 30) with a line sent into the node's
own session, which its lease loop reads: no session, login shell or file a renewal. A node that
has read none for `supervisor.lease` seconds stops its ranks itself, so a supervisor that died,
froze or lost its network leaves no rank running longer than that. A host counted lost is fenced:
no longer renewed, and asked again and again to end the run's processes until it answers
(`Fence`), so a host that was only cut off does not run on beside its spare.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Callable, Optional

import paramiko

from ddplaunch.backends.shell import RENEWAL, lease_every

class Renewals:
    """A thread that calls `renew()` every `interval(lease)` seconds until the block ends, the
    first time one interval after it began: a node's lease loop counts from its own start. `renew`
    renews every node still followed (a lost host is not: its lease runs out, which fences it)."""

    def __init__(self, lease: float, renew: Callable[[], None]):
        self.every, self.renew = lease_every(lease), renew
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Renewals":
        self._thread = threading.Thread(target=self._run, name="ddplaunch-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: Optional[type[BaseException]], err: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.every):
            self.renew()


def renew(channels: list[paramiko.Channel]) -> None:
    """Every node's lease, renewed through its own session: one line. A closed channel (its node
    ended, or its host was counted lost and its connection dropped) is left out, so a lost host is
    renewed no more; one whose window is full (its host stopped reading) is not waited for."""
    for channel in channels:
        if channel.closed or not channel.send_ready():
            continue
        try:
            channel.send(RENEWAL)
        except (OSError, EOFError, paramiko.SSHException):
            continue


class Fence:
    """Hosts counted lost, kept from running on: each is asked to end the run's processes
    (`reap()`, given with it) every RETRY_S seconds from the moment it is lost until it answers (a
    host cut off, not dead, comes back with its ranks still running) or `until_s` has passed (by
    then its own lease has stopped them). Threads end with `close`."""

    RETRY_S = 2.0

    def __init__(self, until_s: float):
        self.until_s = until_s
        self._closed = threading.Event()

    def add(self, label: str, reap: Callable[[], object]) -> None:
        threading.Thread(target=self._run, args=(reap,), name=f"ddplaunch-fence-{label}", daemon=True).start()

    def _run(self, reap: Callable[[], object]) -> None:
        deadline = time.monotonic() + self.until_s
        while not self._closed.is_set() and time.monotonic() < deadline:
            try:
                reap()
            except Exception:  # noqa: BLE001 - not answering yet: the point of trying again
                self._closed.wait(self.RETRY_S)
                continue
            return

    def close(self) -> None:
        self._closed.set()
