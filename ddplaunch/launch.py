"""`up`: spec -> plans -> backend -> report, the one sentence of ddplaunch.

`plan_run` is pure apart from the master-port probe; `up` creates the run record, runs the
health check and then the job through the same backend, stops at the first failed stage and
turns Ctrl-C/SIGTERM into an orderly stop of every host.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Iterator, Optional

from ddplaunch.backends import get_backend
from ddplaunch.backends.base import Backend, LineSink, StageResult, StopEvent
from ddplaunch.errors import PlanError
from ddplaunch.live import make_sink
from ddplaunch.gate import exclude_hosts, healthcheck_gate, preflight_gate, preflight_wanted
from ddplaunch.plan import LaunchPlan, derive_port, make_plan, master_addr, render_plan
from ddplaunch.report import exit_code, summarize
from ddplaunch.runs import RunRecord, new_run_id
from ddplaunch.spec import ClusterSpec
from ddplaunch.watchdog import HangWatchdog, mismatch_lines, store_errors

PORT_ATTEMPTS = 20


@dataclass
class UpOptions:
    """What the `up`/`check` command line adds to the spec."""

    skip_healthcheck: bool = False
    healthcheck_only: bool = False
    job_args: Optional[list[str]] = None
    run_id: Optional[str] = None
    detach: bool = False
    exclude: list[str] = field(default_factory=list)


@dataclass
class RunReport:
    """The outcome of one `up`."""

    run_id: str
    final_stage: str = "job"
    stages: list[StageResult] = field(default_factory=list)
    healthcheck: Optional[dict[str, Any]] = None
    preflight: Optional[dict[str, Any]] = None
    localization: Optional[dict[str, Any]] = None
    excluded: list[str] = field(default_factory=list)
    #: What stopped the run before its last stage ("pre-flight", "health check"), if anything.
    blocked: Optional[str] = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.stages, self.final_stage, self.blocked)


def stages_of(spec: ClusterSpec, opts: UpOptions) -> list[str]:
    """The stages `up` runs, in order."""
    stages = []
    if spec.healthcheck.enabled and not opts.skip_healthcheck:
        stages.append("healthcheck")
    if not opts.healthcheck_only:
        stages.append("job")
    if not stages:
        raise PlanError("nothing to run: the health check is disabled (healthcheck.enabled: false "
                        "or --skip-healthcheck) and `check` runs no job")
    return stages


def plan_run(spec: ClusterSpec, run_id: str, opts: UpOptions,
             backend: Optional[Backend] = None) -> list[LaunchPlan]:
    """Every stage's plan. Without a backend (dry run) nothing is probed: ports are derived."""
    plans = []
    for stage in stages_of(spec, opts):
        port = spec.master.port or derive_port(f"{run_id}:{stage}")
        if backend is not None:
            port = _free_port(spec, run_id, stage, backend)
        plans.append(make_plan(spec, run_id, stage, port, opts.job_args))
    return plans


def dry_run(spec: ClusterSpec, opts: UpOptions) -> str:
    """The text `up --dry-run` prints: the plan `up` would execute, nothing run."""
    run_id = opts.run_id or new_run_id(spec.name)
    return render_request(spec, run_id, plan_run(spec, run_id, opts))


def render_request(spec: ClusterSpec, run_id: str, plans: list[LaunchPlan]) -> str:
    """What the backend executes, as text: per-host lines, or the batch script and sbatch command."""
    if spec.backend == "slurm":
        from ddplaunch.slurm_render import render_sbatch, sbatch_options

        return render_sbatch(spec, run_id, sbatch_options(plans)).render()
    return render_plan(plans)


def detach(spec: ClusterSpec, spec_path: str, opts: UpOptions, stream: Optional[IO[str]] = None) -> str:
    """`up --detach` (backend slurm only): submit the batch job, record it, return its job id."""
    if spec.backend != "slurm":
        raise PlanError(f"--detach needs backend: slurm (this spec has backend: {spec.backend})")
    from ddplaunch.backends.slurm import SlurmBackend
    from ddplaunch.slurm_render import render_sbatch, sbatch_options

    run_id = opts.run_id or new_run_id(spec.name)
    request = render_sbatch(spec, run_id, sbatch_options(plan_run(spec, run_id, opts)))
    record = RunRecord(run_id=run_id, spec_path=spec_path, backend=spec.backend,
                       hosts=[h.label for h in spec.hosts], spec=spec.model_dump(mode="json"),
                       plan_text=request.render())
    record.state = "submitted"
    record.save()
    job = SlurmBackend(spec).submit(request)
    record.extra["slurm_job_id"] = job.job_id
    record.save()
    (stream or sys.stdout).write(f"run {run_id}: submitted batch job {job.job_id}; output {job.output_file}\n")
    return job.job_id


def up(spec: ClusterSpec, spec_path: str, opts: UpOptions,
       stream: Optional[IO[str]] = None) -> RunReport:
    """Launch: pre-flight, health check (and its gate), then the job, through the spec's backend.

    Returns:
        The report; `report.exit_code` is the process exit code. Failures of hosts and ranks
        are in the report, not raised.
    Raises:
        PlanError: no free master port, bad --exclude. BackendError: the backend cannot start.
    """
    stream = stream or sys.stdout
    if opts.exclude:
        spec = exclude_hosts(spec, opts.exclude)
    backend = get_backend(spec)
    run_id = opts.run_id or new_run_id(spec.name)
    record = RunRecord(run_id=run_id, spec_path=spec_path, backend=spec.backend,
                       hosts=[h.label for h in spec.hosts], spec=spec.model_dump(mode="json"), plan_text="")
    record.state = "running"
    record.save()
    report = RunReport(run_id=run_id, final_stage=stages_of(spec, opts)[-1])
    with open(record.log_path, "a") as log, _stop_on_signals() as stop, contextlib.closing(backend), \
            contextlib.closing(make_sink(stream, log, [h.label for h in spec.hosts])) as sink:
        sink.note(f"run {run_id}: {spec.backend} backend, {len(spec.hosts)} host(s) x "
                  f"{spec.nproc_per_node} proc; record in {record.dir}")

        def on_stage(plan: LaunchPlan, result: StageResult, sink: LineSink) -> None:
            if plan.stage == "healthcheck":
                report.healthcheck = _healthcheck_payload(sink, record)
            record.stages.append(result.to_dict())
            record.save()

        if preflight_wanted(spec, opts.healthcheck_only):
            first_port = spec.master.port or derive_port(f"{run_id}:{stages_of(spec, opts)[0]}")
            spec, pf = preflight_gate(spec, backend, run_id, first_port, sink, record.dir)
            report.preflight = pf.to_dict()
            if spec is None:
                report.blocked = "pre-flight"
        if spec is not None:
            plans = plan_run(spec, run_id, opts, backend)
            record.plan_text = render_request(spec, run_id, plans)
            record.save()
            if getattr(backend, "single_submission", False):  # Slurm: both stages in one batch job
                report.stages = backend.run_all(plans, sink, stop, on_stage)
            else:
                _run_gated(spec, run_id, opts, plans, backend, sink, stop, on_stage, report, record)
    record.state = {0: "ok", 130: "interrupted"}.get(report.exit_code, "failed")
    record.ended_at = time.time()
    record.save()
    stream.write(summarize(run_id, report.stages, report.exit_code, report.blocked) + "\n")
    stream.flush()
    return report


def _run_gated(spec: ClusterSpec, run_id: str, opts: UpOptions, plans: list[LaunchPlan], backend: Backend,
               sink: LineSink, stop: StopEvent, on_stage: Any, report: RunReport,
               record: RunRecord) -> None:
    """Stage by stage; after the health check its gate may stop the run or drop bad hosts."""
    for plan in plans:
        if plan.stage == "job" and [n.host for n in plan.nodes] != list(spec.hosts):
            plan = make_plan(spec, run_id, "job", _free_port(spec, run_id, "job", backend), opts.job_args)
            record.plan_text += "\n# re-planned without excluded hosts\n" + render_request(spec, run_id, [plan])
            record.save()
        result = _run_watched(spec, plan, backend, sink, stop, on_stage, record)
        report.stages.append(result)
        if plan.stage == "healthcheck":
            gated, loc = healthcheck_gate(spec, backend, run_id, result, stop, sink, record.dir)
            report.localization = loc.to_dict() if loc else None
            if gated is None:
                report.blocked = report.blocked or ("health check" if result.ok else None)
                return
            if gated is not spec:
                report.excluded = [h.label for h in spec.hosts if h not in gated.hosts]
            spec = gated
        elif not result.ok:
            return


def _run_watched(spec: ClusterSpec, plan: LaunchPlan, backend: Backend, sink: LineSink, stop: StopEvent,
                 on_stage: Any, record: RunRecord) -> StageResult:
    """One stage; for the job, under the hang watchdog, then with restarts and found errors attached."""
    first_finding = len(sink.findings)
    hang_timeout = spec.job.hang_timeout if plan.stage == "job" else None
    results: list[StageResult] = []

    def attach(plan: LaunchPlan, result: StageResult, sink: LineSink) -> None:
        # before on_stage saves the record, so the record holds the diagnosis too
        found = sink.findings[first_finding:]
        result.diagnosis += watchdog.diagnosis if watchdog else []
        result.diagnosis += mismatch_lines(found) + store_errors(found)
        if plan.stage == "job" and spec.job.max_restarts and not result.interrupted:
            _count_restarts(backend, plan, result)
        results.append(result)
        on_stage(plan, result, sink)

    watchdog = None
    if hang_timeout:
        watchdog = HangWatchdog(backend, spec, plan, sink, stop, record.dir / "stacks", hang_timeout)
        with watchdog:
            backend.run_all([plan], sink, stop, attach)
    else:
        backend.run_all([plan], sink, stop, attach)
    return results[0]


def _count_restarts(backend: Backend, plan: LaunchPlan, result: StageResult) -> None:
    """Each node's worker restarts, from the attempt_N directories torchrun writes under --log-dir."""
    by_host = {n.host.label: n for n in plan.nodes}

    def command(host: Any) -> str:
        node = by_host.get(host.label)
        if node is None:
            return "echo 0"
        # torchrun makes a fresh <rdzv id>_<random>/ per start: count the attempts in the newest
        log_dir = f"{node.run_dir}/torchrun-{plan.stage}-node{node.node_rank}"
        return (f'd=$(ls -td {log_dir}/*/ 2>/dev/null | head -1); '
                f'if [ -n "$d" ]; then ls -d "$d"attempt_* | wc -l; else echo 0; fi')

    try:
        answers = backend.run_short(command, timeout=15)
    except Exception:  # noqa: BLE001 - the count is a nicety; the run's outcome stands without it
        return
    for host, answer, err in answers:
        node = by_host.get(host.label)
        if node is None or err is not None or answer is None:
            continue
        try:
            attempts = int(answer[1].strip() or 0)
        except ValueError:
            continue
        result.outcomes[node.node_rank].restarts = max(0, attempts - 1)


def _free_port(spec: ClusterSpec, run_id: str, stage: str, backend: Backend) -> int:
    addr = master_addr(spec)
    if spec.master.port:
        if not backend.port_free(addr, spec.master.port):
            raise PlanError(f"master.port {spec.master.port} is already in use on {addr}; free it or "
                            "remove master.port so ddplaunch picks a free one")
        return spec.master.port
    for attempt in range(PORT_ATTEMPTS):
        port = derive_port(f"{run_id}:{stage}", attempt)
        if backend.port_free(addr, port):
            return port
    raise PlanError(f"no free master port on {addr} after {PORT_ATTEMPTS} tries; set master.port")


def _healthcheck_payload(sink: LineSink, record: RunRecord) -> Optional[dict[str, Any]]:
    payload = sink.payload("HEALTHCHECK")
    if payload is None:
        return None
    (record.dir / "healthcheck.json").write_text(json.dumps(payload, indent=2, sort_keys=True))
    return payload


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
