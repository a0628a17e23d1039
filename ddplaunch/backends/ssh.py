"""SSH backend: one torchrun per host over Fabric connections, in parallel, with fail-fast.

Fabric makes and configures the connections (one per host per run); each node's command runs in
its own channel with a pty, so a dropped connection (even a SIGKILLed ddplaunch) HUPs the remote
torchrun. Host keys are verified against known_hosts (Fabric would accept any key). The node's
environment goes over the channel's stdin into a 0600 file, never onto a command line. Stopping
a node is explicit: SIGTERM to the recorded torchrun pid, then the run's tag finds leftovers.
"""

from __future__ import annotations

import base64
import contextlib
import secrets
import shlex
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, TypeVar

import paramiko
from fabric import Connection

from ddplaunch.backends.contract import CommandFor, HostResult
from ddplaunch.backends.known_hosts import RevokedHostKeyError, configure
from ddplaunch.backends.shell import SHUTDOWN_GRACE, ShellBackend, ShellRequest, describe_reap, reaper_command
from ddplaunch.console import LineSink
from ddplaunch.errors import BackendError
from ddplaunch.hostcmd import marked, parse_answer, port_probe
from ddplaunch.plan import LaunchPlan, NodeCommand, host_python, host_run_dir, quote
from ddplaunch.results import (FAILED, INTERRUPTED, LOST, RUNNING, UNREACHABLE, NodeOutcome, StageResult,
                               stop_cause)
from ddplaunch.spec import ClusterSpec, HostSpec
from ddplaunch.outcomes import finish_outcome

#: Most hosts connected to, probed or started at once (threads; each SSH session costs ~1 thread).
MAX_PARALLEL = 64
#: The pre-flight's fix for a host whose key is unknown, changed or revoked (never "check the host is up").
HOST_KEY_FIX = ("verify the host's key out of band, then fix ssh.known_hosts as the message says "
                "(ssh.host_key_policy: accept-new only adds keys of hosts not yet known)")
#: How long a node's session may take to say it listens, then to take the run's files.
OPEN_TIMEOUT = 30.0
#: After a node failed, how long the others may report their own failure before they are stopped.
REPORT_GRACE = 2.0
T = TypeVar("T")


class SshBackend(ShellBackend):
    """Runs a plan on every host of an `ssh` spec."""

    name = "ssh"
    max_parallel = MAX_PARALLEL

    def __init__(self, spec: ClusterSpec):
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
        kwargs = {"timeout": ssh.connect_timeout, "banner_timeout": ssh.connect_timeout,
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
        except RevokedHostKeyError as err:
            raise BackendError(f"{host.label} ({host.addr}): {err}", fix=HOST_KEY_FIX) from None
        except paramiko.BadHostKeyException as err:
            raise BackendError(
                f"{host.label} ({host.addr}): host key MISMATCH — {known} has a different key "
                f"({err.expected_key.get_name()}) than the host presented; refusing to connect. If the "
                f"host was reinstalled, remove its old key: ssh-keygen -R {host.addr} -f {known}",
                fix=HOST_KEY_FIX) from None
        except paramiko.SSHException as err:
            if "not found in known_hosts" in str(err):
                raise BackendError(
                    f"{host.label} ({host.addr}): host key unknown — not in {known}; add it after "
                    f"checking it (ssh-keyscan {host.addr} >> {known}) or set ssh.host_key_policy: "
                    "accept-new", fix=HOST_KEY_FIX) from None
            raise BackendError(f"{host.label} ({host.addr}): SSH failed: {err}") from None
        except (socket.timeout, TimeoutError):
            raise BackendError(f"{host.label} ({host.addr}:{conn.port}): no answer within "
                               f"ssh.connect_timeout={ssh.connect_timeout}s (host down or unreachable)") from None
        except OSError as err:
            raise BackendError(f"{host.label} ({host.addr}:{conn.port}): cannot connect: "
                               f"{err.strerror or err} (is sshd running?)") from None
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
        return self._each(lambda h: self._exec(h, command(h), timeout), hosts)

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
            code, _ = self._exec(host, f"{quote(host_python(self.spec, host))} -c {quote(port_probe(port))}")
        except BackendError:
            return True  # unreachable: `run` reports every host's connection problem
        return code == 0

    def launch(self, request: ShellRequest, sink: LineSink, stop: threading.Event) -> StageResult:
        plan = request.plan
        outcomes = [NodeOutcome(node_rank=n.node_rank, host=n.host.label) for n in plan.nodes]
        result = StageResult(stage=plan.stage, outcomes=outcomes)
        plan_hosts = [n.host for n in plan.nodes if n.host is not None]
        for host in plan_hosts:
            sink.state(host.label, f"connecting ({plan.stage})")
        opened = self._each(lambda h: self._open(h, plan), plan_hosts)
        for (host, _, err), outcome in zip(opened, outcomes):
            if err is not None:
                outcome.state, outcome.detail, outcome.ended_at = UNREACHABLE, str(err), time.time()
                sink.note(f"{host.label}: {err}")
                sink.state(host.label, "unreachable")
        if any(o.state == UNREACHABLE for o in outcomes):
            for _, session, _ in opened:
                if session is not None:
                    session[0].close()  # its shell hangs up before it reads "go": nothing started
            sink.note("not starting: every host must be reachable")
            result.ended_at = time.time()
            return result
        channels = [session[0] for _, session, _ in opened if session is not None]
        for (_, (channel, early), _), node in zip(opened, plan.nodes):
            for line in early:  # what the host's rc files printed
                sink.emit(node.node_rank, node.host.label, line)
            channel.sendall(b"go\n")
        for outcome in outcomes:
            outcome.state = RUNNING
            sink.state(outcome.host, f"running {plan.stage}")
        readers = [threading.Thread(target=_pump, args=(ch, sink, n.node_rank, n.host.label), daemon=True)
                   for ch, n in zip(channels, plan.nodes)]
        for r in readers:
            r.start()
        done: dict[int, Optional[int]] = {}
        stopping, failed_at = False, None
        while len(done) < len(channels):
            for node, ch in zip(plan.nodes, channels):
                if node.node_rank not in done and (ch.exit_status_ready() or ch.closed
                                                   or not ch.get_transport().is_active()):
                    done[node.node_rank] = _exit_status(ch)
                    outcome = outcomes[node.node_rank]
                    if done[node.node_rank] is None and not stopping:
                        outcome.state, outcome.detail = LOST, "SSH connection lost"
                    if done[node.node_rank] != 0 and failed_at is None:
                        failed_at = time.time()
                        cause = f"{node.host.label} (node {node.node_rank}) " + (
                            "lost its connection" if done[node.node_rank] is None
                            else f"exited with {done[node.node_rank]}")
                        sink.note(f"{cause}: stopping every other host")
            # the others get a moment to report a failure of their own (a rank that failed at the
            # same time is then told apart from one that only saw its peer die); then they stop
            if failed_at is not None and not stopping and (time.time() - failed_at >= REPORT_GRACE
                                                            or len(done) == len(channels)):
                stopping = True
            if not stopping and stop.is_set():
                stopping = True
                result.interrupted = stop_cause(stop) is None
                cause = stop_cause(stop) or "interrupted by the user"
                sink.note(f"{cause}: stopping every host")
            if stopping:
                sink.mute({n.node_rank for n in plan.nodes if n.node_rank not in done})
                for node in plan.nodes:
                    if node.node_rank not in done and outcomes[node.node_rank].state == RUNNING:
                        outcomes[node.node_rank].state = INTERRUPTED
                        outcomes[node.node_rank].detail = f"stopped by ddplaunch: {cause}"
                for rank in self._stop_all([n for n in plan.nodes if n.node_rank not in done]):
                    # no pid file: its setup lines are still running; hanging up the pty ends them
                    channels[rank].close()
                    outcomes[rank].state, outcomes[rank].never_started = FAILED, True
                    ran = time.time() - result.started_at
                    outcomes[rank].detail = f"its setup lines were still running {ran:.0f}s after the launch"
                    sink.note(f"{outcomes[rank].host} (node {rank}): torchrun never started (blocked before launch)")
                stopping_deadline = time.time() + SHUTDOWN_GRACE + 5
                while len(done) < len(channels) and time.time() < stopping_deadline:
                    for node, ch in zip(plan.nodes, channels):
                        if node.node_rank not in done and (ch.exit_status_ready() or ch.closed):
                            done[node.node_rank] = _exit_status(ch)
                    time.sleep(0.1)
                break
            time.sleep(0.1)
        for r in readers:
            r.join(timeout=5)
        for node, ch in zip(plan.nodes, channels):
            ch.close()
            outcome = outcomes[node.node_rank]
            finish_outcome(outcome, sink, None if outcome.never_started else done.get(node.node_rank))
        self._each(lambda h: self._reap(h, plan.run_id), plan_hosts)
        result.ended_at = time.time()
        return result

    def down(self, record: dict) -> list[str]:
        run_id = record["run_id"]
        lines = []
        for host, left, err in self._each(lambda h: self._reap(h, run_id, term_pid_files=True)):
            lines.append(f"{host.label}: {err}" if err else f"{host.label}: {left}")
        self.close()
        return lines

    # ------------------------------------------------------------------ steps

    def _open(self, host: HostSpec, plan: LaunchPlan) -> tuple[paramiko.Channel, list[str]]:
        """The node's one session, up to the moment torchrun would start: its shell made the run
        dir, wrote the env file and the uploads from what this sends it and entered workdir, and
        now waits for a "go" line (sent once every node got this far). One session per node per
        stage: each costs the host a login shell and its rc files (~0.15 CPU-s here, more on
        real hosts with conda or modules). Then the spec's `sync` paths.

        Returns:
            (the channel, the lines the host printed so far: rc-file noise).
        """
        (node,) = [n for n in plan.nodes if n.host == host]
        conn = self.connect(host)
        command, bundle, nonce = _session_command(plan, node)
        channel = None
        try:
            channel = conn.transport.open_session(timeout=OPEN_TIMEOUT)
            channel.get_pty(width=500)
            channel.exec_command(command)
            early = _await_marker(channel, f"{nonce} listening", OPEN_TIMEOUT)
            channel.sendall(bundle.encode())
            early += _await_marker(channel, f"{nonce} ready", OPEN_TIMEOUT)
            channel.settimeout(None)  # from here on the readers block until the node ends
        except _NoMarker as err:
            channel.close()
            raise BackendError(f"{host.label}: cannot prepare the run directory, upload the run's files or "
                               f"enter workdir {node.workdir}: {err}") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            if channel is not None:
                channel.close()
            raise BackendError(f"{host.label}: SSH session failed: {err}") from None
        if self.spec.sync and host.label not in self._synced:
            try:
                _sync(conn.sftp(), self.spec, node.workdir)
            except paramiko.SFTPError as err:
                channel.close()
                raise BackendError(f"{host.label}: sync over SFTP failed ({err}): the remote login shell "
                                   "prints to stdout (~/.bashrc); make it quiet for non-interactive shells, "
                                   "e.g. `[[ $- == *i* ]] || return` at its top") from None
            except (OSError, paramiko.SSHException) as err:
                channel.close()
                raise BackendError(f"{host.label}: sync failed: {err}") from None
            self._synced.add(host.label)
        return channel, early

    def _stop_all(self, nodes: list[NodeCommand]) -> list[int]:
        """SIGTERM every still-running node's torchrun (it stops its workers).

        Returns:
            Node ranks without a pid file: their shell never reached `exec torchrun`.
        """
        def term(node: NodeCommand) -> Optional[int]:
            assert node.host is not None
            tag = quote(f"^DDPLAUNCH_RUN_ID={node.env_dict()['DDPLAUNCH_RUN_ID']}$")
            # the pid is signalled only if it is ours and carries the run's tag (a stale pid file
            # may name a process that has nothing to do with this run)
            command, nonce = marked(
                f"if [ -f {node.pid_file} ]; then p=$(cat {node.pid_file}); [ -O /proc/$p ] && "
                f"grep -qz {tag} /proc/$p/environ 2>/dev/null && kill -TERM $p; echo 0; else echo 1; fi")
            try:
                _, out = self._exec(node.host, command, timeout=10)
            except Exception:  # noqa: BLE001 - a dead host: its channel ends on its own
                return None
            return node.node_rank if parse_answer(out, nonce) == 1 else None
        if not nodes:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(nodes)))) as pool:
            return [rank for rank in pool.map(term, nodes) if rank is not None]

    def _reap(self, host: HostSpec, run_id: str, term_pid_files: bool = False) -> str:
        command, nonce = reaper_command(host_python(self.spec, host), run_id, kill=True,
                                        term_pid_files=term_pid_files)
        _, out = self._exec(host, command, timeout=45)
        return describe_reap(parse_answer(out, nonce))


def _session_command(plan: LaunchPlan, node: NodeCommand) -> tuple[str, str, str]:
    """(the node's command, what to send it once it says it listens, the nonce of its markers).

    The shell turns the pty's echo and line editing off (no line-length limit, nothing echoed
    back), says it listens, reads one base64 line per file into files that are 0600 from the
    start (the environment, secrets included, and the uploads: never on a command line, and not
    over SFTP, which a login shell that prints breaks), renames each into place whole, drops a
    pid file an earlier stage left (it would hide a torchrun that never starts in this one),
    enters workdir, says it is ready and waits for "go"; then it runs the node's line. Any step
    failing ends the shell before torchrun, with the reason on the channel.
    """
    nonce = secrets.token_hex(6)
    run_dir = host_run_dir(plan.run_id)
    files = [(str(node.env_file), node.env_text().encode())]
    files += [(f"{run_dir}/{quote(dst)}", Path(src).read_bytes()) for src, dst in plan.uploads]
    steps = [f"mkdir -p {run_dir}", f"rm -f {node.pid_file}"]
    steps += [f'IFS= read -r b && printf %s "$b" | base64 -d > {dst}.tmp && mv {dst}.tmp {dst}' for dst, _ in files]
    script = (f"stty -echo -icanon && echo {nonce} listening && (umask 077 && " + " && ".join(steps)
              + f") && cd {quote(node.workdir)} && echo {nonce} ready && IFS= read -r go && "
              f'[ "$go" = go ] && stty sane && {node.shell_line()}')
    bundle = "".join(base64.b64encode(data).decode() + "\n" for _, data in files)
    return "bash -c " + shlex.quote(script), bundle, nonce


class _NoMarker(Exception):
    """The node's shell ended, or went silent, before it printed the marker."""


def _await_marker(ch: paramiko.Channel, marker: str, timeout: float) -> list[str]:
    """Read the channel up to the line `marker`; the lines before it (what the host's rc files
    printed). Raises _NoMarker with the output's tail if the shell ends or the time runs out."""
    deadline = time.monotonic() + timeout
    data = b""
    want = marker.encode()
    while True:
        lines = data.replace(b"\r", b"").split(b"\n")
        if want in lines[:-1]:
            before = lines[:lines.index(want)]
            return [raw.decode("utf-8", "replace") for raw in before if raw.strip()]
        left = deadline - time.monotonic()
        said = "\n".join(raw.decode("utf-8", "replace") for raw in lines
                         if raw.strip() and not raw.startswith(want.split()[0]))[-300:]
        if left <= 0:
            raise _NoMarker(f"no answer within {timeout:.0f}s: {said}")
        ch.settimeout(left)
        try:
            chunk = ch.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            raise _NoMarker(said or "its shell ended without a word")
        data += chunk


def _exit_status(ch: paramiko.Channel) -> Optional[int]:
    """The remote exit status, or None when the connection died without one."""
    if ch.exit_status_ready():
        status = ch.recv_exit_status()
        return None if status == -1 else status
    return None


def _pump(ch: paramiko.Channel, sink: LineSink, node_rank: int, host: str) -> None:
    """Forward whole lines from a node's channel to the sink until the channel ends."""
    pending = b""
    try:
        while data := ch.recv(65536):
            *lines, pending = (pending + data).split(b"\n")
            for raw in lines:
                sink.emit(node_rank, host, raw.decode("utf-8", "replace"))
    except (OSError, EOFError, paramiko.SSHException):
        pass
    if pending:
        sink.emit(node_rank, host, pending.decode("utf-8", "replace"))


def _sync(sftp: paramiko.SFTPClient, spec: ClusterSpec, workdir: str) -> None:
    """Copy each `sync:` path (relative to the spec's directory) into the host's workdir: a file to
    workdir/NAME, a directory's files to workdir/NAME/..., each with its mode and mtime.

    Each file is written into a private (0700) directory in workdir, then renamed into place: no
    other user can open it while it is written, no rank reads half a file, and where the host
    shares the launcher's file system (workdir holding the very files synced) a file is replaced
    by a copy of itself instead of being truncated before it is read.
    """
    stage = f"{workdir}/.ddplaunch-sync-{secrets.token_hex(8)}"
    sftp.mkdir(stage, 0o700)
    try:
        for entry in spec.sync:
            src = spec.resolve(entry)
            files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
            for path in files:
                rel = Path(entry).name if src.is_file() else Path(Path(entry).name) / path.relative_to(src)
                remote = Path(workdir) / rel
                _mkdirs(sftp, str(remote.parent))
                st = path.stat()
                tmp = f"{stage}/file"
                sftp.put(str(path), tmp)
                sftp.chmod(tmp, stat.S_IMODE(st.st_mode))
                sftp.utime(tmp, (int(st.st_atime), int(st.st_mtime)))
                sftp.posix_rename(tmp, str(remote))
    finally:
        with contextlib.suppress(OSError):
            sftp.remove(f"{stage}/file")
        with contextlib.suppress(OSError):
            sftp.rmdir(stage)


def _mkdirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        p = str(Path(*parts[:i]))
        try:
            sftp.stat(p)
        except OSError:
            sftp.mkdir(p)
