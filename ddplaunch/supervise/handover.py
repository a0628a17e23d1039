"""Handing a run to its supervisor: the one place that decides where a run's supervisor runs.

`hand_over` returns once the supervisor has taken the run: on `supervisor.host` when the spec
names one (supervise/remote.py: `OnHost`), in the scheduler's job where the backend can own a whole run
(Slurm's `up --detach`: `InJob`), else a daemon on this machine (daemon.py: `Local`). The run's
record says which (record/runs.py: its `placement`); every reader asks the placement, never the
spec or the backend, where the supervisor is.
"""

from __future__ import annotations

import contextlib
import os

from ddplaunch.backends import make_backend, scheduler_of
from ddplaunch.backends.contract import RunContext, StopEvent
from ddplaunch.errors import DdplaunchError
from ddplaunch.plan.handoff import supervisor_opts
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import EventLog, Requested, RunEnded
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import InJob, Local, OnHost, RunRecord, load_run, run_dir
from ddplaunch.run.hostmemory import skip_recorded
from ddplaunch.run.begin import detached_request, prepared
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.supervise.daemon import start_daemon


def hand_over(spec: ClusterSpec, spec_path: str, opts: UpOptions) -> RunRecord:
    """Hand the run to its supervisor; its record once the supervisor has taken it. The run is
    prepared once (--exclude'd hosts out, its id), here or on the supervisor's host.

    Raises:
        PlanError: bad --run-id or --exclude (nothing is recorded). BackendError: the supervisor
        did not take the run (a scheduler's refusal ends the run's log "failed").
    """
    if spec.supervisor.host is not None:
        from ddplaunch.supervise import remote  # Fabric: only when a run goes there

        return remote.start_there(spec, spec_path, opts)
    spec, run_id = prepared(spec, opts, fresh=True)
    context = RunContext(run_id, run_dir(run_id), StopEvent())
    with contextlib.closing(make_backend(spec, context)) as backend:  # connects to nothing: asked what it can do
        schedules = scheduler_of(backend) is not None
    if schedules:
        return to_scheduler(spec, spec_path, opts, context)
    # the daemon's `begin` takes the run as prepared here: its id, no --exclude left to apply
    return load_run(start_daemon(spec, spec_path, supervisor_opts(opts, run_id)).run_id)


def to_scheduler(spec: ClusterSpec, spec_path: str, opts: UpOptions, context: RunContext) -> RunRecord:
    """`up --detach` on a backend with a scheduler that owns runs (Slurm): hand it the whole run
    (its supervisor runs in the scheduler's job), record it, return the record once the scheduler
    has it. `spec` is prepared (--exclude'd hosts out); `context` names the run.

    Raises:
        BackendError: the scheduler refused the job (the run's log ends "failed").
    """
    spec = skip_recorded(spec, opts.healthcheck_only).spec  # the allocation excludes nodes remembered bad
    with contextlib.closing(make_backend(spec, context)) as backend:
        scheduler = scheduler_of(backend)
        assert scheduler is not None  # hand_over asked
        request, text = detached_request(spec, scheduler, backend, context.run_id, spec_path, opts)
        record = RunRecord.planned(context.run_id, spec_path, spec, InJob("", "not submitted yet"),
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
