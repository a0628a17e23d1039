"""SSH backend: one torchrun per host over Fabric connections, in parallel, with fail-fast.

Fabric makes and configures the connections (one per host per run); each node's stage runs in
its own session with a pty (session.py), so a dropped connection (even a SIGKILLed ddplaunch)
HUPs the remote torchrun. Host keys are verified against known_hosts (Fabric would accept any
key). backends/watch.py follows the started stage; stopping a node is explicit: SIGTERM to the
recorded torchrun pid, then the run's tag finds leftovers.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import paramiko
from fabric import Connection

from ddplaunch.backends.contract import CommandFor, HostResult, RunContext
from ddplaunch.backends.known_hosts import RevokedHostKeyError, configure
from ddplaunch.backends.shell import ShellLauncher, ShellRequest, describe_reap, pid_file, reaper_command
from ddplaunch.backends.ssh.session import NoMarker, SshStage, await_marker, session_command
from ddplaunch.backends.ssh.sync import sync
from ddplaunch.backends.watch import follow, unanswered, unstarted
from ddplaunch.errors import BackendError
from ddplaunch.hostcmd import marked, parse_answer, port_probe
from ddplaunch.plan import NodeCommand, host_python
from ddplaunch.results import UNREACHABLE, StageResult, StopEvent
from ddplaunch.runs import RunRecord
from ddplaunch.shellword import word
from ddplaunch.spec import ClusterSpec, HostSpec
from ddplaunch.stagelines import StageLines

#: Most hosts connected to, probed or started at once (threads; each SSH session costs ~1 thread).
MAX_PARALLEL = 64
#: The pre-flight's fix for a host whose key is unknown, changed or revoked (never "check the host is up").
HOST_KEY_FIX = ("verify the host's key out of band, then fix ssh.known_hosts as the message says "
                "(ssh.host_key_policy: accept-new only adds keys of hosts not yet known)")
#: How long a node's session may take to say it listens, then to take the run's files.
OPEN_TIMEOUT = 30.0
T = TypeVar("T")


class SshBackend(ShellLauncher):
    """Runs a plan on every host of an `ssh` spec."""

    name = "ssh"
    max_parallel = MAX_PARALLEL

    def __init__(self, spec: ClusterSpec, run: Optional[RunContext] = None):
        super().__init__(spec)
        self._conns: dict[str, Connection] = {}
        self._synced: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ connections

    def connect(self, host: HostSpec) -> Connection:
        """An open, host-key-verified connection to `host` (cached).

        Raises:
            BackendError: unreachable, refused, auth failed or host key not trusted — the
                message names the host and the fix.
        """
        with self._lock:
            conn = self._conns.get(host.label)
        if conn is not None and conn.is_connected:
            return conn
        ssh = self.spec.ssh
        kwargs: dict[str, Any] = {"timeout": ssh.connect_timeout, "banner_timeout": ssh.connect_timeout,
                                  "auth_timeout": ssh.connect_timeout}
        if ssh.key:
            kwargs.update(key_filename=[str(self.spec.resolve(ssh.key))], look_for_keys=False,
                          allow_agent=False)
        conn = Connection(host.addr, user=host.user or ssh.user, port=host.port or ssh.port,
                          connect_kwargs=kwargs)
        known = Path(self.spec.resolve(ssh.known_hosts) if ssh.known_hosts else "~/.ssh/known_hosts").expanduser()
        # Fabric installs AutoAddPolicy: replace it so unknown keys are refused (strict) or
        # appended under a lock (accept-new); changed and @revoked keys are always refused, and no
        # line of the file is ever rewritten.
        configure(conn.client, known, ssh.host_key_policy)
        try:
            conn.open()
        except (paramiko.SSHException, OSError) as err:
            raise _connect_error(host, conn.port, known, ssh.connect_timeout, err) from None
        conn.transport.set_keepalive(5)
        with self._lock:
            self._conns[host.label] = conn
        return conn

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()

    def _each(self, fn: Callable[[HostSpec], T], hosts: Optional[list[HostSpec]] = None
              ) -> list[tuple[HostSpec, Optional[T], Optional[BackendError]]]:
        """Call fn on every host (of the spec, or `hosts`) in parallel; (host, value, error) each."""
        hosts = self.spec.hosts if hosts is None else hosts

        def one(host: HostSpec) -> tuple[HostSpec, Optional[T], Optional[BackendError]]:
            try:
                return host, fn(host), None
            except BackendError as err:
                return host, None, err
        with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(hosts)))) as pool:
            return list(pool.map(one, hosts))

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        """Run a short command (built per host) on every host in parallel."""
        return [HostResult(*r) for r in self._each(lambda h: self._exec(h, command(h), timeout), hosts)]

    def _exec(self, host: HostSpec, command: str, timeout: float = 30, stdin: str = "") -> tuple[int, str]:
        """Run a short command (no pty); (exit status, stdout+stderr).

        A bare channel rather than Fabric's `run`: its runner polls with sleeps that cost ~0.3 s a
        command, which every pre-flight check and kill would pay.
        """
        conn = self.connect(host)
        try:
            channel = conn.transport.open_session(timeout=timeout)
            channel.settimeout(timeout)
            channel.set_combine_stderr(True)
            channel.exec_command(command)
            if stdin:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            chunks = []
            while data := channel.recv(65536):
                chunks.append(data)
            return channel.recv_exit_status(), b"".join(chunks).decode("utf-8", "replace")
        except (socket.timeout, TimeoutError):
            raise BackendError(f"{host.label}: command did not finish within {timeout}s: {command[:80]}") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise BackendError(f"{host.label}: SSH command failed: {err}") from None

    # ------------------------------------------------------------------ the contract

    def port_free(self, addr: str, port: int) -> bool:
        host = next((h for h in self.spec.hosts if h.addr == addr), self.spec.hosts[0])
        try:
            code, _ = self._exec(host, f"{word(host_python(self.spec, host))} -c {word(port_probe(port))}")
        except BackendError:
            return True  # unreachable: `run` reports every host's connection problem
        return code == 0

    def launch(self, request: ShellRequest, lines: StageLines, stop: StopEvent) -> StageResult:
        plan = request.plan
        hosts = [n.host for n in plan.nodes if n.host is not None]
        for host in hosts:
            lines.state(host.label, f"connecting ({plan.stage})")
        opened = self._each(lambda h: self._open(h, request), hosts)
        bad = {rank: str(err) for rank, (_, _, err) in enumerate(opened) if err is not None}
        if bad:
            for rank, detail in bad.items():
                lines.note(f"{plan.nodes[rank].host_label}: {detail}")
                lines.state(plan.nodes[rank].host_label, "unreachable")
            for _, session, _ in opened:
                if session is not None:
                    session[0].close()  # its shell hangs up before it reads "go": nothing started
            lines.note("not starting: every host must be reachable")
            return unstarted(plan, UNREACHABLE, bad)
        channels = []
        for (_, session, _), node in zip(opened, plan.nodes):
            assert session is not None
            channel, early = session
            for line in early:  # what the host's rc files printed
                lines.emit(node.node_rank, node.host_label, line)
            channel.sendall(b"go\n")
            channels.append(channel)
        stage = SshStage(plan, channels, lines, self._term,
                         lambda lost: self._reap_all([h for i, h in enumerate(hosts) if i not in lost], plan.run_id,
                                                     [hosts[i] for i in lost]),
                         lambda node: unanswered(hosts[node].addr, hosts[node].port or self.spec.ssh.port))
        return follow(stage, plan, lines, stop, detect=self.spec.recovery.detect_timeout,
                      stop_grace=self.spec.job.stop_grace)

    def down(self, record: RunRecord) -> list[str]:
        lines = []
        for host, left, err in self._each(lambda h: self._reap(h, record.run_id, term_pid_files=True)):
            lines.append(f"{host.label}: {err}" if err else f"{host.label}: {left}")
        self.close()
        return lines

    # ------------------------------------------------------------------ steps

    def _open(self, host: HostSpec, request: ShellRequest) -> tuple[paramiko.Channel, list[str]]:
        """The node's one session, up to the moment torchrun would start (session.py), then the
        spec's `sync` paths. One session per node per stage: each costs the host a login shell
        and its rc files (~0.15 CPU-s here, more on real hosts with conda or modules).

        Returns:
            (the channel, the lines the host printed so far: rc-file noise).
        """
        (node,) = [n for n in request.plan.nodes if n.host == host]
        conn = self.connect(host)
        command, bundle, nonce = session_command(request, node)
        channel = None
        try:
            channel = conn.transport.open_session(timeout=OPEN_TIMEOUT)
            channel.get_pty(width=500)
            channel.exec_command(command)
            early = await_marker(channel, f"{nonce} listening", OPEN_TIMEOUT)
            channel.sendall(bundle.encode())
            early += await_marker(channel, f"{nonce} ready", OPEN_TIMEOUT)
            channel.settimeout(None)  # from here on the readers block until the node ends
        except NoMarker as err:
            assert channel is not None
            channel.close()
            raise BackendError(f"{host.label}: cannot prepare the run directory, upload the run's files or "
                               f"enter workdir {node.workdir}: {err}") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            if channel is not None:
                channel.close()
            raise BackendError(f"{host.label}: SSH session failed: {err}") from None
        if self.spec.sync and host.label not in self._synced:
            self._sync(conn, channel, host, node.workdir)
        return channel, early

    def _sync(self, conn: Connection, channel: paramiko.Channel, host: HostSpec, workdir: str) -> None:
        try:
            sync(conn.sftp(), self.spec, workdir)
        except paramiko.SFTPError as err:
            channel.close()
            raise BackendError(f"{host.label}: sync over SFTP failed ({err}): the remote login shell "
                               "prints to stdout (~/.bashrc); make it quiet for non-interactive shells, "
                               "e.g. `[[ $- == *i* ]] || return` at its top") from None
        except (OSError, paramiko.SSHException) as err:
            channel.close()
            raise BackendError(f"{host.label}: sync failed: {err}") from None
        self._synced.add(host.label)

    def _term(self, nodes: list[NodeCommand]) -> set[int]:
        """SIGTERM every still-running node's torchrun (it stops its workers).

        Returns:
            Node ranks without a pid file: their shell never reached `exec torchrun`.
        """
        def term(node: NodeCommand) -> Optional[int]:
            assert node.host is not None
            tag = word(f"^DDPLAUNCH_RUN_ID={node.run_id}$")
            pid = pid_file(node.run_id, node.node_rank)
            # the pid is signalled only if it is ours and carries the run's tag (a stale pid file
            # may name a process that has nothing to do with this run)
            command, nonce = marked(
                f"if [ -f {pid} ]; then p=$(cat {pid}); [ -O /proc/$p ] && "
                f"grep -qz {tag} /proc/$p/environ 2>/dev/null && kill -TERM $p; echo 0; else echo 1; fi")
            try:
                _, out = self._exec(node.host, command, timeout=10)
            except Exception:  # noqa: BLE001 - a dead host: its channel ends on its own
                return None
            return node.node_rank if parse_answer(out, nonce) == 1 else None
        if not nodes:
            return set()
        with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(nodes)))) as pool:
            return {rank for rank in pool.map(term, nodes) if rank is not None}

    def _reap_all(self, hosts: list[HostSpec], run_id: str, lost: list[HostSpec]) -> None:
        """End what is left of the run on `hosts`; drop the connections to the `lost` ones (a later
        stage connects afresh if one comes back)."""
        with self._lock:
            gone = [self._conns.pop(h.label) for h in lost if h.label in self._conns]
        for conn in gone:  # the transport's own thread ends when its socket closes
            threading.Thread(target=conn.close, daemon=True).start()
        self._each(lambda h: self._reap(h, run_id), hosts)

    def _reap(self, host: HostSpec, run_id: str, term_pid_files: bool = False) -> str:
        command, nonce = reaper_command(host_python(self.spec, host), run_id, kill=True,
                                        term_pid_files=term_pid_files, clean=True)
        _, out = self._exec(host, command, timeout=45)
        return describe_reap(parse_answer(out, nonce))


def _connect_error(host: HostSpec, port: int, known: Path, timeout: float, err: BaseException) -> BackendError:
    """What failed when connecting to `host`, and the fix."""
    where = f"{host.label} ({host.addr})"
    if isinstance(err, RevokedHostKeyError):
        return BackendError(f"{where}: {err}", fix=HOST_KEY_FIX)
    if isinstance(err, paramiko.BadHostKeyException):
        return BackendError(
            f"{where}: host key MISMATCH — {known} has a different key ({err.expected_key.get_name()}) "
            f"than the host presented; refusing to connect. If the host was reinstalled, remove its "
            f"old key: ssh-keygen -R {host.addr} -f {known}", fix=HOST_KEY_FIX)
    if isinstance(err, paramiko.SSHException) and "not found in known_hosts" in str(err):
        return BackendError(
            f"{where}: host key unknown — not in {known}; add it after checking it (ssh-keyscan "
            f"{host.addr} >> {known}) or set ssh.host_key_policy: accept-new", fix=HOST_KEY_FIX)
    if isinstance(err, paramiko.SSHException):
        return BackendError(f"{where}: SSH failed: {err}")
    if isinstance(err, (socket.timeout, TimeoutError)):
        return BackendError(f"{host.label} ({host.addr}:{port}): no answer within "
                            f"ssh.connect_timeout={timeout}s (host down or unreachable)")
    assert isinstance(err, OSError)
    return BackendError(f"{host.label} ({host.addr}:{port}): cannot connect: {err.strerror or err} "
                        "(is sshd running?)")
