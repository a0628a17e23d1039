"""`status`, `logs` and `down` of a recorded run: the record (data) plus what its backend says.

The record names its backend; the backend answers from the record alone (a Scheduler: the job
it was given), so these work after the launcher has exited — or died.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Iterator, Optional

from ddplaunch.backends import make_backend, scheduler_of
from ddplaunch.backends.contract import Launcher, RunContext
from ddplaunch.errors import DdplaunchError
from ddplaunch.output.console import WHO_RE
from ddplaunch.record.events import read_events
from ddplaunch.record.results import StopEvent
from ddplaunch.record.runs import ACTIVE_STATES, REMOTE_HOST, RunRecord, load_run, status_lines
from ddplaunch.report.status import RunStatus
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.supervise import daemon as supervisor

#: Seconds between two questions to the scheduler whether a detached run's job has ended.
JOB_POLL = 2.0
FOLLOW_POLL = 0.2


def record_backend(record: RunRecord) -> Launcher[Any]:
    """The backend of a recorded run, configured from the record's (redacted) spec."""
    spec = ClusterSpec.model_validate(record.spec)
    spec = spec.model_copy(update={"base_dir": record.extra.get("base_dir", ".")})
    return make_backend(spec, RunContext(record.run_id, record.dir, StopEvent()))


def settle(record: RunRecord, backend: Launcher[Any]) -> RunRecord:
    """A detached run whose record its supervisor did not end (it never saw the record, or was
    killed with its job) takes its final state from the scheduler once the job has ended, and
    keeps it in the record."""
    scheduler = scheduler_of(backend)
    if record.state not in ACTIVE_STATES or not record.extra.get("detached") or scheduler is None:
        return record
    try:
        state = scheduler.final_state(record)
    except DdplaunchError:  # the scheduler does not answer: the record stays as it is
        return record
    if state is not None:
        record.state, record.ended_at = state, time.time()
        record.save()
    return record


def _elsewhere(record: RunRecord, args: list[str]) -> Optional[list[str]]:
    """ddplaunch's `args` on the host the run's supervisor runs on, when that is not this machine
    (None); its lines, or the reason the host did not answer."""
    if not record.extra.get(REMOTE_HOST):
        return None
    from ddplaunch.supervise import remote  # Fabric: only for such a run

    host = remote.host_of(record)
    if host is None:
        return None
    try:
        return list(host.lines(args))
    except DdplaunchError as err:
        return [f"{record.run_id}: its supervisor's host {host.label} did not answer: {err}"]
    finally:
        host.close()


def status(record: RunRecord) -> list[str]:
    """What the run's event log says (runstatus.py; the record, for a run that has none yet), then
    the backend's live view (Slurm: the job); of a run supervised on another host, what `status`
    says there."""
    there = _elsewhere(record, ["status", record.run_id])
    if there is not None:
        return there
    backend = record_backend(record)
    scheduler = scheduler_of(backend)
    job = scheduler.describe(record) if scheduler else []
    view = RunStatus.of(read_events(record.dir))
    if view.started is None:  # not started yet (a queued job), or an older ddplaunch's run: its record
        return status_lines(settle(record, backend)) + job
    return view.lines(*liveness(record, view, backend)) + job


def liveness(record: RunRecord, view: RunStatus,
             backend: Optional[Launcher[Any]] = None) -> tuple[Optional[bool], Optional[str]]:
    """What the event log cannot say of itself: whether its writer (the supervisor) still runs
    (None: not known here), and the final state a scheduler gave a detached run whose log has no
    end (its job was ended whole; the record's backend is asked, `backend` when given)."""
    final = None
    if view.ended is None and record.extra.get("detached"):
        settled = settle(record, backend or record_backend(record))
        final = settled.state if settled.state not in ACTIVE_STATES else None
    return record.launcher_alive(), final


def logs(record: RunRecord, host: Optional[str] = None, follow: bool = False,
         rank: Optional[int] = None) -> Iterator[str]:
    """A run's log lines (only `host`'s, only global rank `rank`'s, when given); with `follow`,
    until the run has ended (or its launcher died)."""
    def mine(line: str) -> bool:
        if host is None and rank is None:
            return True
        who = WHO_RE.match(line)
        if who is None or host is not None and who.group(1) != host:
            return False
        return rank is None or who.group(2) == str(rank)

    if record.extra.get(REMOTE_HOST):
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
    asked = time.monotonic()
    with open(record.log_path) as f:
        while True:
            line = f.readline()
            if line:
                if mine(line):
                    yield line.rstrip("\n")
                continue
            if not follow:
                return
            current = load_run(record.run_id)
            if current.extra.get("detached") and time.monotonic() - asked >= JOB_POLL:
                current, asked = settle(current, backend), time.monotonic()  # its job was ended whole
            if current.state not in ACTIVE_STATES or current.launcher_alive() is False:
                for rest in f:  # what was written between the last read and the end
                    if mine(rest):
                        yield rest.rstrip("\n")
                return
            time.sleep(FOLLOW_POLL)


def _logs_there(record: RunRecord, host: Optional[str], follow: bool, rank: Optional[int]) -> Iterator[str]:
    from ddplaunch.supervise import remote  # Fabric: only for such a run

    there = remote.host_of(record)
    assert there is not None
    args = ["logs", record.run_id, *(["--host", host] if host else []), *(["--rank", str(rank)] if rank is not None
                                                                         else []), *(["-f"] if follow else [])]
    try:
        yield from there.lines(args)
    finally:
        there.close()


def down(record: RunRecord) -> list[str]:
    """End the run: its supervisor first, when it still runs here (it stops every host in order
    and ends the record), then every process left of the run, on every host, by the run's tag. A
    frozen supervisor (SIGSTOP) is not waited for: the hosts are cleaned, then it is killed."""
    there = _elsewhere(record, ["down", record.run_id])
    if there is not None and not any(" did not answer: " in line for line in there):
        return there
    lines = there or []  # its host is gone: what is left on the run's hosts is ended from here
    supervised = supervisor.of_record(record)
    frozen = supervised is not None and supervised.frozen()
    if supervised is not None and not frozen:
        grace = float(record.spec.get("job", {}).get("stop_grace") or 30)
        gone = supervisor.stop(supervised, grace)
        lines.append(f"supervisor (pid {supervised.pid}): " + ("stopped the run" if gone else
                     "still running after it was asked to stop; ending what is left on the hosts"))
        record = load_run(record.run_id)
    backend = record_backend(record)
    lines += backend.down(record)
    settle(record, backend)
    if supervised is not None and frozen and supervised.signal(signal.SIGKILL):
        lines.append(f"supervisor (pid {supervised.pid}): frozen (stopped by a signal), killed once its hosts "
                     "were cleaned")
    return lines
