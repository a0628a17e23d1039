"""Handing a run to its supervisor: the one place that decides where a run's supervisor runs.

`hand_over` returns once the supervisor has taken the run: on `supervisor.host` when the spec
names one (supervise/remote.py: `OnHost`), in the scheduler's job where the backend can own a whole run
(Slurm's `up --detach`: `InJob`), else a daemon on this machine (daemon.py: `Local`). The run's
record says which (record/runs.py: its `placement`); every reader asks the placement, never the
spec or the backend, where the supervisor is.
"""

from __future__ import annotations

import os
from typing import Optional

from ddplaunch.backends import make_backend, scheduler_of
from ddplaunch.backends.contract import RunContext, StopEvent
from ddplaunch.errors import DdplaunchError
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import EventLog, Requested, RunEnded
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import InJob, Local, OnHost, RunRecord, load_run, run_dir
from ddplaunch.run.hostmemory import skip_recorded
from ddplaunch.run.launch import detached_request, prepared
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.supervise.daemon import start_daemon


def hand_over(spec: ClusterSpec, spec_path: str, opts: UpOptions) -> RunRecord:
    """Hand the run to its supervisor; its record once the supervisor has taken it.

    Raises:
        PlanError: bad --run-id or --exclude (nothing is recorded). BackendError: the supervisor
        did not take the run (a scheduler's refusal ends the run's log "failed").
    """
    if spec.supervisor.host is not None:
        from ddplaunch.supervise import remote  # Fabric: only when a run goes there

        return remote.start_there(spec, spec_path, opts)
    record = to_scheduler(spec, spec_path, opts)
    if record is not None:
        return record
    return load_run(start_daemon(spec, spec_path, opts).run_id)


def to_scheduler(spec: ClusterSpec, spec_path: str, opts: UpOptions) -> Optional[RunRecord]:
    """`up --detach` on a backend with a scheduler that owns runs (Slurm): hand it the whole run
    (its supervisor runs in the scheduler's job), record it, return the record once the scheduler
    has it; None when the backend has none.

    Raises:
        PlanError: bad --run-id or --exclude. BackendError: the scheduler refused the job (the
        run's log ends "failed").
    """
    spec, run_id = prepared(spec, opts, fresh=True)
    spec = skip_recorded(spec, opts.healthcheck_only).spec  # the allocation excludes nodes remembered bad
    backend = make_backend(spec, RunContext(run_id, run_dir(run_id), StopEvent()))
    scheduler = scheduler_of(backend)
    if scheduler is None:
        backend.close()
        return None
    request, text = detached_request(spec, scheduler, backend, run_id, spec_path, opts)
    record = RunRecord.planned(run_id, spec_path, spec, InJob("", "not submitted yet"),
                               hosts=[h.label for h in backend.hosts(allocate=False)])
    log = EventLog(record.make_dir())
    try:
        log.append(Requested(text))
        try:
            record.placement = scheduler.submit(request, record)
        except DdplaunchError as err:
            record.placement = InJob("", f"refused by the scheduler: {err}")
            log.append(RunEnded(RunState.FAILED, err.exit_code, error=str(err)))
            raise
        finally:
            record.save()
    finally:
        log.close()
    return record


def handed_line(record: RunRecord) -> str:
    """The line that says where a handed-over run went and how to follow it."""
    rid, placement = record.run_id, record.placement
    if isinstance(placement, InJob):
        return f"run {rid}: {placement.where}"
    where = f"on {placement.host}" if isinstance(placement, OnHost) else "on this machine"
    pid = placement.pid if isinstance(placement, (OnHost, Local)) else os.getpid()
    return (f"run {rid}: supervised by pid {pid} {where}; ddplaunch attach {rid} follows it, "
            f"ddplaunch down {rid} stops it")
