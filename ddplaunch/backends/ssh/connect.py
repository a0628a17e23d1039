"""SSH connections along each host's route: one per host, plus one per jump host shared by every
host behind it, every host key verified (the jump's too).

Fabric makes each connection from the route's resolved values (routes.py), not from its own ssh
config lookup: the route is the one source of truth, shown by the dry run. A host behind a jump
is reached through a `direct-tcpip` channel of the jump's connection, opened with the spec's
connect timeout (a dead target behind a live bastion is named within it); a ProxyCommand runs as
OpenSSH would run it. A jump host that does not answer is named as such, once for every host
behind it.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

import paramiko
from fabric import Config, Connection

from ddplaunch.backends.failfast import PROBE_S, unanswered
from ddplaunch.backends.known_hosts import RevokedHostKeyError, configure
from ddplaunch.backends.ssh.routes import Route
from ddplaunch.errors import BackendError
from ddplaunch.spec.model import ClusterSpec

#: The pre-flight's fix for a host whose key is unknown, changed or revoked (never "check the host is up").
HOST_KEY_FIX = ("verify the host's key out of band, then fix ssh.known_hosts as the message says "
                "(ssh.host_key_policy: accept-new only adds keys of hosts not yet known)")
#: Seconds between keepalives on every connection (a dead peer ends the transport).
KEEPALIVE_S = 5
#: Seconds an idle connection's transport thread sleeps between its looks at the connection.
TRANSPORT_WAKE_S = 1.0
#: Seconds a jump host that failed is not tried again (each host behind it fails with its error).
JUMP_RETRY_S = 10.0


class PolledProxyCommand(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, read with poll(): paramiko's own waits with select(), which
    raises ValueError on a descriptor numbered 1024 or more (a supervisor of ~340 hosts behind
    a ProxyCommand has that many), and spins on the command's end of output."""

    def recv(self, size: int) -> bytes:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        buffer, start = b"", time.monotonic()
        try:
            while len(buffer) < size:
                wait_ms = None
                if self.timeout is not None:
                    left = self.timeout - (time.monotonic() - start)
                    if left <= 0:
                        break
                    wait_ms = max(1, int(left * 1000))
                if not poller.poll(wait_ms):
                    continue
                chunk = os.read(fd, size - len(buffer))
                if not chunk:  # the command ended: what came is all there is
                    break
                buffer += chunk
        except OSError as err:
            raise paramiko.ProxyCommandFailure(" ".join(self.cmd), err.strerror or str(err)) from None
        if not buffer and self.timeout is not None and time.monotonic() - start >= self.timeout:
            raise socket.timeout()
        return buffer


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (a supervisor holds a few
    per host: 1,000 hosts pass the usual 1,024); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


class Connector:
    """The run's SSH connections, by host label, and the jump hosts' by route."""

    def __init__(self, spec: ClusterSpec, routes: dict[str, Route]):
        self.spec, self.routes = spec, routes
        raise_fd_limit()  # a few descriptors per host: 1,000 hosts pass the usual soft limit
        ssh = spec.ssh
        self.known = Path(spec.resolve(ssh.known_hosts) if ssh.known_hosts else "~/.ssh/known_hosts").expanduser()
        self._conns: dict[str, Connection] = {}
        self._jumps: dict[Route, Connection] = {}
        self._lock = threading.Lock()
        self._jump_locks: dict[Route, threading.Lock] = {}
        #: A jump host's last failure and when: the hosts behind it fail at once with it for a
        #: while instead of each waiting out the connect timeout again.
        self._jump_failed: dict[Route, tuple[float, BackendError]] = {}

    def connect(self, label: str) -> Connection:
        """An open, host-key-verified connection to host `label` (cached).

        Raises:
            BackendError: unreachable (or its jump host is), refused, auth failed or host key not
                trusted — the message names the host (or the jump host) and the fix.
        """
        with self._lock:
            conn = self._conns.get(label)
        if conn is not None and conn.is_connected:
            return conn
        route = self.routes[label]
        try:
            conn = self._open(route, label)
        except BackendError as err:
            raise BackendError(f"{label}: {err}" if err.jump is not None else str(err), fix=err.fix,
                               jump=err.jump) from None
        with self._lock:
            self._conns[label] = conn
        return conn

    def _open(self, route: Route, who: str) -> Connection:
        """A connection along `route` (through its jump hosts' connections); `who` names it in errors."""
        timeout = self.spec.ssh.connect_timeout
        kwargs: dict[str, Any] = {"timeout": timeout, "banner_timeout": timeout, "auth_timeout": timeout}
        if route.keys:
            kwargs.update(key_filename=list(route.keys))
            if route.sources.get("keys") == "spec":  # ssh.key: that key only, as before
                kwargs.update(look_for_keys=False, allow_agent=False)
        if route.jump is not None:
            kwargs["sock"] = self._channel_through(route.jump, route, who, timeout)
        elif route.proxy_command:
            kwargs["sock"] = PolledProxyCommand(route.proxy_command)
        # lazy: Fabric's own ssh config lookup is skipped; the route already holds its answer
        conn = Connection(route.hostname, user=route.user, port=route.port, config=Config(lazy=True),
                          connect_kwargs=kwargs)
        # Fabric installs AutoAddPolicy: replace it so unknown keys are refused (strict) or
        # appended under a lock (accept-new); changed and @revoked keys are always refused, and no
        # line of the file is ever rewritten.
        configure(conn.client, self.known, self.spec.ssh.host_key_policy)
        try:
            conn.open()
        except (paramiko.SSHException, OSError) as err:
            raise connect_error(route, who, self.known, timeout, err) from None
        conn.transport.set_keepalive(KEEPALIVE_S)
        # paramiko's transport thread wakes each 0.1 s on an idle connection (its socket's
        # timeout): 10,000 wakeups a second at 1,000 hosts; once connected, each second is enough
        # (closing the connection still ends the thread at once).
        conn.transport.sock.settimeout(TRANSPORT_WAKE_S)
        return conn

    def _jump(self, route: Route) -> Connection:
        """The shared connection to jump host `route` (opened once, by one thread)."""
        with self._lock:
            lock = self._jump_locks.setdefault(route, threading.Lock())
        with lock:
            conn = self._jumps.get(route)
            if conn is not None and conn.is_connected:
                return conn
            failed = self._jump_failed.get(route)
            if failed is not None and time.monotonic() - failed[0] < JUMP_RETRY_S:
                raise failed[1]
            try:
                conn = self._open(route, f"jump host {route.alias}")
            except BackendError as err:
                fix = err.fix or (f"check that jump host {route.alias} is up and its sshd answers (`ssh "
                                  f"{route.alias}` from here); the hosts behind it are reached through it")
                self._jump_failed[route] = (time.monotonic(), BackendError(str(err), fix=fix, jump=route.alias))
                raise self._jump_failed[route][1] from None
            with self._lock:
                self._jumps[route] = conn
            return conn

    def _channel_through(self, jump: Route, target: Route, who: str, timeout: float) -> paramiko.Channel:
        conn = self._jump(jump)
        try:
            return conn.transport.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                               timeout=timeout)
        except (paramiko.SSHException, OSError, EOFError) as err:
            raise BackendError(f"{who} ({target.hostname}:{target.port}): no answer through jump host {jump.alias} "
                               f"within {timeout}s ({err}): the host is down, or the jump host cannot reach "
                               "it") from None

    def unanswered(self, label: str) -> Optional[str]:
        """Why host `label`'s sshd does not answer a TCP connection (through its jump host, if it
        has one), or None when it does (or cannot be told: behind a ProxyCommand)."""
        route = self.routes[label]
        if route.proxy_command is not None:
            return None
        if route.jump is None:
            return unanswered(route.hostname, route.port)
        try:
            channel = self._channel_through(route.jump, route, label, PROBE_S)
        except BackendError as err:
            return str(err)
        channel.close()
        return None

    def drop(self, labels: list[str]) -> None:
        """Forget the connections to `labels` (lost hosts): a later stage connects afresh."""
        with self._lock:
            gone = [self._conns.pop(label) for label in labels if label in self._conns]
        for conn in gone:  # the transport's own thread ends when its socket closes
            threading.Thread(target=conn.close, daemon=True).start()

    def connected(self) -> set[str]:
        """The labels of the hosts with an open connection (a lost host's was dropped)."""
        with self._lock:
            return {label for label, conn in self._conns.items() if conn.is_connected}

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values()) + list(self._jumps.values())
            self._conns, self._jumps = {}, {}
        for conn in conns:
            conn.close()


def connect_error(route: Route, who: str, known: Path, timeout: float, err: BaseException) -> BackendError:
    """What failed when connecting along `route` to `who` (a host's label, or `jump host NAME`),
    and the fix."""
    where = f"{who} ({route.hostname})"
    if isinstance(err, RevokedHostKeyError):
        return BackendError(f"{where}: {err}", fix=HOST_KEY_FIX)
    if isinstance(err, paramiko.BadHostKeyException):
        return BackendError(
            f"{where}: host key MISMATCH — {known} has a different key ({err.expected_key.get_name()}) "
            f"than the host presented; refusing to connect. If the host was reinstalled, remove its "
            f"old key: ssh-keygen -R {route.hostname} -f {known}", fix=HOST_KEY_FIX)
    if isinstance(err, paramiko.SSHException) and "not found in known_hosts" in str(err):
        return BackendError(
            f"{where}: host key unknown — not in {known}; add it after checking it (ssh-keyscan "
            f"{route.hostname} >> {known}) or set ssh.host_key_policy: accept-new", fix=HOST_KEY_FIX)
    if isinstance(err, paramiko.SSHException):
        return BackendError(f"{where}: SSH failed: {err}")
    where = f"{who} ({route.hostname}:{route.port})"
    if isinstance(err, (socket.timeout, TimeoutError)):
        return BackendError(f"{where}: no answer within ssh.connect_timeout={timeout}s (host down or unreachable)")
    assert isinstance(err, OSError)
    return BackendError(f"{where}: cannot connect: {err.strerror or err} (is sshd running?)")
