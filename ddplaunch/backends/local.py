"""Local backend: runs the plan's one node on this machine with `bash -c LINE`.

The same command line as a remote host gets, in a new session, so ending the run is one
signal to its process group; leftovers (torchrun starts workers in sessions of their own) are
found by the run's environment tag.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Callable

from ddplaunch.hostside import reaper
from ddplaunch.backends.base import (
    INTERRUPTED, RUNNING, HostResult, LineSink, NodeOutcome, StageCallback, StageResult, finish_outcome,
    run_in_order, stop_cause)
from ddplaunch.errors import BackendError
from ddplaunch.plan import HOST_RUN_ROOT, LaunchPlan
from ddplaunch.spec import ClusterSpec, HostSpec

#: Seconds torchrun gets to stop its workers after SIGTERM before everything is killed.
SHUTDOWN_GRACE = 10.0


class LocalBackend:
    """Runs a one-node plan here."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec

    def port_free(self, addr: str, port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    def run_all(self, plans: list[LaunchPlan], sink: LineSink, stop: threading.Event,
                on_stage: StageCallback) -> list[StageResult]:
        return run_in_order(self, plans, sink, stop, on_stage)

    def run(self, plan: LaunchPlan, sink: LineSink, stop: threading.Event) -> StageResult:
        (node,) = plan.nodes
        run_dir = Path.home() / HOST_RUN_ROOT / plan.run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        for src, dst in plan.uploads:
            shutil.copyfile(src, run_dir / dst)
        outcome = NodeOutcome(node_rank=0, host=node.host.label, state=RUNNING)
        sink.state(outcome.host, f"running {plan.stage}")
        result = StageResult(stage=plan.stage, outcomes=[outcome])
        proc = subprocess.Popen(["bash", "-c", node.shell_line()], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace")
        reader = threading.Thread(target=_pump, args=(proc, sink, node.host.label), daemon=True)
        reader.start()
        while proc.poll() is None:
            if stop.wait(0.1):
                result.interrupted = stop_cause(stop) is None  # a hang found by ddplaunch is a failure
                outcome.state = INTERRUPTED
                outcome.detail = f"stopped by ddplaunch: {stop_cause(stop) or 'interrupted by the user'}"
                sink.note(f"stopping {node.host.label}: SIGTERM to torchrun (pid {proc.pid})")
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

    def run_short(self, command: Callable[[HostSpec], str], timeout: float = 30) -> list[HostResult]:
        results: list[HostResult] = []
        for host in self.spec.hosts:
            try:
                proc = subprocess.run(["bash", "-c", command(host)], capture_output=True, text=True,
                                      timeout=timeout, stdin=subprocess.DEVNULL)
                results.append((host, (proc.returncode, proc.stdout + proc.stderr), None))
            except subprocess.TimeoutExpired:
                results.append((host, None, BackendError(f"{host.label}: command did not finish within {timeout}s")))
        return results

    def down(self, run_id: str) -> list[str]:
        left = reaper.run_pids(run_id)
        reaper.reap(run_id)
        return [f"localhost: ended {len(left)} process(es)" if left else "localhost: nothing left"]


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
