"""ddplaunch from Python: `up`, `check`, `submit` and `load_spec` for notebooks, pipelines and tests.

    import ddplaunch
    report = ddplaunch.up("cluster.yaml", job_args=["--epochs", "2"])
    report.exit_code, report.run_id, report.stages[-1].outcomes, report.healthcheck

    run = ddplaunch.submit("cluster.yaml")   # a supervisor takes the run; this process may end
    run.run_id, run.state, run.events(), run.wait(), run.stop()   # run.state: a RunState

The same runs as the command line: the spec is read and checked as `ddplaunch validate` does,
every line goes to `stream` (default: this process's stdout), and the run is recorded under
`$DDPLAUNCH_HOME/runs/<run id>/` (`ddplaunch status/logs RUN_ID` work on it). Failures of hosts
and ranks are in the report, not raised; bad input raises SpecError or PlanError, a backend that
cannot start BackendError (all DdplaunchError, ddplaunch/errors.py). Ctrl-C in the main thread
ends the run (exit code 130 in the report).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence, Union

from ddplaunch.errors import BackendError, PlanError
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import Event, RunEnded
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import InJob, OnHost, check_run_id, load_run, new_run_id
from ddplaunch.record.view import RunView
from ddplaunch.report.status import died_unended
from ddplaunch.run import begin
from ddplaunch.spec.load import load_spec as _load_file, load_spec_data
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.supervise import commands, daemon
from ddplaunch.supervise.follow import run_events
from ddplaunch.supervise.handover import hand_over

#: What `up` and `check` return: the fold of the run's events (record/view.py).
RunReport = RunView
SpecLike = Union[str, Path, Mapping[str, Any], ClusterSpec]
#: The keyword options of `up` and `check`, as the command line's flags name them.
OPTIONS = ("skip_healthcheck", "run_id", "exclude", "verbose")


def load_spec(spec: SpecLike, base_dir: Union[str, Path, None] = None) -> ClusterSpec:
    """A validated spec from a cluster.yaml path, or from the data such a file holds (relative
    paths then taken from `base_dir`, default the current directory); a ClusterSpec as it is.

    Raises:
        SpecError: what `ddplaunch validate` would print, one line.
    """
    if isinstance(spec, ClusterSpec):
        return spec
    if isinstance(spec, Mapping):
        return load_spec_data(spec, base_dir or Path.cwd())
    return _load_file(spec)


def up(spec: SpecLike, *, job_args: Optional[Sequence[str]] = None, dry_run: bool = False,
       stream: Optional[IO[str]] = None, **options: Any) -> RunReport:
    """`ddplaunch up`: pre-flight, health check, then the job, on every host of `spec`.

    Args:
        spec: a cluster.yaml path, the data of one, or a ClusterSpec.
        job_args: replace `job.args` (what follows `--` on the command line).
        dry_run: plan and render every request without running anything; the report's
            `plan_text` is what `up --dry-run` prints.
        stream: where the run's lines go (default: sys.stdout).
        options: skip_healthcheck (bool), run_id (str), exclude (host names), verbose (bool).
    Returns:
        The run's report: `exit_code` (0, 1, 130), `run_id`, `stages` (every node's outcome),
        `healthcheck` (the verdict), `recoveries`.
    Raises:
        SpecError, PlanError: bad input. BackendError: the backend could not start.
    """
    return _run(spec, job_args, dry_run, stream, options, healthcheck_only=False)


class Run:
    """A supervised run: from `submit`, or `Run(run_id)` for any run recorded on this machine —
    supervised here, by its scheduler's job (Slurm's `up --detach`) or on `supervisor.host`. What
    it says is read from the run's event log (over SSH from the supervisor's host, for the last)."""

    def __init__(self, run_id: str):
        self.run_id = check_run_id(run_id)

    @property
    def state(self) -> RunState:
        """Where the run stands, as a value (ddplaunch/record/results.py): SUBMITTED while a
        scheduler has not started the run's job, RUNNING, then how it ended (OK, FAILED,
        INTERRUPTED; CANCELLED or UNKNOWN when its scheduler said it); UNKNOWN as well when its
        supervisor died without ending it (`ddplaunch status RUN_ID` says so in words)."""
        record = load_run(self.run_id)
        if isinstance(record.placement, OnHost):
            return RunView.of(run_events(record)).state
        commands.settle(record)
        view = commands.view_of(record)
        if view.ended is None and died_unended(view, commands.supervisor_alive(record)):  # asked only then
            return RunState.UNKNOWN
        return view.state

    def events(self) -> list[Event]:
        """Every event logged so far (ddplaunch/record/events.py: typed, oldest first)."""
        return list(run_events(load_run(self.run_id)))

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until the run ends; its exit code (0, 1, 130).

        Raises:
            TimeoutError: not ended within `timeout` seconds. BackendError: its supervisor died
            without ending it (`ddplaunch down RUN_ID` ends what is left), or its host stopped
            answering.
        """
        began = time.monotonic()
        for event in run_events(load_run(self.run_id), live=True, timeout=timeout):
            if isinstance(event, RunEnded):
                return event.exit_code
        if timeout is not None and time.monotonic() - began >= timeout:
            raise TimeoutError(f"run {self.run_id} still runs after {timeout}s")
        raise BackendError(f"the supervisor of run {self.run_id} died without ending it; "
                           f"`ddplaunch down {self.run_id}` ends what is left")

    def stop(self, grace: float = 30.0) -> bool:
        """Stop the run (every host in order, as Ctrl-C); True once its supervisor has ended it
        (a scheduler's job or a supervisor on another host: once `down` there has answered)."""
        record = load_run(self.run_id)
        placement = record.placement
        if isinstance(placement, OnHost):
            there = commands.elsewhere(record, ["down", record.run_id])
            return there is not None and there.answered
        if isinstance(placement, InJob):
            commands.down(record)
            return True
        return daemon.stop(daemon.Supervised.of(record.run_id, placement), grace)


def submit(spec: SpecLike, *, job_args: Optional[Sequence[str]] = None, **options: Any) -> Run:
    """`ddplaunch up --detach` from Python: the run's supervisor takes it — the scheduler's job on
    Slurm, a daemon on `supervisor.host` when the spec names one, else a daemon on this machine —
    and this returns once it has; the run goes on whatever becomes of this process.

    A supervisor on this machine is forked from this process: call it while no other thread of
    yours holds a lock (the usual case). Options as `up`'s.

    Raises:
        SpecError, PlanError: bad input (nothing is recorded). BackendError: the supervisor did not start.
    """
    opts = _options(job_args, options, healthcheck_only=False)
    return Run(hand_over(load_spec(spec), _spec_path(spec), opts).run_id)


def check(spec: SpecLike, *, dry_run: bool = False, stream: Optional[IO[str]] = None,
          **options: Any) -> RunReport:
    """`ddplaunch check`: the pre-flight, the health check and the pair tests, no job."""
    return _run(spec, None, dry_run, stream, options, healthcheck_only=True)


def _run(spec: SpecLike, job_args: Optional[Sequence[str]], dry_run: bool, stream: Optional[IO[str]],
         options: dict[str, Any], healthcheck_only: bool) -> RunReport:
    opts = _options(job_args, options, healthcheck_only)
    loaded = load_spec(spec)
    if dry_run:
        opts.run_id = opts.run_id or new_run_id(loaded.name)
        return RunView.of_dry_run(opts.run_id, begin.dry_run(loaded, opts))
    return begin.run_here(loaded, _spec_path(spec), opts, stream=stream)


def _options(job_args: Optional[Sequence[str]], options: dict[str, Any], healthcheck_only: bool) -> UpOptions:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise PlanError(f"unknown option {', '.join(unknown)}; the options are {', '.join(OPTIONS)}")
    return UpOptions(healthcheck_only=healthcheck_only, job_args=list(job_args) if job_args else None,
                     skip_healthcheck=bool(options.get("skip_healthcheck", False)),
                     run_id=options.get("run_id"), exclude=list(options.get("exclude") or ()),
                     verbose=bool(options.get("verbose", False)))


def _spec_path(spec: SpecLike) -> str:
    return str(spec) if isinstance(spec, (str, Path)) else "<python>"
