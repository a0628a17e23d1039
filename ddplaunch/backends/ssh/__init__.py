"""SSH backend: one torchrun per host over Fabric connections, in parallel, with fail-fast.

Each host is reached as the user's ssh config says (routes.py: aliases, User, Port,
IdentityFile, ProxyJump, ProxyCommand; the spec's values win), over one connection per host and
one per jump host (connect.py), every host key verified. Each node's stage runs in its own session
with a pty (session.py), so a dropped connection (even a SIGKILLed ddplaunch) HUPs the remote
torchrun. backends/failfast.py follows the started stage; stopping a node is explicit: SIGTERM to the
recorded torchrun pid, then the run's tag finds leftovers. Where a host's name is an alias only the
launcher knows, the rendezvous uses its address (`HostSpec.reach`): the config's HostName, or
what the host's own sshd saw the connection arrive on.
"""

from __future__ import annotations

import functools
import socket
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional, TypeVar

import paramiko
from fabric import Connection

from ddplaunch.backends.contract import Admitted, CommandFor, HostResult, RunContext, StartGate, StopEvent
from ddplaunch.backends.failfast import NoAnswer, follow, unstarted
from ddplaunch.backends.shell import (ShellLauncher, ShellRequest, describe_reap, free_checkpoints_command,
                                      pid_file, reaper_command, runtime_of)
from ddplaunch.backends.ssh.connect import Connector
from ddplaunch.backends.ssh.lease import Fence, Renewals, renew
from ddplaunch.backends.ssh.routes import Route, is_ip, needs_asking, reach_addr, resolve_routes
from ddplaunch.backends.ssh.session import (NoMarker, SshStage, await_marker, go_line, run_to_end, session_command,
                                           split_check)
from ddplaunch.backends.ssh.sync import sync
from ddplaunch.errors import BackendError
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.hostprogram import marked, parse_answer, port_probe
from ddplaunch.plan.launch import NodeCommand, master_addr, tool_python
from ddplaunch.plan.shellword import word
from ddplaunch.record.results import UNREACHABLE, NodeState, StageResult
from ddplaunch.record.runs import RunRecord
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: Most hosts connected to, probed or started at once (threads; each SSH session costs ~1 thread).
MAX_PARALLEL = 64
#: How long a node's session may take to say it listens, then to take the run's files.
OPEN_TIMEOUT = 30.0
#: Peers asked at once whether they reach a silent host, and how long each waits for its sshd.
PEERS = 2
PEER_PROBE_S = 0.5
T = TypeVar("T")


class SshBackend(ShellLauncher):
    """Runs a plan on every host of an `ssh` spec."""

    name = "ssh"
    max_parallel = MAX_PARALLEL

    def __init__(self, spec: ClusterSpec, run: Optional[RunContext] = None):
        super().__init__(spec)
        self.routes = resolve_routes(spec, [*spec.hosts, *super().spares()])
        self.connector = Connector(spec, self.routes)
        self._synced: set[str] = set()
        #: the run whose checkpoints `close` frees from the hosts' RAM: set once this backend
        #: launched a stage of a spec with a `checkpoint:` section (None: none, or freed already)
        self._ckpt_run: Optional[str] = None
        #: Lost hosts asked to end the run's processes until they answer (or their lease ran out).
        self.fence = Fence(spec.supervisor.lease + spec.job.stop_grace + 30)

    # ------------------------------------------------------------------ connections

    def connect(self, host: HostSpec) -> Connection:
        """An open, host-key-verified connection to `host` along its route (cached).

        Raises:
            BackendError: unreachable (or its jump host is), refused, auth failed or host key not
                trusted — the message names the host (or the jump host) and the fix.
        """
        return self.connector.connect(host.label)

    def close(self) -> None:
        """The run is over: its checkpoints are freed from the RAM of every host still connected
        (with a `checkpoint:` section; `down` frees them on every host in any case)."""
        if self._ckpt_run is not None:
            self._free_checkpoints(self._ckpt_run)
        self.fence.close()
        self.connector.close()

    def _free_checkpoints(self, run_id: str) -> None:
        """One reaper round on the connected hosts that only frees the run's checkpoint RAM, and
        only where nothing of the run is left (a lost host's RAM went with it, or `down` frees it)."""
        self._ckpt_run = None
        live = self.connector.connected()
        hosts = [h for h in [*self.spec.hosts, *super().spares()] if h.label in live]

        def free(host: HostSpec) -> None:
            python = tool_python(self.spec, host)
            command, _ = free_checkpoints_command(python, [(run_id, self.spec.checkpoint_durable())])
            self._exec(host, command, timeout=20)
        if hosts:
            self._each(free, hosts)

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        return self._reachable(list(self.spec.hosts), allocate)

    def spares(self) -> list[HostSpec]:
        return self._reachable(super().spares(), allocate=True)

    def _reachable(self, hosts: list[HostSpec], allocate: bool) -> list[HostSpec]:
        """`hosts`, each with the address the others reach it by where its name is an alias only
        the launcher knows (routes.reach_addr); one whose config names no address is asked at
        launch (what its sshd saw the connection arrive on), marked in a dry run."""
        out = []
        answers: dict[str, Optional[str]] = {}
        if allocate:  # an unreachable host stays unasked: the pre-flight names it
            ask = [h for h in hosts if needs_asking(h, self.routes[h.label])]
            answers = {h.label: value for h, value, _ in self._each(self._own_addr, ask)}
        for h in hosts:
            route = self.routes[h.label]
            reach = reach_addr(h, route)
            if needs_asking(h, route):  # unanswered: its HostName (the pre-flight names the host)
                unknown = route.hostname if allocate else f"<{h.label}'s address, asked at launch>"
                reach = answers.get(h.label) or unknown
            out.append(h.model_copy(update={"reach": reach}) if reach else h)
        return out

    def _own_addr(self, host: HostSpec) -> Optional[str]:
        """The address `host`'s sshd took the connection on (SSH_CONNECTION's third field)."""
        command, nonce = marked('set -- $SSH_CONNECTION; echo "\\"$3\\""')  # a JSON string
        _, out = self._exec(host, command, timeout=self.spec.ssh.connect_timeout)
        answer = parse_answer(out, nonce)
        return answer if isinstance(answer, str) and is_ip(answer) else None

    def allocation_text(self) -> str:
        """How each host is reached and where the rendezvous is, for the dry run and `validate`."""
        lines = ["# connections (spec, then ~/.ssh/config, then OpenSSH's defaults):"]
        for label, route in self.routes.items():
            lines.append(f"#   {label}: {route.describe()}")
        hosts = self.hosts(allocate=False)
        if hosts:
            master = master_addr(self.spec.model_copy(update={"hosts": hosts}))
            why = _master_why(self.spec, hosts[0], self.routes[hosts[0].label])
            lines.append(f"# master address: {master} ({why})")
        return "\n".join(lines) + "\n"

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

    def reach(self, hosts: list[HostSpec], timeout: float = 30) -> list[HostResult]:
        """Connect to every host in parallel (connections are cached: the probe reuses them)."""
        def connected(host: HostSpec) -> tuple[int, str]:
            self.connect(host)
            return 0, ""
        return [HostResult(*r) for r in self._each(connected, hosts)]

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
            status, out = run_to_end(channel, stdin)
            assert status is not None  # waited for as long as it takes
            return status, out
        except (socket.timeout, TimeoutError):
            raise BackendError(f"{host.label}: command did not finish within {timeout}s: {command[:80]}") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise BackendError(f"{host.label}: SSH command failed: {err}") from None

    # ------------------------------------------------------------------ the contract

    def port_free(self, addr: str, port: int) -> bool:
        # a spare too: after the master was lost the new master is one (asking the dead master
        # cost the connect timeout and checked nothing); an address no host has is the first host's
        known = [*self.spec.hosts, *super().spares()]
        host = next((h for h in known if addr in (h.addr, h.reach)), self.spec.hosts[0])
        try:
            code, _ = self._exec(host, f"{word(tool_python(self.spec, host))} -c {word(port_probe(port))}")
        except BackendError:
            return True  # unreachable: `run` reports every host's connection problem
        return code == 0

    def launch(self, request: ShellRequest, lines: StageLines, stop: StopEvent) -> StageResult:
        result = self.launch_gated(request, lines, stop, None)
        assert result is not None  # no gate to say no
        return result

    def launch_gated(self, request: ShellRequest, lines: StageLines, stop: StopEvent,
                     gate: Optional[StartGate]) -> Optional[StageResult]:
        """`launch`; with a `gate`, its check runs in each node's session once the node's files
        are there, and the stage starts only when it admits every node's answer (None: it did
        not, every session ended before anything started)."""
        plan = request.plan
        if self.spec.checkpoint is not None:
            self._ckpt_run = plan.run_id
        hosts = [n.host for n in plan.nodes if n.host is not None]
        for host in hosts:
            lines.state(host.label, NodeState.NOT_STARTED)
        checks: dict[str, tuple[int, str]] = {}
        opened = self._each(lambda h: self._open(h, request, gate, checks), hosts)
        sessions = [session[0] for _, session, _ in opened if session is not None]
        bad = {rank: err for rank, (_, _, err) in enumerate(opened) if err is not None}
        admitted = Admitted()
        if gate is not None:
            said = gate.admit(checks, {plan.nodes[rank].host_label: err for rank, err in bad.items()})
            if said is None:
                for channel in sessions:
                    channel.close()  # its shell hangs up before it reads "go": nothing started
                return None
            admitted = said
        if bad:
            for rank, err in bad.items():
                lines.note(f"{plan.nodes[rank].host_label}: {err}")
                lines.state(plan.nodes[rank].host_label, NodeState.UNREACHABLE)
            for channel in sessions:
                channel.close()
            lines.note("not starting: every host must be reachable")
            return unstarted(plan, UNREACHABLE, {rank: str(err) for rank, err in bad.items()})
        channels = []
        for (_, session, _), node in zip(opened, plan.nodes):
            assert session is not None
            channel, early = session
            for line in early:  # what the host's rc files printed
                lines.emit(node.node_rank, node.host_label, line)
            channel.sendall(go_line(admitted.socket_ifname))
            channels.append(channel)
        stage = SshStage(plan, channels, lines, self._term,
                         lambda lost, now: self._reap_all([h for i, h in enumerate(hosts) if i not in lost],
                                                          plan.run_id, [hosts[i] for i in lost], now),
                         lambda node: self._unanswered(hosts, node))
        with Renewals(self.spec.supervisor.lease, lambda: renew(channels)):
            return follow(stage, plan, lines, stop, detect=self.spec.recovery.detect_timeout,
                          stop_grace=self.spec.job.stop_grace)

    def _unanswered(self, hosts: list[HostSpec], node: int) -> Optional[str]:
        """Why node's host does not answer (None: it does): this machine's probe and, at the same
        time, up to two other hosts' of the stage (a peer asks the host's sshd). A host a peer
        reaches is not lost: this machine's path to it broke, and its ranks still reach each other.
        Peers that answer and cannot reach the host either decide once every peer has answered
        (this machine's own probe may wait longer: a launcher far from the cluster); when no peer
        answers this machine, the failure is this machine's own (`local`)."""
        target = hosts[node]
        peers = [h for i, h in enumerate(hosts) if i != node][:PEERS]
        pool = ThreadPoolExecutor(max_workers=1 + len(peers))
        try:
            mine = pool.submit(self.connector.unanswered, target.label)
            theirs = {pool.submit(self._peer_reaches, peer, target): peer for peer in peers}
            pending: set[Future[Any]] = {mine, *theirs}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                if mine in done and mine.result() is None or any(f.result() for f in done if f in theirs):
                    return None
                told = [peer for f, peer in theirs.items() if f.done() and f.result() is False]
                if told and all(f.done() for f in theirs):  # no peer left to say otherwise
                    route = self.routes[target.label]
                    return NoAnswer(f"{route.hostname}:{route.port} answers neither this machine nor "
                                    f"{', '.join(p.label for p in told)}")
            why = mine.result()
            if peers and self._askable(target):
                return NoAnswer(f"{why}, and neither could {', '.join(p.label for p in peers)} be asked", local=True)
            return why
        finally:
            pool.shutdown(wait=False)

    def _askable(self, target: HostSpec) -> bool:
        """Whether a peer can try `target`'s sshd itself (not behind a jump host or a ProxyCommand)."""
        route = self.routes[target.label]
        return route.jump is None and route.proxy_command is None

    def _peer_reaches(self, peer: HostSpec, target: HostSpec) -> Optional[bool]:
        """Whether `peer` can open a TCP connection to `target`'s sshd; None when it cannot say (a
        target behind a jump host or a ProxyCommand, or a peer that does not answer itself)."""
        if not self._askable(target):
            return None
        route = self.routes[target.label]
        probe = (f"import socket; socket.create_connection(({route.hostname!r}, {route.port}), {PEER_PROBE_S}).close(); "
                 "print('DDPLAUNCH_PEER_REACHES')")
        try:
            code, out = self._exec(peer, f"{word(tool_python(self.spec, peer))} -c {word(probe)}",
                                   timeout=PEER_PROBE_S + 1.5)
        except BackendError:
            return None
        return code == 0 and "DDPLAUNCH_PEER_REACHES" in out

    def lease(self) -> Optional[tuple[int, int]]:
        return int(self.spec.supervisor.lease), int(self.spec.job.stop_grace) + 5

    def down(self, record: RunRecord) -> list[str]:
        """Every host the run could have used, its spares too (one may have replaced a lost host)."""
        lines = []
        self._ckpt_run = None  # freed below, with the rest of the run
        for host, left, err in self._each(lambda h: self._reap(h, record.run_id, term_pid_files=True,
                                                               free_checkpoints=True),
                                          [*self.spec.hosts, *super().spares()]):
            lines.append(f"{host.label}: {err}" if err else f"{host.label}: {left}")
        self.close()
        return lines

    # ------------------------------------------------------------------ steps

    def _open(self, host: HostSpec, request: ShellRequest, gate: Optional[StartGate] = None,
              checks: Optional[dict[str, tuple[int, str]]] = None) -> tuple[paramiko.Channel, list[str]]:
        """The node's one session, up to the moment torchrun would start (session.py), then the
        spec's `sync` paths. One session per node per stage: each costs the host a login shell
        and its rc files (~0.15 CPU-s here, more on real hosts with conda or modules). A `gate`'s
        check runs in it; its (exit status, output) goes to `checks`.

        Returns:
            (the channel, the lines the host printed so far: rc-file noise).
        """
        (node,) = [n for n in request.plan.nodes if n.host == host]
        conn = self.connect(host)
        command, bundle, nonce = session_command(request, node, gate.command(host) if gate is not None else None)
        channel = None

        def checked(said: list[str]) -> list[str]:  # the check's answer, wherever the shell stopped
            check, rest = split_check(said, nonce)
            if check is not None and checks is not None:
                checks[host.label] = check
            return rest
        try:
            channel = conn.transport.open_session(timeout=OPEN_TIMEOUT)
            channel.get_pty(width=500)
            channel.exec_command(command)
            early = await_marker(channel, f"{nonce} listening", OPEN_TIMEOUT)
            channel.sendall(bundle.encode())
            early += checked(await_marker(channel, f"{nonce} ready",
                                          OPEN_TIMEOUT + (gate.timeout if gate is not None else 0)))
            channel.settimeout(None)  # from here on the readers block until the node ends
        except NoMarker as err:
            assert channel is not None
            channel.close()
            checked(err.lines)
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

    def _reap_all(self, hosts: list[HostSpec], run_id: str, lost: list[HostSpec], now: bool = False) -> None:
        """End what is left of the run on `hosts` (`now`: SIGKILL at once: they had their SIGTERM);
        drop the connections to the `lost` ones (a later stage connects afresh if one comes back)."""
        self.connector.drop([h.label for h in lost])
        for host in lost:
            self.fence.add(host.label, functools.partial(self._reap, host, run_id))
        self._each(lambda h: self._reap(h, run_id, now=now), hosts)

    def _reap(self, host: HostSpec, run_id: str, term_pid_files: bool = False, now: bool = False,
              free_checkpoints: bool = False) -> str:
        command, nonce = reaper_command(tool_python(self.spec, host), run_id, kill=True, term_pid_files=term_pid_files,
                                        clean=True, containers=runtime_of(self.spec), now=now,
                                        free_checkpoints=free_checkpoints, durable=self.spec.checkpoint_durable())
        _, out = self._exec(host, command, timeout=45)
        return describe_reap(parse_answer(out, nonce))


def _master_why(spec: ClusterSpec, first: HostSpec, route: Route) -> str:
    """Why the master address is what it is, for the dry run."""
    if spec.master.addr:
        return "master.addr"
    if reach_addr(first, route):
        return f"{first.label}'s HostName in your ssh config"
    if needs_asking(first, route):
        return f"{first.label} is an alias of your ssh config for a name the hosts may not know: its own sshd says"
    return f"the first host, {first.label}"
