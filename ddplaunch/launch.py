"""`up` and `check`: spec -> plans -> backend requests -> report, the one sentence of ddplaunch.

`up` records the run, asks the backend for its hosts (Slurm: the allocation), runs the
pre-flight gate, then each stage: plan (pure) -> `backend.render` -> `backend.launch`, the job
under the hang watchdog, the health check followed by its gate (which may stop the run or drop
hosts). An allocation requeued under a stage (Slurm) runs every stage again. Ctrl-C/SIGTERM stop
every host in order. The code here never asks which backend it drives.
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
from ddplaunch.backends.contract import Backend
from ddplaunch.console import LineSink, make_sink
from ddplaunch.errors import EXIT_INTERRUPTED, PlanError
from ddplaunch.gate import exclude_hosts, healthcheck_gate, preflight_gate, preflight_wanted
from ddplaunch.hostcmd import marked, parse_answer
from ddplaunch.plan import LaunchPlan, derive_port, make_plan, master_addr
from ddplaunch.report import exit_code, summarize
from ddplaunch.results import StageResult, StopEvent, describe_exit
from ddplaunch.runs import RunRecord, check_run_id, home, new_run_id, open_private, write_private
from ddplaunch.spec import ClusterSpec
from ddplaunch.torchrun_logs import mismatch_lines, store_errors
from ddplaunch.watchdog import HangWatchdog

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
    verbose: bool = False


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


def healthcheck_wanted(spec: ClusterSpec, opts: UpOptions) -> bool:
    return spec.healthcheck.enabled and not opts.skip_healthcheck


def stages_of(spec: ClusterSpec, opts: UpOptions) -> list[str]:
    """The launches `up` makes, in order: one ("job", the health check inline) unless the spec
    asks for the health check as a launch of its own (`healthcheck.launch: separate`)."""
    if opts.healthcheck_only:
        if not healthcheck_wanted(spec, opts):
            raise PlanError("nothing to run: the health check is disabled (healthcheck.enabled: false) "
                            "and `check` runs no job")
        return ["healthcheck"]
    if healthcheck_wanted(spec, opts) and spec.healthcheck.launch == "separate":
        return ["healthcheck", "job"]
    return ["job"]


def plan_stage(spec: ClusterSpec, run_id: str, stage: str, port: int, opts: UpOptions) -> LaunchPlan:
    """One launch's plan: `check` always tests host pairs; `up` when `healthcheck.pairwise`.

    `check` with one process per host starts the health check directly (the torchrun env contract
    set by the launcher, as the localization launches do): a torchrun agent would import torch a
    second time on every host, about 40 % of a 4-host check here, to start one process. The
    pre-flight has already checked torch and the master's port; `up` always runs torchrun.
    """
    inline = stage == "job" and healthcheck_wanted(spec, opts) and spec.healthcheck.launch == "inline"
    direct = opts.healthcheck_only and spec.nproc_per_node == 1
    return make_plan(spec, run_id, stage, port, opts.job_args, inline_healthcheck=inline, direct=direct,
                     pairwise=opts.healthcheck_only or spec.healthcheck.pairwise)


def dry_run(spec: ClusterSpec, opts: UpOptions) -> str:
    """The text `up --dry-run` prints: every request `up` would execute; nothing runs, nothing
    is written. Values only known at launch (a port checked free, Slurm's allocated nodes) are
    marked. With `--detach`, the one request that hands the run to the scheduler."""
    if opts.exclude:
        spec = exclude_hosts(spec, opts.exclude)
    backend = get_backend(spec)
    run_id = check_run_id(opts.run_id) if opts.run_id else new_run_id(spec.name)
    if opts.detach:
        return _detached_request(spec, backend, run_id, opts).text()
    backend.start_run(run_id, home() / "runs" / run_id, StopEvent())
    spec = spec.model_copy(update={"hosts": backend.hosts(allocate=False)})
    text = backend.allocation_text()
    for stage in stages_of(spec, opts):
        port = spec.master.port or derive_port(f"{run_id}:{stage}")
        text += backend.render(plan_stage(spec, run_id, stage, port, opts)).text()
    return text


def _detached_request(spec: ClusterSpec, backend: Backend, run_id: str, opts: UpOptions) -> Any:
    """Every stage's plan (ports derived from the run id: no launcher probes them), handed to the
    backend as one detached request."""
    backend.start_run(run_id, home() / "runs" / run_id, StopEvent())
    spec = spec.model_copy(update={"hosts": backend.hosts(allocate=False)})
    plans = [plan_stage(spec, run_id, s, spec.master.port or derive_port(f"{run_id}:{s}"), opts)
             for s in stages_of(spec, opts)]
    return backend.render_detached(plans)


def detach(spec: ClusterSpec, spec_path: str, opts: UpOptions, stream: Optional[IO[str]] = None) -> str:
    """`up --detach`: hand the whole run to a scheduler that owns it, record it, return at once.

    Raises:
        PlanError: the backend has no scheduler (nothing is recorded), bad --run-id or --exclude.
        BackendError: the scheduler refused the job (the record ends "failed").
    """
    if opts.exclude:
        spec = exclude_hosts(spec, opts.exclude)
    run_id = check_run_id(opts.run_id, "--run-id") if opts.run_id else new_run_id(spec.name)
    if (home() / "runs" / run_id).exists():
        raise PlanError(f"--run-id {run_id}: a run with this id exists ({home() / 'runs' / run_id}); "
                        "pick another id or leave --run-id out")
    backend = get_backend(spec)
    request = _detached_request(spec, backend, run_id, opts)
    record = RunRecord(run_id=run_id, spec_path=str(spec_path), backend=spec.backend,
                       hosts=[h.label for h in backend.hosts(allocate=False)], spec=spec.redacted(),
                       plan_text=request.text())
    record.extra["base_dir"] = spec.base_dir
    record.state = "submitted"
    record.save()
    try:
        where = backend.detach(request, record.dir)
    except BaseException:
        record.state, record.ended_at = "failed", time.time()
        record.save()
        raise
    record.extra["detached"] = where
    record.save()
    (stream or sys.stdout).write(f"run {run_id}: {where}\n")
    return where


def up(spec: ClusterSpec, spec_path: str, opts: UpOptions, stream: Optional[IO[str]] = None) -> RunReport:
    """Launch: pre-flight, health check (and its gate), then the job, through the spec's backend.

    Returns:
        The report; `report.exit_code` is the process exit code. Failures of hosts and ranks
        are in the report, not raised.
    Raises:
        PlanError: no free master port, bad --exclude or --run-id. BackendError: the backend
        cannot start. The run's record ends in a final state either way.
    """
    stream = stream or sys.stdout
    if opts.exclude:
        spec = exclude_hosts(spec, opts.exclude)
    run_id = check_run_id(opts.run_id, "--run-id") if opts.run_id else new_run_id(spec.name)
    if (home() / "runs" / run_id).exists():
        raise PlanError(f"--run-id {run_id}: a run with this id exists ({home() / 'runs' / run_id}); "
                        "pick another id or leave --run-id out")
    backend = get_backend(spec)
    record = RunRecord(run_id=run_id, spec_path=str(spec_path), backend=spec.backend,
                       hosts=[h.label for h in spec.hosts], spec=spec.redacted(), plan_text="")
    record.extra["base_dir"] = spec.base_dir
    record.state = "running"
    record.save()
    report = RunReport(run_id=run_id, final_stage=stages_of(spec, opts)[-1])
    try:
        with open_private(record.log_path) as log, _stop_on_signals() as stop, contextlib.closing(backend), \
                contextlib.closing(make_sink(stream, log, [h.label for h in spec.hosts], opts.verbose)) as sink:
            sink.note(f"run {run_id}: {spec.backend} backend, {spec.nproc_per_node} proc per host; "
                      f"record in {record.dir}")
            backend.start_run(run_id, record.dir, stop)
            _Run(spec, backend, opts, sink, stop, record, report).run()
    except BaseException:
        record.state = "interrupted" if isinstance(sys.exc_info()[1], KeyboardInterrupt) else "failed"
        record.ended_at = time.time()
        record.save()
        raise
    record.state = {0: "ok", EXIT_INTERRUPTED: "interrupted"}.get(report.exit_code, "failed")
    record.ended_at = time.time()
    record.save()
    stream.write(summarize(run_id, report.stages, report.exit_code, report.blocked) + "\n")
    stream.flush()
    return report


class _Run:
    """One `up` in progress: the stages, their gates, and the record kept up to date."""

    def __init__(self, spec: ClusterSpec, backend: Backend, opts: UpOptions, sink: LineSink,
                 stop: StopEvent, record: RunRecord, report: RunReport):
        self.spec, self.backend, self.opts, self.sink, self.stop = spec, backend, opts, sink, stop
        self.record, self.report, self.run_id = record, report, record.run_id
        self._moved: set[tuple[str, int]] = set()  # (stage, port) taken instead of a busy derived port
        #: (stage, master, port) the pre-flight just found free (the master listened on it): that
        #: launch takes it without probing it again
        self._proven: Optional[tuple[str, str, int]] = None

    def run(self) -> None:
        restarts = 0
        while True:
            hosts = self.backend.hosts()
            spec = self.spec.model_copy(update={"hosts": hosts})
            if [h.label for h in hosts] != self.record.hosts:
                self.record.hosts = [h.label for h in hosts]
                self.sink.note(f"hosts: {', '.join(self.record.hosts)}")
            text = self.backend.allocation_text()
            if text and not self.record.plan_text:
                self.record.plan_text = text
            if preflight_wanted(spec, self.opts.healthcheck_only):
                # a derived port is probed (and moved on when busy) first, so the pre-flight tests
                # the port the launch uses; an explicit master.port is the pre-flight's to report
                stage = stages_of(spec, self.opts)[0]
                first = spec.master.port or self._free_port(spec, stage)
                spec, pf = preflight_gate(spec, self.backend, self.run_id, first, self.sink, self.record.dir)
                self.report.preflight = pf.to_dict()
                if spec is None:
                    self.report.blocked = "pre-flight"
                    return
                self._proven = (stage, master_addr(spec), first)
            if not self._stages(spec):
                return
            restarts += 1
            self.sink.note(f"allocation requeued (restart {restarts}): every stage runs again")
            self.report.stages = []

    def _stages(self, spec: ClusterSpec) -> bool:
        """Every launch in order; True when the allocation was requeued under one (start over).
        A launch that ran the health check is gated: stop, go on, or launch again without the
        hosts it found bad (`healthcheck.on_fail: exclude`)."""
        stages = stages_of(spec, self.opts)
        while stages:
            stage = stages[0]
            plan = plan_stage(spec, self.run_id, stage, self._free_port(spec, stage), self.opts)
            request = self.backend.render(plan)
            self.record.plan_text += request.text()
            self.record.save()
            result = self._launch(spec, request)
            self.report.stages.append(result)
            self.record.stages.append(result.to_dict())
            self.record.save()
            if result.requeued:
                return True
            ran_healthcheck = stage == "healthcheck" or "--no-healthcheck" not in plan.nodes[0].args
            payload = self._healthcheck_payload() if ran_healthcheck else None
            self.report.healthcheck = payload if ran_healthcheck else self.report.healthcheck
            if ran_healthcheck and not (stage == "job" and payload and payload.get("ok")):
                gated, loc = healthcheck_gate(spec, self.backend, self.run_id, result, payload, self.stop,
                                              self.sink, self.record.dir)
                self.report.localization = loc.to_dict() if loc else self.report.localization
                if gated is None:
                    self.report.blocked = self.report.blocked or "health check"
                    return False
                if gated is not spec:
                    self.report.excluded += [h.label for h in spec.hosts if h not in gated.hosts]
                    self.record.plan_text += "# re-planned without excluded hosts\n"
                    spec = gated
                    if stage == "job":  # the job never started: launch it again on the hosts left
                        continue
            elif not result.ok:
                return False
            stages = stages[1:]
        return False

    def _launch(self, spec: ClusterSpec, request: Any) -> StageResult:
        """One stage; the job under the hang watchdog, then with restarts and found errors attached."""
        plan = request.plan
        self.sink.new_launch()
        self.sink.note(f"stage {plan.stage}: master {plan.master_addr}:{plan.master_port}")
        first_finding = len(self.sink.findings)
        first_exit = len(self.sink.payload_list("RANKEXIT"))
        watchdog = None
        if plan.stage == "job" and spec.job.hang_timeout:
            watchdog = HangWatchdog(self.backend, spec, plan, self.sink, self.stop, self.record.dir / "stacks",
                                    spec.job.hang_timeout)
        with watchdog or contextlib.nullcontext():
            result = self.backend.launch(request, self.sink, self.stop)
        found = self.sink.findings[first_finding:]
        result.diagnosis += watchdog.diagnosis if watchdog else []
        result.diagnosis += _aborted_after_return(self.sink.payload_list("RANKEXIT")[first_exit:], result)
        result.diagnosis += mismatch_lines(found) + store_errors(found)
        if plan.stage == "job" and spec.job.max_restarts and not result.interrupted:
            _count_restarts(self.backend, plan, result)
        return result

    def _healthcheck_payload(self) -> Optional[dict[str, Any]]:
        payload = self.sink.payload("HEALTHCHECK")
        if payload is not None:
            write_private(self.record.dir / "healthcheck.json", json.dumps(payload, indent=2, sort_keys=True))
        return payload

    def _free_port(self, spec: ClusterSpec, stage: str) -> int:
        addr = master_addr(spec)
        proven, self._proven = self._proven, None
        if proven is not None and proven[:2] == (stage, addr):
            return proven[2]
        if spec.master.port:
            if not self.backend.port_free(addr, spec.master.port):
                raise PlanError(f"master.port {spec.master.port} is already in use on {addr}; free it or "
                                "remove master.port so ddplaunch picks a free one")
            return spec.master.port
        for attempt in range(PORT_ATTEMPTS):
            port = derive_port(f"{self.run_id}:{stage}", attempt)
            if self.backend.port_free(addr, port):
                if attempt and (stage, port) not in self._moved:
                    self._moved.add((stage, port))
                    self.sink.note(f"master port {derive_port(f'{self.run_id}:{stage}')} is in use on {addr}: "
                                   f"using port {port}")
                return port
        raise PlanError(f"no free master port on {addr} after {PORT_ATTEMPTS} tries; set master.port")


def _aborted_after_return(exits: list[dict[str, Any]], result: StageResult) -> list[str]:
    """Ranks whose script had returned (the entry script said so) yet died by a signal: the job
    finished, the process did not (torch's threads at interpreter exit)."""
    finished = {e.get("rank"): e.get("code") for e in exits}
    out = []
    for o in result.outcomes:
        if o.failed_rank is not None and o.rank_exit_code is not None and o.rank_exit_code < 0 \
                and finished.get(o.failed_rank) == 0:
            out.append(f"rank {o.failed_rank} on {o.host} finished its script (exit 0), then died at "
                       f"interpreter exit ({describe_exit(o.rank_exit_code)}): the job's work is done")
    return out


def _count_restarts(backend: Backend, plan: LaunchPlan, result: StageResult) -> None:
    """Each node's worker restarts, from the attempt_N directories torchrun writes under --log-dir."""
    by_host = {n.host_label: n for n in plan.nodes}
    nonces: dict[str, str] = {}

    def command(host: Any) -> str:
        node = by_host.get(host.label)
        if node is None or node.torchrun is None:
            return "true"
        # torchrun makes a fresh <rdzv id>_<random>/ per start: count the attempts in the newest
        count = (f'd=$(ls -td {node.torchrun.log_dir}/*/ 2>/dev/null | head -1); '
                 f'if [ -n "$d" ]; then ls -d "$d"attempt_* | wc -l; else echo 0; fi')
        text, nonces[host.label] = marked(count)
        return text

    hosts = [n.host for n in plan.nodes if n.host is not None]
    try:
        answers = backend.probe(command, timeout=15, hosts=hosts)
    except Exception:  # noqa: BLE001 - the count is a nicety; the run's outcome stands without it
        return
    for host, answer, err in answers:
        node = by_host.get(host.label)
        if node is None or err is not None or answer is None or host.label not in nonces:
            continue
        attempts = parse_answer(answer[1], nonces[host.label])
        if isinstance(attempts, int):
            result.outcomes[node.node_rank].restarts = max(0, attempts - 1)


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
