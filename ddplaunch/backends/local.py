"""Local backend: runs the plan's one node on this machine with `bash -c LINE`.

The same command line as a remote host gets, in a new session, so ending the run is one
signal to its process group; leftovers (torchrun starts workers in sessions of their own) are
found by the run's tag (hostside/procs.py, imported here directly).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Optional

from ddplaunch.backends.contract import CommandFor, HostResult
from ddplaunch.backends.shell import SHUTDOWN_GRACE, ShellBackend, ShellRequest, describe_reap
from ddplaunch.console import LineSink
from ddplaunch.errors import BackendError
from ddplaunch.hostside import reaper
from ddplaunch.hostside.procs import run_processes
from ddplaunch.outcomes import finish_outcome
from ddplaunch.plan import HOST_RUN_ROOT
from ddplaunch.results import INTERRUPTED, RUNNING, NodeOutcome, StageResult, stop_cause
from ddplaunch.spec import HostSpec


class LocalBackend(ShellBackend):
    """Runs a one-node plan here."""

    name = "local"
    max_parallel = 1

    def port_free(self, addr: str, port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds (ssh.py)
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    def launch(self, request: ShellRequest, sink: LineSink, stop: threading.Event) -> StageResult:
        plan = request.plan
        (node,) = plan.nodes
        run_dir = Path.home() / HOST_RUN_ROOT / plan.run_id
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for src, dst in plan.uploads:
            shutil.copyfile(src, run_dir / dst)
        (run_dir / f"node{node.node_rank}.pid").unlink(missing_ok=True)
        env_file = run_dir / f"{plan.stage}-node{node.node_rank}.env"
        env_file.unlink(missing_ok=True)
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start
        with os.fdopen(fd, "w") as f:
            f.write(node.env_text())
        outcome = NodeOutcome(node_rank=0, host=node.host_label, state=RUNNING)
        sink.state(outcome.host, f"running {plan.stage}")
        result = StageResult(stage=plan.stage, outcomes=[outcome])
        proc = subprocess.Popen(["bash", "-c", node.shell_line()], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace")
        reader = threading.Thread(target=_pump, args=(proc, sink, node.host_label), daemon=True)
        reader.start()
        while proc.poll() is None:
            if stop.wait(0.1):
                result.interrupted = stop_cause(stop) is None  # a hang found by ddplaunch is a failure
                outcome.state = INTERRUPTED
                outcome.detail = f"stopped by ddplaunch: {stop_cause(stop) or 'interrupted by the user'}"
                sink.note(f"stopping {node.host_label}: SIGTERM to torchrun (pid {proc.pid})")
                sink.mute({0})
                _terminate(proc, plan.run_id)
                break
        proc.wait()
        reader.join(timeout=5)
        # Workers live in sessions of their own: end any that outlived torchrun.
        reaper.reap(plan.run_id)
        finish_outcome(outcome, sink, proc.returncode)
        result.ended_at = outcome.ended_at
        return result

    def close(self) -> None:
        pass

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        results: list[HostResult] = []
        for host in self.spec.hosts if hosts is None else hosts:
            try:
                proc = subprocess.run(["bash", "-c", command(host)], capture_output=True, text=True,
                                      timeout=timeout, stdin=subprocess.DEVNULL)
                results.append((host, (proc.returncode, proc.stdout + proc.stderr), None))
            except subprocess.TimeoutExpired:
                results.append((host, None, BackendError(f"{host.label}: command did not finish within {timeout}s")))
        return results

    def down(self, record: dict) -> list[str]:
        run_id = record["run_id"]
        before = sorted(run_processes(run_id))
        reaper.term_pidfiles(run_id, [str(p) for p in (Path.home() / HOST_RUN_ROOT / run_id).glob("node*.pid")])
        reaper.reap(run_id)
        left = sorted(run_processes(run_id))
        return [f"localhost: {describe_reap({'before': before, 'left': left})}"]


def _pump(proc: subprocess.Popen, sink: LineSink, host: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sink.emit(0, host, line)


def _terminate(proc: subprocess.Popen, run_id: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=SHUTDOWN_GRACE)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    reaper.reap(run_id, grace=2.0)
