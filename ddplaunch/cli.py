"""The `ddplaunch` command line: parse, call one library function, map errors to exit codes.

Exit codes: 0 ok, 1 job or health-check failure, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable

import click

from ddplaunch import __version__
from ddplaunch.errors import EXIT_INTERRUPTED, DdplaunchError

SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False))
EXCLUDE_OPT = click.option("--exclude", multiple=True, metavar="HOST",
                           help="Leave this host (name or address) out; ranks are re-planned. Repeatable.")


def _handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One clean line on stderr and the class's exit code instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DdplaunchError as err:
            click.echo(f"ddplaunch: error: {err}", err=True)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:
            click.echo("ddplaunch: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddplaunch")
def cli() -> None:
    """Launch PyTorch DDP jobs on every host of a cluster: health check first, then the job.

    Exit codes: 0 ok, 1 job or health-check failure, 2 bad input, 130 interrupted.
    """


@cli.command(context_settings={"ignore_unknown_options": True})
@SPEC_ARG
@click.option("--dry-run", is_flag=True, help="Print the exact per-host commands; run nothing.")
@click.option("--skip-healthcheck", is_flag=True, help="Start the job without the all_reduce check.")
@click.option("--run-id", help="Use this run id instead of a fresh one (letters, digits, . _ -).")
@click.option("--json", "as_json", is_flag=True, help="Logs to stderr, a JSON summary to stdout.")
@click.option("--detach", is_flag=True, help="Slurm: submit the batch job and return (see status/logs/down).")
@EXCLUDE_OPT
@click.argument("job_args", nargs=-1, type=click.UNPROCESSED)
@_handle_errors
def up(spec: str, dry_run: bool, skip_healthcheck: bool, run_id: str | None, as_json: bool,
       detach: bool, exclude: tuple[str, ...], job_args: tuple[str, ...]) -> None:
    """Pre-flight, health check, then the job of SPEC. Arguments after `--` replace job.args."""
    from ddplaunch.launch import UpOptions

    opts = UpOptions(skip_healthcheck=skip_healthcheck, run_id=_check_run_id(run_id),
                     job_args=list(job_args) if job_args else None, detach=detach, exclude=list(exclude))
    _launch(spec, opts, dry_run, as_json)


@cli.command()
@SPEC_ARG
@click.option("--dry-run", is_flag=True, help="Print the exact per-host commands; run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Logs to stderr, a JSON summary to stdout.")
@EXCLUDE_OPT
@_handle_errors
def check(spec: str, dry_run: bool, as_json: bool, exclude: tuple[str, ...]) -> None:
    """Pre-flight host checks and the health check of SPEC; launches no job."""
    from ddplaunch.launch import UpOptions

    _launch(spec, UpOptions(healthcheck_only=True, exclude=list(exclude)), dry_run, as_json)


def _launch(spec_path: str, opts: Any, dry_run: bool, as_json: bool) -> None:
    from ddplaunch import launch
    from ddplaunch.report import summary_json
    from ddplaunch.spec import load_spec

    spec = load_spec(spec_path)
    if dry_run:
        click.echo(launch.dry_run(spec, opts), nl=False)
        return
    if opts.detach:
        launch.detach(spec, spec_path, opts)
        return
    report = launch.up(spec, spec_path, opts, stream=sys.stderr if as_json else sys.stdout)
    if as_json:
        click.echo(summary_json(report))
    sys.exit(report.exit_code)


@cli.command()
@SPEC_ARG
@_handle_errors
def validate(spec: str) -> None:
    """Check SPEC and print the resolved values; exit 2 with file:line on errors."""
    import yaml

    from ddplaunch.spec import load_spec

    loaded = load_spec(spec)
    click.echo(f"{spec}: ok ({loaded.backend}, {len(loaded.hosts)} host(s), "
               f"{loaded.nproc_per_node} proc per node)")
    click.echo(yaml.safe_dump(loaded.model_dump(mode="json"), sort_keys=False), nl=False)


@cli.command()
@_handle_errors
def runs() -> None:
    """List recorded runs, newest first."""
    from ddplaunch.runs import list_runs

    for r in list_runs():
        click.echo(f"{r.run_id}  {r.state:<11} {r.backend:<5} {len(r.hosts)} host(s)  "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.started_at))}")


@cli.command()
@click.argument("run_id", required=False)
@_handle_errors
def status(run_id: str | None) -> None:
    """Show a run's state and every host's outcome per stage (default: the latest run)."""
    from ddplaunch.runs import latest_run, load_run, status_lines

    for line in status_lines(load_run(run_id) if run_id else latest_run()):
        click.echo(line)


@cli.command()
@click.argument("run_id")
@click.option("--host", help="Only lines from this host.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the run ends.")
@_handle_errors
def logs(run_id: str, host: str | None, follow: bool) -> None:
    """Print a run's log (every host's lines, prefixed [host:rank])."""
    from ddplaunch.runs import log_lines

    for line in log_lines(run_id, host, follow):
        click.echo(line)


@cli.command()
@click.argument("run_id")
@_handle_errors
def down(run_id: str) -> None:
    """End every process left of RUN_ID on every host (found by the run's tag, not by name)."""
    from ddplaunch.backends import get_backend
    from ddplaunch.runs import load_run
    from ddplaunch.spec import ClusterSpec

    record = load_run(run_id)
    spec = ClusterSpec.model_validate(record.spec)
    for line in get_backend(spec).down(run_id):
        click.echo(line)


def _check_run_id(run_id: str | None) -> str | None:
    import re

    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,80}", run_id):
        raise click.BadParameter("use letters, digits, '.', '_' and '-' only", param_hint="--run-id")
    return run_id


def _add_sim() -> None:
    try:
        from ddplaunch.sim.cli import sim_group
    except ImportError:
        return
    cli.add_command(sim_group)


_add_sim()


def main() -> None:
    cli(prog_name="ddplaunch")
