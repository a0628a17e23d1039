"""The supervisor: the process that runs a run's loop, apart from the terminal that started it.

`start_daemon` forks it as a daemon (its own session, no terminal, its standard streams on
/dev/null, a second fork so it can never take a terminal back) and returns once it has taken the
run: the run's record places its supervisor in it (`Local`) and its event log (record/events.py)
is open. It runs the one run loop (`run/begin.run_begun`: pre-flight, gates, the job, watcher,
recovery, teardown) and appends everything the run establishes to the event log; whoever started
it follows that log (supervise/follow.py) and may go away — a closed terminal, a SIGKILLed
`ddplaunch up` — without ending the run. SIGTERM or
SIGINT to the supervisor stops the run as Ctrl-C always did; SIGHUP is ignored.

A fork, not a new interpreter: the run starts without a second import of ddplaunch, and what the
caller configured in-process (a backend registered from Python) is there. The caller must not
hold other threads' locks at that moment (the CLI has no other thread; `ddplaunch.submit` says so).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, MutableMapping, NoReturn, Optional

from ddplaunch.errors import EXIT_FAILURE, BackendError, DdplaunchError
from ddplaunch.plan.handoff import SUPERVISE_ENV, HandedOver, decode_run
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.runs import Local, RunRecord, process_start_time, run_dir
from ddplaunch.run import begin
from ddplaunch.spec.model import ClusterSpec

#: Seconds `start_daemon` waits for the supervisor to take the run (record and log written) before
#: saying it did not start; a hang guard on a loaded machine.
TAKE_TIMEOUT = 60.0
#: Seconds `stop` waits for a stopped supervisor to end the run (its job's stop_grace comes on top).
STOP_WAIT = 60.0
SUPERVISOR_LOG = "supervisor.log"


@dataclass(frozen=True)
class Supervised:
    """A run taken by its supervisor: the run id, and the supervisor's pid and process start time
    (a pid reused by another process is not taken for it)."""

    run_id: str
    pid: int
    start: Optional[int]

    @classmethod
    def of(cls, run_id: str, placement: Local) -> "Supervised":
        """The supervisor process a run's placement names, alive or not."""
        return cls(run_id, placement.pid, placement.start)

    @property
    def dir(self) -> Path:
        return run_dir(self.run_id)

    def alive(self) -> bool:
        started = process_start_time(self.pid)
        return started is not None and (self.start is None or started == self.start)

    def where(self) -> str:
        return f"pid {self.pid}"

    def frozen(self) -> bool:
        """Stopped by a signal (SIGSTOP, a debugger): it would not act on a request to stop."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def signal(self, signum: int) -> bool:
        """Send `signum` to the supervisor if it is still this run's; False when it is gone."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True


def start_daemon(spec: ClusterSpec, spec_path: str, opts: UpOptions) -> Supervised:
    """Start the run's supervisor and return once it has taken the run.

    Args:
        spec: the validated spec; spec_path: where it came from (the record says); opts: the
            command line's additions.
    Raises:
        PlanError: what `begin.begin` refuses (bad --run-id or --exclude; nothing recorded).
        BackendError: the supervisor did not take the run within TAKE_TIMEOUT seconds.
    """
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked side; it never returns to the caller
        os.close(read_fd)
        try:
            os.setsid()
            if os.fork() == 0:
                _supervise(spec, spec_path, opts, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(child, 0)
    try:
        answer = _read_answer(read_fd, TAKE_TIMEOUT)
    finally:
        os.close(read_fd)
    if "error" in answer:
        raise _error(answer)
    return Supervised(answer["run_id"], answer["pid"], answer.get("start"))


def _read_answer(fd: int, timeout: float) -> dict[str, Any]:
    """The supervisor's one-line answer: the run it took, or the error that stopped it."""
    data, deadline = b"", time.monotonic() + timeout
    poller = select.poll()  # not select(): no ceiling on the descriptor's number
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            raise BackendError(f"the run's supervisor did not start within {timeout:.0f}s; nothing was launched "
                               "(the machine is overloaded, or see `ddplaunch runs`)")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise BackendError("the run's supervisor ended before it took the run; nothing was launched")
        data += chunk
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise BackendError(f"the run's supervisor answered {data[:200]!r}; nothing was launched")
    return answer


def _error(answer: dict[str, Any]) -> DdplaunchError:
    """The error the supervisor refused the run with, as its own class (the exit code with it)."""
    from ddplaunch import errors

    cls = getattr(errors, str(answer.get("type")), None)
    if isinstance(cls, type) and issubclass(cls, DdplaunchError):
        return cls(answer["error"])
    return BackendError(answer["error"])


def _supervise(spec: ClusterSpec, spec_path: str, opts: UpOptions, answer_fd: int) -> NoReturn:
    """The daemon's life: take the run, answer, run the loop, exit with the run's code."""
    code = EXIT_FAILURE
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _detach_streams(keep=answer_fd)
        try:
            begun = begin.begin(spec, spec_path, opts)
        except DdplaunchError as err:
            _answer(answer_fd, {"error": str(err), "type": type(err).__name__})
            os._exit(err.exit_code)
        log = os.open(begun.record.dir / SUPERVISOR_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 2)
        os.close(log)
        _answer(answer_fd, {"run_id": begun.record.run_id, "pid": os.getpid(),
                            "start": process_start_time(os.getpid())})
        with open(os.devnull, "w") as nowhere:  # the screen is the event log's; its follower renders the summary
            code = begin.run_begun(begun, opts, stream=nowhere, summary=False).exit_code
    except DdplaunchError as err:  # told in the event log's RunEnded; the attached side prints it
        code = err.exit_code
    except BaseException:  # a defect: its traceback for the supervisor log
        traceback.print_exc()
    finally:
        os._exit(code)


def _detach_streams(keep: int) -> None:
    """Standard streams on /dev/null and every other inherited descriptor closed (a pipe the
    caller's caller reads to its end must not wait for the run), but `keep`."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, _max_fd())


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 1024


def _answer(fd: int, answer: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(answer) + "\n").encode())
    os.close(fd)


def of_record(record: RunRecord) -> Optional[Supervised]:
    """The supervisor process of a recorded run, when it runs on this machine and is still alive."""
    placement = record.placement
    return Supervised.of(record.run_id, placement) if isinstance(placement, Local) and placement.alive() else None


def stop(supervised: Supervised, grace: float) -> bool:
    """Ask the supervisor to stop its run (SIGTERM: every host stopped in order, as Ctrl-C does)
    and wait until it has ended it; True once it is gone, False if it still runs after
    `grace` + STOP_WAIT seconds."""
    if not supervised.signal(signal.SIGTERM):
        return True
    deadline = time.monotonic() + grace + STOP_WAIT
    while time.monotonic() < deadline:
        if not supervised.alive():
            return True
        time.sleep(0.1)
    return False


def supervise_here(environ: MutableMapping[str, str]) -> int:
    """`ddplaunch supervise`: run the run handed over in `environ` (plan/handoff.py) in this process,
    in the foreground, its screen on stdout (the batch script of a detached Slurm run: the job's
    output); the run's exit code. The run's record, when the launcher's file system is this one's
    (or a requeued job's first try wrote it), is taken over; the hand-over leaves the environment
    before any stage starts."""
    run = handed_over(environ)
    begun = begin.begin(run.spec, run.spec_path, run.opts, take_over=True)
    return begin.run_begun(begun, run.opts, stream=sys.stdout).exit_code


def supervise_daemon(environ: MutableMapping[str, str]) -> Supervised:
    """`ddplaunch supervise --daemon`: the run handed over in `environ` taken by a supervisor
    forked here (`start_daemon`), once it has taken it."""
    run = handed_over(environ)
    return start_daemon(run.spec, run.spec_path, run.opts)


def handed_over(environ: MutableMapping[str, str]) -> HandedOver:
    """The run handed over in `environ`, taken out of it, its variables set in it."""
    run = decode_run(environ)
    environ.pop(SUPERVISE_ENV, None)
    environ.update(run.environ)
    return run
