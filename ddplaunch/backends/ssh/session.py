"""One node's SSH session during a stage: the protocol that prepares it, and following it.

A node's stage is one session with a pty. Its shell turns echo and line editing off, says it
listens, takes the run's files as base64 lines on stdin (the environment, secrets included, never
on a command line; not over SFTP, which a login shell that prints breaks), renames each into place
whole, enters workdir, says it is ready and waits for "go" — sent once every node got this far —
then runs the node's line. Every answer is a nonce-marked line, so whatever the host's rc files
print is never mistaken for one. `SshStage` is what backends/failfast.py follows: the channels'
exits, and the node stops the backend does for it.
"""

from __future__ import annotations

import secrets
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import paramiko

from ddplaunch.backends.failfast import LossAware, NodeEnd
from ddplaunch.backends.shell import ShellRequest, env_name, env_text, pid_file, stage_bundle, stage_files
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.launch import LaunchPlan, NodeCommand
from ddplaunch.plan.shellword import IFNAME, word


def session_command(request: ShellRequest, node: NodeCommand, check: Optional[str] = None) -> tuple[str, str, str]:
    """(the node's command, what to send it once it says it listens, the nonce of its markers).

    Any step failing ends the shell before torchrun, with the reason on the channel. A pid file
    an earlier stage left is dropped (it would hide a torchrun that never starts in this one).
    `check` (a start gate's command, e.g. the pre-flight's probe) runs once the files are in
    place, its exit status on the line `<nonce> checked N`. "go" may name the network interface
    the ranks use ("go IFNAME": Gloo's and NCCL's, found by the check); the node's environment
    file, sourced after, keeps the user's own value. After "go" the pty is made sane again but
    for its echo: the lines that renew the node's lease (backends/shell.py `lease_loop`) come in
    on it and must not come back out with the node's output.
    """
    plan = request.plan
    nonce = secrets.token_hex(6)
    names = [env_name(plan.stage, node.node_rank), *(dst for _, dst in plan.uploads)]
    contents = [env_text(node).encode(), *(Path(src).read_bytes() for src, _ in plan.uploads)]
    staged = stage_files(plan.run_id, names, then=[f"rm -f {pid_file(plan.run_id, node.node_rank)}"])
    checked = f'{{ ( {check} ); echo "{nonce} checked $?"; }} && ' if check is not None else ""
    script = (f"stty -echo -icanon && echo {nonce} listening && {staged} && {checked}cd {word(node.workdir)} && "
              f'echo {nonce} ready && IFS=" " read -r go ifname && [ "$go" = go ] && stty sane -echo && '
              f'if [ -n "$ifname" ]; then export GLOO_SOCKET_IFNAME="$ifname" NCCL_SOCKET_IFNAME="$ifname"; fi && '
              f'{request.line(node)}')
    return "bash -c " + shlex.quote(script), stage_bundle(contents), nonce


def go_line(ifname: Optional[str]) -> bytes:
    """What starts a node's stage: "go", with the network interface its ranks use, if one."""
    if not ifname:
        return b"go\n"
    if not IFNAME.fullmatch(ifname):
        raise ValueError(f"not an interface name: {ifname!r}")
    return f"go {ifname}\n".encode()


class NoMarker(Exception):
    """The node's shell ended, or went silent, before it printed the marker; `lines`: what it
    printed until then."""

    def __init__(self, message: str, lines: list[str]):
        super().__init__(message)
        self.lines = lines


def await_marker(ch: paramiko.Channel, marker: str, timeout: float) -> list[str]:
    """Read the channel up to the line `marker`; the lines before it (what the host's rc files
    printed). Raises NoMarker with the output's tail if the shell ends or the time runs out."""
    deadline = time.monotonic() + timeout
    data = b""
    want = marker.encode()
    while True:
        lines = data.replace(b"\r", b"").split(b"\n")
        if want in lines[:-1]:
            before = lines[:lines.index(want)]
            return [raw.decode("utf-8", "replace") for raw in before if raw.strip()]
        left = deadline - time.monotonic()
        read = [raw.decode("utf-8", "replace") for raw in lines if raw.strip()]
        said = "\n".join(line for line in read if not line.startswith(marker.split()[0]))[-300:]
        if left <= 0:
            raise NoMarker(f"no answer within {timeout:.0f}s: {said}", read)
        ch.settimeout(left)
        try:
            chunk = ch.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            raise NoMarker(said or "its shell ended without a word", read)
        data += chunk


def split_check(lines: list[str], nonce: str) -> tuple[Optional[tuple[int, str]], list[str]]:
    """A session's lines up to "ready" -> ((the check's exit status, its output) or None when it
    did not end, the other lines)."""
    mark = f"{nonce} checked "
    at = next((i for i, line in enumerate(lines) if line.startswith(mark)), None)
    if at is None:
        return None, lines
    code = lines[at][len(mark):].strip()
    return (int(code) if code.isdigit() else -1, "\n".join(lines[:at])), lines[at + 1:]


def exit_status(ch: paramiko.Channel) -> Optional[int]:
    """The remote exit status, or None when the connection died without one."""
    if ch.exit_status_ready():
        status = ch.recv_exit_status()
        return None if status == -1 else status
    return None


def run_to_end(ch: paramiko.Channel, stdin: str = "", status_wait: Optional[float] = None
               ) -> tuple[Optional[int], str]:
    """Send `stdin` to a started command, end its input and read its output to the end; (its exit
    status, its output). The status is None when `status_wait` seconds after the output's end
    brought none (without `status_wait`, it is waited for as long as it takes)."""
    if stdin:
        ch.sendall(stdin.encode())
    ch.shutdown_write()
    chunks = []
    while data := ch.recv(65536):
        chunks.append(data)
    status = None if status_wait is not None and not ch.status_event.wait(status_wait) else ch.recv_exit_status()
    return status, b"".join(chunks).decode("utf-8", "replace")


def _pump(ch: paramiko.Channel, lines: StageLines, node_rank: int, host: str) -> None:
    """Forward whole lines from a node's channel until the channel ends."""
    pending = b""
    try:
        while data := ch.recv(65536):
            *whole, pending = (pending + data).split(b"\n")
            for raw in whole:
                lines.emit(node_rank, host, raw.decode("utf-8", "replace"))
    except (OSError, EOFError, paramiko.SSHException):
        pass
    if pending:
        lines.emit(node_rank, host, pending.decode("utf-8", "replace"))


class SshStage(LossAware):
    """Every node's session of a started stage, for backends/failfast.py.

    `term(nodes)` SIGTERMs the nodes' torchruns and returns those without a pid file (their
    shell never got to `exec torchrun`); `reap(lost, now)` ends what is left of the run on every
    host but the lost ones (`now`, after a loss: at once, the survivors had their SIGTERM);
    `unanswered(node)` says why a node's host does not answer (None: it does).
    """

    def __init__(self, plan: LaunchPlan, channels: list[paramiko.Channel], lines: StageLines,
                 term: Callable[[list[NodeCommand]], set[int]], reap: Callable[[set[int], bool], None],
                 unanswered: Callable[[int], Optional[str]]):
        super().__init__(unanswered)
        self.plan, self.channels, self._term, self._reap = plan, channels, term, reap
        self._never: set[int] = set()
        self.readers = [threading.Thread(target=_pump, args=(ch, lines, n.node_rank, n.host_label), daemon=True)
                        for ch, n in zip(channels, plan.nodes)]
        for r in self.readers:
            r.start()

    def _ended(self, node: int) -> Optional[NodeEnd]:
        ch = self.channels[node]
        if not (ch.exit_status_ready() or ch.closed or not ch.get_transport().is_active()):
            return None
        code = exit_status(ch)
        if code is not None:
            return NodeEnd(node, code)
        transport = ch.get_transport()
        if transport is not None and transport.is_active():  # sshd closed it: exit-signal, no status
            return NodeEnd(node, None, how="its session ended by a signal (no exit status)")
        return NodeEnd(node, None, how="SSH connection lost", lost=True)

    def poll(self) -> list[NodeEnd]:
        out = []
        for node in range(len(self.channels)):
            if node not in self._seen and (end := self._ended(node)) is not None:
                self._seen.add(node)
                out.append(end)
        return out

    def stop(self, nodes: list[int]) -> None:
        self._never = self._term([self.plan.nodes[n] for n in nodes])
        for n in self._never:  # its setup lines are still running: hanging up the pty ends them
            self.channels[n].close()

    def settle(self, nodes: set[int], timeout: float) -> list[NodeEnd]:
        deadline = time.time() + timeout
        out: list[NodeEnd] = []
        while time.time() < deadline and not nodes <= self._seen:
            for end in self.poll():
                out.append(end)
            time.sleep(0.1)
        return out

    def never_started(self, nodes: list[int]) -> set[int]:
        return self._never & set(nodes)

    def close(self) -> None:
        # what is left of the run ends first (after a loss at once: the survivors, blocked in a
        # collective with a dead peer, had their SIGTERM), so no reader waits on a node still alive
        self._reap(self._lost, bool(self._lost or self._at_fault))
        for node, (reader, ch) in enumerate(zip(self.readers, self.channels)):
            if node not in self._lost:  # a lost host's channel ends with its connection
                if node not in self._at_fault:  # a frozen node's never ends by itself: the reaper ended it
                    reader.join(timeout=5)
                ch.close()
