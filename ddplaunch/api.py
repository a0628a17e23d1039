"""ddplaunch from Python: `up`, `check` and `load_spec` for notebooks, pipelines and tests.

    import ddplaunch
    report = ddplaunch.up("cluster.yaml", job_args=["--epochs", "2"])
    report.exit_code, report.run_id, report.stages[-1].outcomes, report.healthcheck

The same runs as the command line: the spec is read and checked as `ddplaunch validate` does,
every line goes to `stream` (default: this process's stdout), and the run is recorded under
`$DDPLAUNCH_HOME/runs/<run id>/` (`ddplaunch status/logs RUN_ID` work on it). Failures of hosts
and ranks are in the report, not raised; bad input raises SpecError or PlanError, a backend that
cannot start BackendError (all DdplaunchError, ddplaunch/errors.py). Ctrl-C in the main thread
ends the run (exit code 130 in the report).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence, Union

from ddplaunch import launch
from ddplaunch.errors import PlanError
from ddplaunch.report import RunReport
from ddplaunch.runs import new_run_id
from ddplaunch.spec import ClusterSpec
from ddplaunch.specfile import load_spec as _load_file
from ddplaunch.specfile import load_spec_data

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


def check(spec: SpecLike, *, dry_run: bool = False, stream: Optional[IO[str]] = None,
          **options: Any) -> RunReport:
    """`ddplaunch check`: the pre-flight, the health check and the pair tests, no job."""
    return _run(spec, None, dry_run, stream, options, healthcheck_only=True)


def _run(spec: SpecLike, job_args: Optional[Sequence[str]], dry_run: bool, stream: Optional[IO[str]],
         options: dict[str, Any], healthcheck_only: bool) -> RunReport:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise PlanError(f"unknown option {', '.join(unknown)}; the options are {', '.join(OPTIONS)}")
    opts = launch.UpOptions(healthcheck_only=healthcheck_only, job_args=list(job_args) if job_args else None,
                            skip_healthcheck=bool(options.get("skip_healthcheck", False)),
                            run_id=options.get("run_id"), exclude=list(options.get("exclude") or ()),
                            verbose=bool(options.get("verbose", False)))
    loaded = load_spec(spec)
    if dry_run:
        opts.run_id = opts.run_id or new_run_id(loaded.name)
        return RunReport(run_id=opts.run_id, final_stage="", plan_text=launch.dry_run(loaded, opts))
    return launch.up(loaded, str(spec) if isinstance(spec, (str, Path)) else "<python>", opts, stream=stream)
