"""The run's supervisor on another host (`supervisor.host`, backend ssh): a head or login node
with ddplaunch installed runs the run loop, so the run outlives this machine, its terminal and
its network.

`start_there` hands the run over SSH — the validated spec, the options and the spec's `from_env`
values on the command's stdin, never its command line — to `ddplaunch supervise --stdin --daemon`
there, which forks the supervisor as `up --detach` does here and answers with a nonce-marked
line; this machine keeps a record whose placement names the host (`OnHost`). `attach`, `status`, `logs`, `down` and `top`
of that run run ddplaunch's own command there over SSH and show what it prints: the host is
reached as the run's hosts are (routes, keys, verified host keys), and nothing listens on a port.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import sys
import threading
from typing import IO, Any, Iterator, Optional

import paramiko

from ddplaunch import errors
from ddplaunch.backends.ssh.connect import Connector
from ddplaunch.backends.ssh.routes import resolve_routes
from ddplaunch.backends.ssh.session import run_to_end
from ddplaunch.errors import EXIT_FAILURE, EXIT_INTERRUPTED, BackendError, DdplaunchError
from ddplaunch.plan.handoff import encode_run, supervisor_opts
from ddplaunch.plan.shellword import word
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.runs import OnHost, RunRecord
from ddplaunch.run.begin import prepared
from ddplaunch.spec.model import ClusterSpec

#: Seconds the supervisor's host may take to answer the hand-over (it forks the supervisor and
#: waits until it has taken the run: supervisor.TAKE_TIMEOUT, plus the interpreter's start).
HANDOVER_TIMEOUT = 120.0
#: Seconds a short command there (status, logs, down's own wait) may take.
COMMAND_TIMEOUT = 300.0
ANSWER = "DDPLAUNCH_SUPERVISED"
#: Seconds without a byte from the supervisor's host before it is asked whether it still answers
#: (a crashed host sends no reset: a read would wait for TCP's own timeout, many minutes).
IDLE_S = 10.0
#: Seconds the host has to answer that question (a new SSH channel opened) before it counts as gone.
ANSWER_S = 15.0


class Lost(BackendError):
    """The supervisor's host stopped answering while ddplaunch's command there ran."""


class SupervisorHost:
    """SSH to the host named by `supervisor.host`, and ddplaunch's commands there."""

    def __init__(self, spec: ClusterSpec):
        host = spec.supervisor.host
        if host is None:
            raise ValueError("the spec names no supervisor.host")
        # the launcher's own python at the same path there, as a detached Slurm run's supervisor
        self.label, self.python = host.label, host.python or sys.executable
        self.connector = Connector(spec, resolve_routes(spec, [host]))

    def command(self, args: list[str]) -> str:
        return f"exec {word(self.python)} -m ddplaunch " + " ".join(word(a) for a in args)

    def _channel(self, args: list[str], timeout: Optional[float], pty: bool = False) -> paramiko.Channel:
        conn = self.connector.connect(self.label)
        try:
            channel = conn.transport.open_session(timeout=30)
            channel.settimeout(timeout)
            if pty:
                size = os.get_terminal_size() if sys.stdout.isatty() else os.terminal_size((200, 50))
                channel.get_pty(width=size.columns, height=size.lines)
            channel.set_combine_stderr(True)
            channel.exec_command(self.command(args))
            return channel
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise BackendError(f"supervisor host {self.label}: SSH command failed: {err}") from None

    def call(self, args: list[str], stdin: str = "", timeout: float = COMMAND_TIMEOUT) -> tuple[int, str]:
        """Run ddplaunch there to its end; (exit status, its output)."""
        channel = self._channel(args, timeout)
        try:
            status, out = run_to_end(channel, stdin, status_wait=ANSWER_S)
            if status is None:
                raise Lost(f"the supervisor's host {self.label} gave no exit status for `ddplaunch {args[0]}`")
            return status, out
        except (socket.timeout, TimeoutError):
            raise BackendError(f"supervisor host {self.label}: `ddplaunch {args[0]}` did not answer within "
                               f"{timeout:.0f}s") from None
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise BackendError(f"supervisor host {self.label}: SSH command failed: {err}") from None
        finally:
            channel.close()

    def _recv(self, channel: paramiko.Channel) -> bytes:
        """The next bytes of `channel` (b"" at its end), asking the host whether it still answers
        after every IDLE_S seconds of silence.

        Raises:
            Lost: it did not answer within ANSWER_S seconds, or the connection broke.
        """
        while True:
            try:
                return channel.recv(65536)
            except socket.timeout:
                try:
                    channel.get_transport().open_session(timeout=ANSWER_S).close()
                except (paramiko.SSHException, EOFError, OSError) as err:
                    raise Lost(f"the supervisor's host {self.label} stopped answering ({err or 'no answer'})") \
                        from None
            except (paramiko.SSHException, EOFError, OSError) as err:
                raise Lost(f"the connection to the supervisor's host {self.label} broke ({err})") from None

    def lines(self, args: list[str]) -> Iterator[str]:
        """ddplaunch's output there, line by line as it comes; raises BackendError with its last
        line when it fails there (Lost when the host stops answering)."""
        channel = self._channel(args, IDLE_S)
        rest, last = b"", ""
        try:
            while data := self._recv(channel):
                *done, rest = (rest + data).split(b"\n")
                for line in done:
                    last = line.decode("utf-8", "replace")
                    yield last
            if rest:
                yield rest.decode("utf-8", "replace")
            if not channel.status_event.wait(ANSWER_S):
                raise Lost(f"the supervisor's host {self.label} gave no exit status for `ddplaunch {args[0]}`")
            code = channel.recv_exit_status()
        finally:
            channel.close()
        if code != 0:
            raise _their_error(code, f"on {self.label}: ", rest.decode("utf-8", "replace") or last)

    def stream(self, args: list[str], out: IO[str], stops_run: bool, run_id: str) -> int:
        """Show ddplaunch's output there as it comes (a terminal there when this is one); its exit
        status. Ctrl-C detaches or, with `stops_run`, stops the run there first (`down`, once); a
        lost connection leaves the run going there."""
        channel = self._channel(args, IDLE_S, pty=out.isatty())
        stopping: list[threading.Thread] = []

        def interrupt(signum: int, frame: Any) -> None:
            if stops_run and not stopping:
                print(f"[ddplaunch] stopping run {run_id} on {self.label} (Ctrl-C again leaves it stopping "
                      "on its own)", file=out, flush=True)
                stopping.append(threading.Thread(target=self._down, args=(run_id,), daemon=True))
                stopping[0].start()
                return
            raise KeyboardInterrupt
        old = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            while data := self._recv(channel):
                out.write(data.decode("utf-8", "replace"))
                out.flush()
            if channel.status_event.wait(ANSWER_S):  # the exit status may come just after the output's end
                return channel.recv_exit_status()
            raise Lost(f"the connection to the supervisor's host {self.label} ended without the command's exit "
                       "status")
        except KeyboardInterrupt:
            print(f"ddplaunch: detached from run {run_id}, which goes on on {self.label} (ddplaunch attach "
                  f"{run_id} follows it again; ddplaunch down {run_id} stops it)", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        except Lost as err:
            print(f"ddplaunch: {err}; run {run_id} goes on there if it lives (ddplaunch attach {run_id} follows "
                  f"it again; ddplaunch down {run_id} ends it, from here if the host is gone)", file=sys.stderr,
                  flush=True)
            return EXIT_FAILURE
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            channel.close()

    def _down(self, run_id: str) -> None:
        try:
            self.call(["down", run_id])
        except DdplaunchError as err:
            print(f"ddplaunch: could not stop run {run_id} on {self.label}: {err}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.connector.close()


def _their_error(code: int, where: str, text: str) -> DdplaunchError:
    """ddplaunch's error there as this side's: its exit code says which kind."""
    cls = {errors.EXIT_BAD_INPUT: errors.PlanError}.get(code, BackendError)
    return cls(where + text.removeprefix("ddplaunch: ").removeprefix("error: "))


def start_there(spec: ClusterSpec, spec_path: str, opts: UpOptions) -> RunRecord:
    """Hand the run to a supervisor on `spec.supervisor.host` and record it here; the record once
    the supervisor there has taken the run.

    Raises:
        PlanError: bad --run-id or --exclude.
        SpecError: a `from_env` variable is not set here.
        BackendError: the host cannot be reached, has no ddplaunch for its python, or its
            supervisor did not take the run (its own error, when it said one).
    """
    spec, run_id = prepared(spec, opts, fresh=True)
    spec.env_values(os.environ)  # every from_env variable is set, or the error names it now
    environ = {v.from_env: os.environ[v.from_env] for v in spec.env.values() if v.from_env is not None}
    handed = supervisor_opts(opts, run_id)
    nonce = secrets.token_hex(6)
    host = SupervisorHost(spec)
    try:
        code, out = host.call(["supervise", "--stdin", "--daemon", "--nonce", nonce],
                              stdin=encode_run(spec, spec_path, handed, environ) + "\n", timeout=HANDOVER_TIMEOUT)
    finally:
        host.close()
    found = re.findall(rf"^{ANSWER}_{nonce} (\{{.*\}})\s*$", out, re.M)
    if code != 0 or not found:
        raise _refused(host, code, out)
    answer = json.loads(found[-1])
    record = RunRecord.planned(run_id, spec_path, spec, OnHost(host.label, int(answer["pid"])))
    record.save()
    return record


def _refused(host: SupervisorHost, code: int, out: str) -> DdplaunchError:
    last = (out.strip().splitlines() or ["(nothing)"])[-1]
    if code == 127 or "No module named" in out:
        return BackendError(f"supervisor.host {host.label}: {host.python} cannot run ddplaunch there ({last}); "
                            f"install ddplaunch for {host.python} on {host.label} (the same version as here), "
                            "or set supervisor.host.python to a python that has it")
    if code in (errors.EXIT_BAD_INPUT, EXIT_FAILURE) and last.startswith("ddplaunch: "):
        return _their_error(code, f"on {host.label}: ", last)
    return BackendError(f"supervisor.host {host.label}: the supervisor did not take the run (exit {code}): {last}")


def host_of(record: RunRecord) -> SupervisorHost:
    """The host a run's supervisor runs on (`supervisor.host`), reached as the spec says.

    Raises:
        ValueError: the run's supervisor does not run on another host.
    """
    if not isinstance(record.placement, OnHost):
        raise ValueError(f"run {record.run_id} is not supervised on another host")
    return SupervisorHost(record.spec.validated)
