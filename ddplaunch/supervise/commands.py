"""`status`, `logs`, `down` and `runs` of a recorded run: the fold of its event log, plus what its
backend and the placement of its supervisor say.

The record names the backend and where the supervisor runs; the backend answers from the record
alone (a Scheduler: the job it was given), so these work after the launcher has exited — or died.
A run supervised on another host (`supervisor.host`) is asked there, over SSH.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ddplaunch.backends import make_backend, scheduler_of
from ddplaunch.backends.contract import Launcher, RunContext, StopEvent
from ddplaunch.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, DdplaunchError
from ddplaunch.output.who import read_line
from ddplaunch.record.events import EventLog, RunEnded, RunStarted, first_event, last_event
from ddplaunch.record.snapshot import read_view
from ddplaunch.record.live import read_live
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import InJob, Local, OnHost, RunRecord
from ddplaunch.record.view import RunView
from ddplaunch.report.goodput import Ledger, ledger
from ddplaunch.report.status import shown_state, status_lines
from ddplaunch.supervise import daemon

#: Seconds between two questions to the scheduler whether a detached run's job has ended.
JOB_POLL = 2.0
FOLLOW_POLL = 0.2


def record_backend(record: RunRecord) -> Launcher[Any]:
    """The backend of a recorded run, configured from the record's (redacted) spec."""
    return make_backend(record.spec.validated, RunContext(record.run_id, record.dir, StopEvent()))


def settle(record: RunRecord, backend: Optional[Launcher[Any]] = None) -> Optional[RunEnded]:
    """The end of a detached run whose supervisor could not log it (it never started, or was
    killed with its job): once the scheduler has ended the job, its word is appended to the run's
    event log (`RunEnded`, by the scheduler). None while the job runs, or for another run."""
    if not isinstance(record.placement, InJob):
        return None
    last = last_event(record.dir)
    if isinstance(last, RunEnded):
        return last
    scheduler = scheduler_of(backend or record_backend(record))
    if scheduler is None:
        return None
    try:
        end = scheduler.final_state(record)
    except DdplaunchError:  # the scheduler does not answer: the run's log stays as it is
        return None
    if end is None:
        return None
    code = {RunState.OK: EXIT_OK, RunState.CANCELLED: EXIT_INTERRUPTED}.get(end.state, EXIT_FAILURE)
    ended = RunEnded(end.state, code, error=end.detail, by_scheduler=True)
    log = EventLog(record.make_dir())
    try:
        log.append(ended)
    finally:
        log.close()
    return ended


def supervisor_alive(record: RunRecord, backend: Optional[Launcher[Any]] = None) -> Optional[bool]:
    """Whether the run's supervisor still runs (None: not known from here)."""
    placement = record.placement
    if isinstance(placement, Local):
        return placement.alive()
    if isinstance(placement, InJob):
        scheduler = scheduler_of(backend or record_backend(record))
        return scheduler.job_running(record) if scheduler is not None else None
    return None


def view_of(record: RunRecord) -> RunView:
    """The fold of the run's event log, its identity filled from the record before the log has any."""
    view = read_view(record.dir)
    view.run_id = view.run_id or record.run_id
    view.hosts = view.hosts or list(record.hosts)
    return view


def _where(record: RunRecord) -> str:
    """Where the supervisor runs, for a run whose log does not say yet."""
    placement = record.placement
    if isinstance(placement, InJob):
        return placement.where
    if isinstance(placement, OnHost):
        return f"supervised on {placement.host} (ddplaunch status {record.run_id})"
    return f"supervisor pid {placement.pid} on {placement.host}"


@dataclass(frozen=True)
class Elsewhere:
    """What ddplaunch's command printed on the host a run's supervisor runs on; `answered` is
    False when the host did not answer (the lines say why)."""

    lines: list[str]
    answered: bool


def elsewhere(record: RunRecord, args: list[str]) -> Optional[Elsewhere]:
    """ddplaunch's `args` on the host the run's supervisor runs on, when that is not this machine
    (None)."""
    if not isinstance(record.placement, OnHost):
        return None
    from ddplaunch.supervise import remote  # Fabric: only for such a run

    host = remote.host_of(record)
    try:
        return Elsewhere(list(host.lines(args)), True)
    except DdplaunchError as err:
        return Elsewhere([f"{record.run_id}: its supervisor's host {host.label} did not answer: {err}"], False)
    finally:
        host.close()


def status(record: RunRecord) -> list[str]:
    """What the run's event log says (report/status.py), then the backend's live view (Slurm: the
    job); of a run supervised on another host, what `status` says there."""
    there = elsewhere(record, ["status", record.run_id])
    if there is not None:
        return there.lines
    backend = record_backend(record)
    scheduler = scheduler_of(backend)
    job = scheduler.describe(record) if scheduler else []
    settle(record, backend)
    view = view_of(record)
    return status_lines(view, record.backend, supervisor_alive(record, backend), _where(record),
                        live=read_live(record.dir)) + job


def ledgers(records: list[RunRecord]) -> list[tuple[RunRecord, Ledger]]:
    """Each ended run's goodput ledger (report/goodput.py), from its log's fold (its snapshot first)."""
    out = []
    for record in records:
        try:
            spent = ledger(read_view(record.dir))
        except OSError:
            continue
        if spent is not None:
            out.append((record, spent))
    return out


def state_of(record: RunRecord) -> str:
    """The run's state in words for `runs`, from the ends of its event log alone (no whole log read)."""
    last = last_event(record.dir)
    if isinstance(last, RunEnded):
        return str(last.state)
    first = first_event(record.dir)
    if not isinstance(first, RunStarted):
        return _where(record) if isinstance(record.placement, OnHost) else str(RunState.SUBMITTED)
    view = RunView.of([first])
    return shown_state(view, record.placement.alive() if isinstance(record.placement, Local) else None)


def logs(record: RunRecord, host: Optional[str] = None, follow: bool = False,
         rank: Optional[int] = None) -> Iterator[str]:
    """A run's log lines (only `host`'s, only global rank `rank`'s, when given); with `follow`,
    until the run has ended (or its supervisor died)."""
    def mine(line: str) -> bool:
        if host is None and rank is None:
            return True
        who = read_line(line)
        return who is not None and (host is None or who.host == host) and (rank is None or who.rank == rank)

    if isinstance(record.placement, OnHost):
        yield from _logs_there(record, host, follow, rank)
        return
    backend = record_backend(record)
    scheduler = scheduler_of(backend)
    from_backend = scheduler.log_lines(record, follow) if scheduler else None
    if from_backend is not None:
        yield from filter(mine, from_backend)
        settle(record, backend)
        return
    if not record.log_path.exists():
        return
    yield from filter(mine, _follow_log(record, backend, follow))


def _follow_log(record: RunRecord, backend: Launcher[Any], follow: bool) -> Iterator[str]:
    asked = time.monotonic()
    with open(record.log_path) as f:
        while True:
            line = f.readline()
            if line:
                yield line.rstrip("\n")
                continue
            if not follow:
                return
            ended = isinstance(last_event(record.dir), RunEnded)
            if not ended and isinstance(record.placement, InJob) and time.monotonic() - asked >= JOB_POLL:
                ended, asked = settle(record, backend) is not None, time.monotonic()  # its job was ended whole
            if ended or supervisor_alive(record, backend) is False:
                for rest in f:  # what was written between the last read and the end
                    yield rest.rstrip("\n")
                return
            time.sleep(FOLLOW_POLL)


def _logs_there(record: RunRecord, host: Optional[str], follow: bool, rank: Optional[int]) -> Iterator[str]:
    from ddplaunch.supervise import remote  # Fabric: only for such a run

    there = remote.host_of(record)
    args = ["logs", record.run_id, *(["--host", host] if host else []), *(["--rank", str(rank)] if rank is not None
                                                                         else []), *(["-f"] if follow else [])]
    try:
        yield from there.lines(args)
    finally:
        there.close()


def down(record: RunRecord) -> list[str]:
    """End the run: its supervisor first, when it still runs here (it stops every host in order
    and ends the run's log), then every process left of the run, on every host, by the run's tag.
    A frozen supervisor (SIGSTOP) is not waited for: the hosts are cleaned, then it is killed."""
    there = elsewhere(record, ["down", record.run_id])
    if there is not None and there.answered:
        return there.lines
    lines = there.lines if there is not None else []  # its host is gone: the run's hosts are cleaned from here
    supervised = daemon.of_record(record)
    frozen = supervised is not None and supervised.frozen()
    if supervised is not None and not frozen:
        grace = float(record.spec.validated.job.stop_grace or 30)
        gone = daemon.stop(supervised, grace)
        lines.append(f"supervisor (pid {supervised.pid}): " + ("stopped the run" if gone else
                     "still running after it was asked to stop; ending what is left on the hosts"))
    backend = record_backend(record)
    lines += backend.down(record)
    settle(record, backend)
    if supervised is not None and frozen and supervised.signal(signal.SIGKILL):
        lines.append(f"supervisor (pid {supervised.pid}): frozen (stopped by a signal), killed once its hosts "
                     "were cleaned")
    return lines
