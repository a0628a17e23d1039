"""The `ddplaunch` command line: parse, call one library function, map errors to exit codes.

Exit codes: 0 ok, 1 job or health-check failure, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from ddplaunch import __version__
from ddplaunch.errors import EXIT_INTERRUPTED, DdplaunchError
from ddplaunch.sim.simcli import sim_group

SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False))
EXCLUDE_OPT = click.option("--exclude", multiple=True, metavar="HOST",
                           help="Leave this host (name or address) out; ranks are re-planned. Repeatable.")
VERBOSE_OPT = click.option("-v", "--verbose", is_flag=True,
                           help="Show every line (torchrun's banners and warnings, stopped hosts' tracebacks).")


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


@cli.command()
@SPEC_ARG
@click.option("--dry-run", is_flag=True, help="Print exactly what would execute; run and write nothing.")
@click.option("--skip-healthcheck", is_flag=True, help="Start the job without the all_reduce check.")
@click.option("--run-id", help="Use this run id instead of a fresh one (letters, digits, . _ -).")
@click.option("--json", "as_json", is_flag=True, help="Logs to stderr, a JSON summary to stdout.")
@click.option("--detach", is_flag=True,
              help="Return once the run is taken: by a supervisor on this machine (follow it with attach, "
                   "end it with down), or on Slurm by one batch job that runs every stage itself.")
@EXCLUDE_OPT
@VERBOSE_OPT
@click.option("--emulate", type=click.IntRange(min=1), metavar="RANKS_PER_HOST", default=None,
              help="Emulated ranks in place of torchrun and the job (no torch): rehearse a spec's supervision "
                   "(docs/scaling.md).")
@click.option("--emulate-step-s", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="With --emulate: seconds per step.")
@click.option("--emulate-steps", type=click.IntRange(min=0), default=0, help="With --emulate: steps (0: until stopped).")
@click.option("--emulate-ckpt-every", type=click.IntRange(min=0), default=50, show_default=True,
              help="With --emulate: rank 0 saves a checkpoint every this many steps.")
@click.option("--emulate-slow", multiple=True, metavar="RANK:FACTOR@STEP", help="With --emulate: that rank computes "
              "FACTOR times longer from STEP on. Repeatable.")
@click.option("--emulate-freeze", multiple=True, metavar="RANK@STEP", help="With --emulate: that rank freezes (SIGSTOP) "
              "at STEP. Repeatable.")
@click.option("--emulate-exit", multiple=True, metavar="RANK:CODE@STEP", help="With --emulate: that rank's script "
              "exits with CODE at STEP. Repeatable.")
@click.argument("job_args", nargs=-1, metavar="[-- JOB_ARGS...]")
@_handle_errors
def up(spec: str, dry_run: bool, skip_healthcheck: bool, run_id: str | None, as_json: bool,
       detach: bool, exclude: tuple[str, ...], verbose: bool, emulate: int | None, emulate_step_s: float,
       emulate_steps: int, emulate_ckpt_every: int, emulate_slow: tuple[str, ...], emulate_freeze: tuple[str, ...],
       emulate_exit: tuple[str, ...], job_args: tuple[str, ...]) -> None:
    """Pre-flight, health check, then the job of SPEC. Arguments after `--` replace job.args."""
    from ddplaunch.plan.emulation import Emulation
    from ddplaunch.plan.stages import UpOptions

    if emulate is None and (emulate_slow or emulate_freeze or emulate_exit):
        raise click.UsageError("--emulate-slow, --emulate-freeze and --emulate-exit need --emulate RANKS_PER_HOST")
    emulation = Emulation(emulate, emulate_step_s, emulate_steps, emulate_ckpt_every, emulate_slow, emulate_freeze,
                          emulate_exit) if emulate is not None else None
    opts = UpOptions(skip_healthcheck=skip_healthcheck, run_id=run_id,
                     job_args=list(job_args) if job_args else None, detach=detach, exclude=list(exclude),
                     verbose=verbose, emulate=emulation)
    _launch(spec, opts, dry_run, as_json)


@cli.command()
@SPEC_ARG
@click.option("--dry-run", is_flag=True, help="Print exactly what would execute; run and write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Logs to stderr, a JSON summary to stdout.")
@EXCLUDE_OPT
@VERBOSE_OPT
@_handle_errors
def check(spec: str, dry_run: bool, as_json: bool, exclude: tuple[str, ...], verbose: bool) -> None:
    """Pre-flight host checks, the health check and the pair tests of SPEC; launches no job."""
    from ddplaunch.plan.stages import UpOptions

    _launch(spec, UpOptions(healthcheck_only=True, exclude=list(exclude), verbose=verbose), dry_run, as_json)


def _launch(spec_path: str, opts: Any, dry_run: bool, as_json: bool) -> None:
    from ddplaunch.run.begin import dry_run as dry_run_text
    from ddplaunch.spec.load import load_spec
    from ddplaunch.supervise.follow import foreground
    from ddplaunch.supervise.handover import hand_over, handed_line

    spec = load_spec(spec_path)
    if dry_run:
        click.echo(dry_run_text(spec, opts, spec_path), nl=False)
        return
    if opts.detach:
        click.echo(handed_line(hand_over(spec, spec_path, opts)))
        return
    sys.exit(foreground(spec, spec_path, opts, as_json))


@cli.command()
@SPEC_ARG
@_handle_errors
def validate(spec: str) -> None:
    """Check SPEC and print the resolved values (secrets shown as <secret>); exit 2 with file:line."""
    import yaml

    from ddplaunch.spec.load import load_spec

    from ddplaunch.run.begin import before_stages

    loaded = load_spec(spec)
    click.echo(f"{spec}: ok ({loaded.backend}, {len(loaded.hosts)} host(s), "
               f"{loaded.nproc_per_node} proc per node)")
    click.echo(yaml.safe_dump(loaded.redacted(), sort_keys=False), nl=False)
    click.echo(before_stages(loaded), nl=False)


def _age(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """`7d`, `12h`, `30m`, `90s` or plain seconds, in seconds."""
    if value is None:
        return None
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    text = value.strip().lower()
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise click.BadParameter(f"{value!r}: give an age like 7d, 12h, 30m or 90 (seconds)")
    return seconds


@cli.command()
@click.option("--goodput", is_flag=True,
              help="Where the ended runs' time went: goodput and seconds per cause, and the total.")
@click.option("--since", callback=_age, default=None, metavar="AGE",
              help="Only runs started within AGE (7d, 12h, 30m).")
@_handle_errors
def runs(goodput: bool, since: float | None) -> None:
    """List recorded runs, newest first."""
    from rich.console import Console
    from rich.table import Table

    from ddplaunch.record.runs import list_runs
    from ddplaunch.supervise.commands import state_of

    records = [r for r in list_runs() if since is None or r.started_at >= time.time() - since]
    out = Console(width=200 if not sys.stdout.isatty() else None, highlight=False)
    if goodput:
        out.print(_goodput_table(records))
        return
    table = Table("run id", "state", "backend", "hosts", "started", box=None, pad_edge=False)
    for r in records:
        table.add_row(r.run_id, state_of(r), r.backend, str(len(r.hosts)),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started_at)))
    out.print(table)


def _goodput_table(records: list[Any]) -> Any:
    """`runs --goodput`: each ended run's ledger, then their total (report/goodput.py)."""
    from rich.table import Table

    from ddplaunch.report.goodput import CAUSES, duration, total
    from ddplaunch.supervise.commands import ledgers

    table = Table("run id", "goodput", "wall", *CAUSES, "faults", box=None, pad_edge=False)
    found = [(record.run_id, spent) for record, spent in ledgers(records)]
    for name, spent in [*found, *([("total", total([s for _, s in found]))] if found else [])]:
        table.add_row(name, f"{100 * spent.goodput:.0f}%", duration(spent.wall_s),
                      *(duration(spent.parts[c]) for c in CAUSES), str(spent.faults))
    return table


HEALTH_FILE_OPT = click.option("--file", "path", type=click.Path(dir_okay=False), default=None,
                               help="A shared host-health file (recovery.host_health_file) "
                                    "[default: ~/.ddplaunch/host-health.json].")


@cli.group("hosts", invoke_without_command=True)
@HEALTH_FILE_OPT
@click.option("--all", "show_all", is_flag=True, help="Expired entries too.")
@click.pass_context
@_handle_errors
def hosts_group(ctx: click.Context, path: str | None, show_all: bool) -> None:
    """Hosts remembered bad by earlier runs (lost, frozen, cut off, failed the health check, evicted
    as a straggler): `up` skips them until their entry expires (recovery.remember_bad_hosts) or
    they are readmitted (`hosts clear HOST`, or a `check` that passes on them)."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console
    from rich.table import Table

    from ddplaunch.record.hosthealth import health_file, recorded
    from ddplaunch.report.goodput import duration
    from ddplaunch.spec.model import RecoverySpec

    file = health_file(path)
    entries = recorded(file, float("inf") if show_all else RecoverySpec().remember_bad_hosts)
    if not entries:
        click.echo(f"no host recorded in {file}")
        return
    table = Table("host", "cause", "run", "when", box=None, pad_edge=False)
    for e in sorted(entries.values(), key=lambda e: -e.at):
        table.add_row(e.host, e.cause, e.run_id, f"{duration(time.time() - e.at)} ago")
    Console(width=200 if not sys.stdout.isatty() else None, highlight=False).print(table)
    click.echo(f"({file}; `ddplaunch hosts clear HOST` readmits one)")


@hosts_group.command("clear")
@click.argument("hosts", nargs=-1, required=True, metavar="HOST...")
@HEALTH_FILE_OPT
@_handle_errors
def hosts_clear(hosts: tuple[str, ...], path: str | None) -> None:
    """Readmit HOSTs: the next `up` runs on them again."""
    from ddplaunch.record.hosthealth import clear, health_file

    file = health_file(path)
    gone = clear(file, list(hosts))
    for host in hosts:
        click.echo(f"{host}: readmitted" if host in gone else f"{host}: was not recorded in {file}")


def _pick(run_id: str | None) -> Any:
    """The named run, or the latest run of this directory's project (saying which, on stderr)."""
    from ddplaunch.record.runs import latest_run, load_run

    if run_id:
        return load_run(run_id)
    record, how = latest_run(Path.cwd())
    click.echo(f"ddplaunch: {how}", err=True)
    return record


@cli.command()
@click.argument("run_id", required=False)
@_handle_errors
def status(run_id: str | None) -> None:
    """Show a run's state and every host's outcome per stage (default: the latest run here)."""
    from ddplaunch.supervise.commands import status as run_status

    for line in run_status(_pick(run_id)):
        click.echo(line)


@cli.command()
@click.argument("run_id", required=False)
@click.option("--host", help="Only lines from this host.")
@click.option("--rank", type=click.IntRange(min=0), help="Only lines of this global rank.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the run ends.")
@_handle_errors
def logs(run_id: str | None, host: str | None, rank: int | None, follow: bool) -> None:
    """Print a run's log, every host's lines prefixed [host:rank] (default: the latest run here):
    every line, also those the screen showed once for many ranks."""
    from ddplaunch.supervise.commands import logs as run_logs

    for line in run_logs(_pick(run_id), host, follow, rank):
        click.echo(line)


@cli.command("attach")
@click.argument("run_id", required=False)
@_handle_errors
def attach_cmd(run_id: str | None) -> None:
    """Show a run from its first line and follow it to its end (default: the latest run here);
    exit with its exit code. Ctrl-C detaches; the run goes on."""
    from ddplaunch.supervise.follow import attach

    sys.exit(attach(_pick(run_id), sys.stdout))


@cli.command("events")
@click.argument("run_id", required=False)
@click.option("-f", "--follow", is_flag=True, help="Then each new event, until the run ends.")
@click.option("--timeout", type=click.FloatRange(min=0), default=None,
              help="With --follow: stop following after this many seconds.")
@_handle_errors
def events_cmd(run_id: str | None, follow: bool, timeout: float | None) -> None:
    """A run's typed event log as JSON lines, oldest first (default: the latest run here): stages,
    every host's state, recoveries, each rank's steps, stragglers, the end."""
    from ddplaunch.supervise.follow import run_events
    from ddplaunch.record.events import to_line

    for event in run_events(_pick(run_id), live=follow, timeout=timeout):
        click.echo(to_line(event))


@cli.command("supervise", hidden=True)
@click.option("--stdin", "from_stdin", is_flag=True, help="The run on stdin (one line), not in the environment.")
@click.option("--daemon", is_flag=True, help="Fork the supervisor and answer once it has taken the run.")
@click.option("--nonce", default="", help="Marks the answer line.")
@_handle_errors
def supervise_cmd(from_stdin: bool, daemon: bool, nonce: str) -> None:
    """A run's supervisor handed over by another process: in the foreground (the batch job of a
    detached Slurm run), or as a daemon (`supervisor.host`: `up` on another machine hands it over
    SSH)."""
    import json

    from ddplaunch.supervise import daemon as supervisor
    from ddplaunch.plan.handoff import SUPERVISE_ENV
    from ddplaunch.supervise.remote import ANSWER

    if from_stdin:
        os.environ[SUPERVISE_ENV] = sys.stdin.readline().strip()
    if not daemon:
        sys.exit(supervisor.supervise_here(os.environ))
    taken = supervisor.supervise_daemon(os.environ)
    click.echo(f"{ANSWER}_{nonce} " + json.dumps({"run_id": taken.run_id, "pid": taken.pid, "start": taken.start}))


@cli.command("report")
@click.argument("run_id", required=False)
@click.option("--html", "html_out", type=click.Path(dir_okay=False, writable=True), required=True,
              help="Write the run's page here: one self-contained HTML file with plots.")
@_handle_errors
def report_cmd(run_id: str | None, html_out: str) -> None:
    """A run's page (default: the latest run here): every rank's compute per step over the run, the health
    check's busbw per size, the pair bandwidth matrix, the timeline of stages and recoveries."""
    from ddplaunch.report.page import page_of

    record = _pick(run_id)
    Path(html_out).write_text(page_of(record.dir))
    click.echo(f"run {record.run_id}: page written to {html_out}")


@cli.command("top")
@click.argument("run_id", required=False)
@click.option("--once", is_flag=True, help="Print the table once and exit.")
@_handle_errors
def top_cmd(run_id: str | None, once: bool) -> None:
    """Every host and rank of a run (default: the latest run here), refreshed each second until it
    ends: state, step, step time, wait at the collectives, straggler score, recoveries."""
    from ddplaunch.record.runs import OnHost
    from ddplaunch.supervise.follow import follow_elsewhere, supervisor_of, top

    record = _pick(run_id)
    if isinstance(record.placement, OnHost):
        sys.exit(follow_elsewhere(record, ["top", record.run_id, *(["--once"] if once else [])], sys.stdout))
    supervised = supervisor_of(record)
    sys.exit(top(supervised.dir, supervised.alive, sys.stdout, once=once))


@cli.command()
@click.argument("run_id")
@_handle_errors
def down(run_id: str) -> None:
    """End every process left of RUN_ID on every host (found by the run's tag and your user id,
    never by name)."""
    from ddplaunch.record.runs import load_run
    from ddplaunch.supervise.commands import down as run_down

    for line in run_down(load_run(run_id)):
        click.echo(line)


@cli.group("ckpt")
def ckpt_group() -> None:
    """The checkpoint tier's steps: where each lives (`ls`), whether its files match their
    checksums (`verify`). DIR is a durable dir; RUN a recorded run: its durable dir and its RAM on
    this machine."""


CKPT_TARGET_ARG = click.argument("target", metavar="DIR|RUN")
RAM_ROOT_OPT = click.option("--ram-root", type=click.Path(file_okay=False, path_type=Path), default=None,
                            help="Where the hosts' RAM tier lives on this machine [default: /dev/shm].")


@ckpt_group.command("ls")
@CKPT_TARGET_ARG
@click.option("--json", "as_json", is_flag=True, help="The same as JSON.")
@RAM_ROOT_OPT
@_handle_errors
def ckpt_ls(target: str, as_json: bool, ram_root: Path | None) -> None:
    """Every step, newest first: complete or which parts are missing, size, age, and where it
    lives (the durable dir, each host's RAM, a buddy's replica). Reads sizes only."""
    import json

    from ddplaunch.record.ckptscan import places_of, scan
    from ddplaunch.report.checkpoints import listing_data, ls_lines

    listing = scan(places_of(target, ram_root))
    if as_json:
        click.echo(json.dumps(listing_data(listing, time.time()), indent=2))
        return
    for line in ls_lines(listing, time.time()):
        click.echo(line)


@ckpt_group.command("verify")
@CKPT_TARGET_ARG
@click.option("--json", "as_json", is_flag=True, help="The same as JSON.")
@RAM_ROOT_OPT
@_handle_errors
def ckpt_verify(target: str, as_json: bool, ram_root: Path | None) -> None:
    """Read every copy of every part against its manifest (sizes and CRC-32; nothing is loaded or
    unpickled); exit 1 when a copy that claims to be complete does not match it."""
    import json

    from ddplaunch.errors import EXIT_FAILURE
    from ddplaunch.record.ckptscan import places_of, scan
    from ddplaunch.report.checkpoints import listing_data, verify_lines

    listing = scan(places_of(target, ram_root), checksums=True)
    if as_json:
        click.echo(json.dumps(listing_data(listing, time.time()), indent=2))
    else:
        for line in verify_lines(listing):
            click.echo(line)
    if listing.corrupt:
        sys.exit(EXIT_FAILURE)


@cli.command("init")
@click.option("--ssh", "ssh_hosts", multiple=True, metavar="HOST",
              help="A host of an SSH cluster: addr, user@addr or user@addr:port. Repeatable.")
@click.option("--slurm", is_flag=True, help="A Slurm cluster (one sbatch job).")
@click.option("--nodes", type=click.IntRange(1), default=None, help="Slurm: nodes to allocate [default: 2].")
@click.option("--partition", default=None, help="Slurm: the partition [default: the cluster's default].")
@click.option("--time", "time_limit", default=None, metavar="HH:MM:SS", help="Slurm: the time limit [default: 00:30:00].")
@click.option("--gpus-per-node", type=click.IntRange(0), default=None, help="Slurm: GPUs per node [default: none].")
@click.option("--out", "out", default="cluster.yaml", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the spec.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@_handle_errors
def init_cmd(ssh_hosts: tuple[str, ...], slurm: bool, nodes: int | None, partition: str | None,
             time_limit: str | None, gpus_per_node: int | None, out: str, force: bool) -> None:
    """Write an annotated cluster spec: this machine (default), --ssh HOST... or --slurm.

    The job is the shipped example `example:toy_ddp.py`, so `ddplaunch up cluster.yaml`
    works right after. Exit 2 (one line) when OUT exists and --force is not given.
    """
    from ddplaunch.spec.templates import write_init_spec

    click.echo(write_init_spec(out, force, ssh_hosts, slurm, nodes, partition, time_limit, gpus_per_node))


cli.add_command(sim_group)


def main() -> None:
    cli(prog_name="ddplaunch")
