"""`up` and `check` in this process: spec -> plans -> backend requests -> events, the one sentence
of ddplaunch.

`begin` records the run (its identity, this process as its supervisor) and opens its event log
with the run's own fold listening (record/view.py); `run_begun` makes the spec's backend and hands
the stages to the run loop (loop.py), then says how the run ended — the summary rendered from the
fold. `run_here` is both; the command line runs them in the run's supervisor (supervise/daemon.py).
`dry_run` is every request `up` would execute, `detached_request` what hands a whole run to a
scheduler. Ctrl-C/SIGTERM stop every host in order. The code here never asks which backend it drives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any, Iterator, Optional

from ddplaunch.backends import make_backend, scheduler_of
from ddplaunch.backends.contract import Launcher, Request, RunContext, Scheduler, StopEvent
from ddplaunch.errors import EXIT_FAILURE, EXIT_INTERRUPTED, DdplaunchError, PlanError, RunNotFoundError
from ddplaunch.output.console import make_console
from ddplaunch.plan.ckptplan import KEY_ENV
from ddplaunch.plan.launch import LaunchPlan, derive_port, stage_port_key
from ddplaunch.plan.stages import UpOptions, exclude_hosts, plan_stage, stages_of
from ddplaunch.record.diagnosis import Gate
from ddplaunch.record.events import EVENTS_FILE, EventLog, HostsExcluded, RunEnded, RunStarted, read_events
from ddplaunch.record.snapshot import Snapshots
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import Local, RunRecord, check_run_id, load_run, new_run_id, open_private, run_dir
from ddplaunch.record.view import RunView, run_state
from ddplaunch.report.evidence import EvidenceFiles
from ddplaunch.report.summary import summarize
from ddplaunch.run.ckptclean import dry_run_text, free_stale, stale_runs
from ddplaunch.run.hostmemory import readmit, skip_recorded
from ddplaunch.run.loop import RunLoop
from ddplaunch.run.runsession import RunSession
from ddplaunch.spec.model import ClusterSpec

__all__ = ["UpOptions", "dry_run", "run_here"]


def prepared(spec: ClusterSpec, opts: UpOptions, fresh: bool) -> tuple[ClusterSpec, str]:
    """The spec without --exclude'd hosts and the run id (a new run's id must be unused)."""
    if opts.exclude:
        spec = exclude_hosts(spec, opts.exclude)
    run_id = check_run_id(opts.run_id, "--run-id") if opts.run_id else new_run_id(spec.name)
    if fresh and run_dir(run_id).exists():
        raise PlanError(f"--run-id {run_id}: a run with this id exists ({run_dir(run_id)}); "
                        "pick another id or leave --run-id out")
    # the key the hosts' checkpoint copies are authenticated with (plan/ckptplan.py): this process's
    # secret, in every node's environment file (never on a command line, nor in the record)
    os.environ.setdefault(KEY_ENV, secrets.token_hex(16))
    return spec, run_id


def _plans(spec: ClusterSpec, backend: Launcher[Any], run_id: str, opts: UpOptions) -> list[LaunchPlan]:
    """Every stage's plan as far as known without running anything: the nodes the backend knows of
    (Slurm's placeholders), ports derived from the run id (marked as checked at launch)."""
    spec = spec.model_copy(update={"hosts": backend.hosts(allocate=False)})
    return [plan_stage(spec, run_id, s, spec.master.port or derive_port(stage_port_key(run_id, s)), opts)
            for s in stages_of(spec, opts)]


def dry_run(spec: ClusterSpec, opts: UpOptions, spec_path: str = "<spec>") -> str:
    """The text `up --dry-run` prints: every request `up` would execute; nothing runs, nothing
    is written. Values only known at launch (a port checked free, Slurm's allocated nodes) are
    marked. With `--detach` on a backend with a scheduler, the one request that hands the run to it
    (elsewhere a detached run executes what an attached one does)."""
    spec, run_id = prepared(spec, opts, fresh=False)
    skipped = skip_recorded(spec, opts.healthcheck_only)
    spec, notes = skipped.spec, "".join(f"# {line}\n" for line in skipped.lines())
    backend = make_backend(spec, RunContext(run_id, run_dir(run_id), StopEvent()))
    scheduler = scheduler_of(backend)
    stale = dry_run_text(spec, stale_runs(spec, spec_path, run_id))  # no scheduler asked: detached runs left out
    if opts.detach and scheduler is not None:
        return notes + detached_request(spec, scheduler, backend, run_id, spec_path, opts)[1] + stale
    return notes + backend.allocation_text() + stale + \
        "".join(backend.render(plan).text() for plan in _plans(spec, backend, run_id, opts))


def detached_request(spec: ClusterSpec, scheduler: Scheduler, backend: Launcher[Any], run_id: str, spec_path: str,
                     opts: UpOptions) -> tuple[Request, str]:
    """The request that hands the run to the scheduler, and its text with what the supervisor
    then runs inside the job."""
    request = scheduler.render_detached(str(spec_path), opts)
    stages = "".join(backend.render(plan).text() for plan in _plans(spec, backend, run_id, opts))
    return request, request.text() + "# inside the job, its supervisor runs each stage as a step of it:\n" + stages


def before_stages(spec: ClusterSpec) -> str:
    """What the backend does before any stage, as the dry run shows it (ssh: how each host is
    reached and where the master is; slurm: the allocation asked for), for `validate`."""
    backend = make_backend(spec, RunContext("validate", run_dir("validate"), StopEvent()))
    try:
        return backend.allocation_text()
    finally:
        backend.close()


@dataclass
class Begun:
    """A run recorded and ready for its loop: the spec (without --exclude'd hosts), its record,
    its event log and the fold of it (what the log held already, and each event appended)."""

    spec: ClusterSpec
    record: RunRecord
    events: EventLog
    view: RunView
    #: what `up` says before anything runs (hosts remembered bad, skipped: run/hostmemory.py)
    notes: list[str] = dataclasses.field(default_factory=list)


def begin(spec: ClusterSpec, spec_path: str, opts: UpOptions, take_over: bool = False) -> Begun:
    """Record a new run (this process its supervisor) and open its event log. With `take_over`,
    a run recorded already (by `up --detach`, on a file system its scheduler's job shares, or by
    this job before a requeue) is this one: its record is kept.

    Raises:
        PlanError: bad --exclude or --run-id, or a run with that id exists (nothing is recorded).
    """
    spec, run_id = prepared(spec, opts, fresh=not take_over)
    skipped = skip_recorded(spec, opts.healthcheck_only)
    spec = skipped.spec
    record = RunRecord.planned(run_id, spec_path, spec, Local.this_process())
    if take_over:
        record = _take_over(record)
    record.save()
    view = RunView.of(read_events(record.dir))
    events = EventLog(record.dir, listeners=[view.add])
    events.listen(Snapshots(record.dir, view, events))  # where readers of a long run start
    events.listen(EvidenceFiles(record.dir))  # the health check's verdict and chart, for people
    events.append(RunStarted(run_id, spec.backend, [h.label for h in spec.hosts], os.getpid(), socket.gethostname(),
                             stages_of(spec, opts)[-1]))
    if skipped.hosts():
        events.append(HostsExcluded(skipped.hosts(), Gate.HOST_HEALTH))
    return Begun(spec, record, events, view, skipped.lines())


def _take_over(record: RunRecord) -> RunRecord:
    """The run recorded under `record`'s id, if one is (what `up --detach` recorded stays: the
    job, its request in the event log); the event log of an earlier try (a requeued job's) is
    kept beside, so that `attach` follows this one from its start."""
    with contextlib.suppress(RunNotFoundError):
        record = load_run(record.run_id)
    events = record.dir / EVENTS_FILE
    if any(isinstance(e, RunStarted) for e in read_events(record.dir)):
        tries = 1
        while events.exists():
            kept = events.with_name(f"events-try{tries}.jsonl")
            if not kept.exists():
                events.rename(kept)
            tries += 1
    return record


def run_here(spec: ClusterSpec, spec_path: str, opts: UpOptions, stream: Optional[IO[str]] = None) -> RunView:
    """Launch in this process: pre-flight, health check (and its gate), then the job, through the
    spec's backend (`run_begun` of a fresh `begin`).

    Returns:
        The fold of the run's events; `exit_code` is the process exit code. Failures of hosts and
        ranks are in it, not raised.
    Raises:
        PlanError: no free master port, bad --exclude or --run-id. BackendError: the backend
        cannot start. The run's event log ends either way.
    """
    return run_begun(begin(spec, spec_path, opts), opts, stream)


def run_begun(begun: Begun, opts: UpOptions, stream: Optional[IO[str]] = None, summary: bool = True) -> RunView:
    """The run loop of a begun run; its event log ends whatever happens (an error is raised after
    `RunEnded` says it), and with `summary` the summary of its fold is written to `stream` (a
    daemon's follower renders it instead: supervise/follow.py)."""
    stream = stream or sys.stdout
    spec, record, events, view = begun.spec, begun.record, begun.events, begun.view
    try:
        with open_private(record.log_path) as log, _stop_on_signals() as stop, \
                contextlib.closing(make_console(stream, log, [h.label for h in spec.hosts], opts.verbose,
                                                events)) as console:
            procs = _procs(spec) if opts.emulate is None else \
                f"{opts.emulate.ranks_per_host} emulated ranks per host (no torch: `up --emulate`)"
            console.note(f"run {record.run_id}: {spec.backend} backend, {procs}; record in {record.dir}")
            for note in begun.notes:
                console.note(note)
            context = RunContext(record.run_id, record.dir, stop, say=events.append)  # Slurm says its allocation
            with contextlib.closing(make_backend(spec, context)) as backend:
                # what earlier runs of this spec, killed outright, left in the hosts' RAM
                for line in free_stale(spec, backend, stale_runs(spec, record.spec_path, record.run_id, backend)):
                    console.note(line)
                RunLoop(RunSession(spec, backend, opts, console, stop, record.run_id, record.dir, events, view)).run()
    except BaseException as err:
        interrupted = isinstance(err, KeyboardInterrupt)
        code = EXIT_INTERRUPTED if interrupted else getattr(err, "exit_code", EXIT_FAILURE)
        events.append(RunEnded(RunState.INTERRUPTED if interrupted else RunState.FAILED, code,
                               error=str(err) if isinstance(err, DdplaunchError) else f"{type(err).__name__}: {err}"))
        events.close()
        raise
    code = view.exit_code
    if opts.healthcheck_only and code == 0:  # a check that passes readmits the hosts it passed
        readmit(spec, view.passed)
    events.append(RunEnded(run_state(code), code))
    events.close()
    if summary:
        stream.write(summarize(view) + "\n")
        stream.flush()
    return view


def _procs(spec: ClusterSpec) -> str:
    """`2 proc per host`, or `1+3+1 procs per host` on a mixed fleet."""
    counts = [str(spec.nproc_of(h)) for h in spec.hosts] or [str(spec.nproc_per_node)]
    return f"{counts[0]} proc per host" if len(set(counts)) == 1 else f"{'+'.join(counts)} procs per host"


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[StopEvent]:
    """An event set by SIGINT/SIGTERM while the run is in progress (main thread only); the hang
    watchdog sets it too, with a cause, which makes the run a failure rather than an interrupt."""
    stop = StopEvent()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        stop.set()
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
