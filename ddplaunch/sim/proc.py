"""The one door through which the sim runs commands and signals processes.

Every subprocess call has a timeout and a checked return code; every failure becomes a
`SimError` with one line that says what failed and how to fix it. Processes are only
ever addressed by PID (never by name), and PIDs are checked against an expected
command line before they are signalled, so a recycled PID is never killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ddplaunch.errors import EXIT_BAD_INPUT, DdplaunchError

DEFAULT_TIMEOUT_S = 15.0


class SimError(DdplaunchError):
    """The simulated cluster could not be built, inspected or changed (exit 2)."""

    exit_code = EXIT_BAD_INPUT


def run(argv: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, check: bool = True,
        input: str | None = None, env: Mapping[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run `argv` (with environment `env`, default ours), capture its output and (by
    default) insist on exit status 0.

    Raises:
        SimError: the command is missing, timed out, or (with check) exited non-zero;
            the message holds the command and the last line of its stderr.
    """
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              input=input, env=None if env is None else dict(env),
                              stdin=None if input is not None else subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise SimError(f"command not found: {argv[0]} ({exc.strerror})") from exc
    except subprocess.TimeoutExpired as exc:
        raise SimError(f"command timed out after {timeout:g}s: {' '.join(argv)}") from exc
    if check and proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise SimError(f"command failed (exit {proc.returncode}): {' '.join(argv)}: {last}")
    return proc


def run_concurrently(jobs: Sequence[tuple[Sequence[str], str | None]], *, timeout: float = DEFAULT_TIMEOUT_S,
                     workers: int = 16) -> list[subprocess.CompletedProcess[str]]:
    """`run(argv, input=input)` for every (argv, input) of `jobs`, up to `workers` at a time;
    the results in order. Every job runs to its end even when one fails.

    Raises:
        SimError: the first (in order) job that failed, as `run` would raise it.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[Sequence[str], str | None]) -> subprocess.CompletedProcess[str] | SimError:
        try:
            return run(job[0], input=job[1], timeout=timeout)
        except SimError as exc:
            return exc

    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
        results = list(pool.map(one, jobs))
    for res in results:
        if isinstance(res, SimError):
            raise res
    return results  # type: ignore[return-value]


def require_tool(path_or_name: str, fix: str) -> str:
    """Return the absolute path of a tool, or raise a SimError carrying `fix`."""
    found = path_or_name if os.path.isabs(path_or_name) and os.access(path_or_name, os.X_OK) \
        else shutil.which(path_or_name)
    if not found:
        raise SimError(f"{path_or_name} not found: {fix}")
    return found


def require_root(what: str = "ddplaunch sim") -> None:
    """Raise SimError unless we run as root (namespaces, veths and sshd on port 22 need it)."""
    if os.geteuid() != 0:
        raise SimError(f"{what} needs root (network namespaces, veth links, sshd on port 22): "
                       "run it as root, e.g. `sudo ddplaunch sim up`")


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds have passed; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def pid_alive(pid: int | None) -> bool:
    """True when `pid` names a live process (zombies count as dead; our own are reaped)."""
    if not pid or pid <= 0:
        return False
    try:
        # a child of this process (e.g. started by a test) must be reaped, or it stays a zombie
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def pid_cmdline(pid: int) -> str:
    """The command line of `pid` (NULs as spaces), or '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_pids(pids: Sequence[int], *, grace: float = 5.0) -> list[int]:
    """SIGTERM all `pids` at once, wait up to `grace` seconds, SIGKILL the rest.

    Returns the PIDs that had to be killed with SIGKILL. Callers must have checked that the
    PIDs are theirs (see `pid_cmdline`); this function only signals.
    """
    live = [p for p in pids if pid_alive(p)]
    for pid in live:
        _signal(pid, signal.SIGTERM)
    wait_until(lambda: not any(pid_alive(p) for p in live), grace)
    forced = [p for p in live if pid_alive(p)]
    for pid in forced:
        _signal(pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in forced), 2.0)
    return forced


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def read_pid(path: Path) -> int | None:
    """The PID a daemon wrote to `path`, or None (no file, or not a number yet)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
