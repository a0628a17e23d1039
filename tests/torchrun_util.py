"""Test helpers that run the plain torchrun scripts (jobs/, healthcheck) on localhost.

Every wait has a deadline; processes are started in their own session so a test can
stop a whole torchrun (which forwards SIGTERM to its workers) without touching others.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddplaunch.hostside.procs import proc_alive

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "jobs"
HEALTHCHECK = ROOT / "ddplaunch" / "hostside" / "healthcheck.py"


def free_port() -> int:
    """Returns a TCP port that was free a moment ago (bind to port 0, then release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_argv(script, *args, nproc: int = 2, torchrun_args=()) -> list:
    """Builds a single-node ``python -m torch.distributed.run`` command line."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "--nproc-per-node", str(nproc), *torchrun_args, str(script), *map(str, args)]


def _env(extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def run_torchrun(script, *args, nproc: int = 2, env=None, timeout: float = 120,
                 torchrun_args=()) -> subprocess.CompletedProcess:
    """Runs a script under torchrun to completion; stdout holds stdout and stderr merged.

    Raises:
        subprocess.TimeoutExpired: the run exceeded ``timeout`` (it is killed first).
    """
    proc = start_torchrun(script, *args, nproc=nproc, env=env, torchrun_args=torchrun_args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_torchrun(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def start_torchrun(script, *args, nproc: int = 2, env=None, torchrun_args=()) -> subprocess.Popen:
    """Starts torchrun in its own session, output merged into ``proc.stdout`` (text)."""
    return subprocess.Popen(torchrun_argv(script, *args, nproc=nproc, torchrun_args=torchrun_args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(env), cwd=ROOT, start_new_session=True)


def worker_pids(proc: subprocess.Popen) -> list:
    """The torchrun agent's child processes (Linux /proc); they live in their own sessions."""
    pids = []
    for task in Path(f"/proc/{proc.pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def stop_torchrun(proc: subprocess.Popen, timeout: float = 30) -> str:
    """SIGTERMs torchrun like a scheduler would; returns its output.

    torchrun forwards the signal to its workers and waits for them. SIGKILL on the
    agent would orphan them, as each worker runs in a session of its own.
    """
    workers = worker_pids(proc)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=timeout)
    for pid in workers:  # belt and braces: never leave a worker training behind
        if poll(lambda: not proc_alive(pid), timeout=10) is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return out


def poll(predicate, timeout: float, interval: float = 0.05):
    """Polls ``predicate`` until it returns something truthy; returns it, or None at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """`poll`, but the deadline raises TimeoutError: for conditions the test cannot go on without."""
    value = poll(predicate, timeout, interval)
    if not value:
        raise TimeoutError(f"condition not met within {timeout}s")
    return value
