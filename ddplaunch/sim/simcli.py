"""`ddplaunch sim ...`: thin Click commands over the sim library (one call each).

The main CLI adds the group with `cli.add_command(sim_group)`. A `SimError` becomes a
one-line `Error: ...` and exit status 2 here, so the group also works on its own.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ddplaunch.sim.cluster import sim_down, sim_up
from ddplaunch.sim.faults import sim_fault
from ddplaunch.sim.proc import SimError, require_root
from ddplaunch.sim.state import DEFAULT_PREFIX, DEFAULT_SUBNET, SimConfig, default_state_dir, load_cluster
from ddplaunch.sim.survey import sim_status, slurm_status


class SimUsageError(click.ClickException):
    exit_code = 2


def _sim_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SimError as exc:
            raise SimUsageError(str(exc)) from exc
    return wrapper


def _where(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--prefix / --state-dir, shared by all commands."""
    fn = click.option("--state-dir", type=click.Path(path_type=Path), default=None,
                      help="State dir of the cluster [default: /tmp/ddplaunch-sim-<prefix>].")(fn)
    return click.option("--prefix", default=None,
                        help=f"Name prefix of namespaces and links [default: {DEFAULT_PREFIX}].")(fn)


def _state_dir(prefix: str | None, state_dir: Path | None) -> Path:
    return state_dir or default_state_dir(prefix or DEFAULT_PREFIX)


@click.group("sim")
def sim_group() -> None:
    """A local cluster of real hosts: network namespaces with sshd, optionally Slurm (needs root)."""


@sim_group.command("up")
@click.option("--hosts", "n_hosts", type=click.IntRange(1, 999), default=4, show_default=True,
              help="Number of hosts.")
@click.option("--subnet", default=DEFAULT_SUBNET, show_default=True, help="IPv4 CIDR of the sim network.")
@_where
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where to write the cluster spec [default: <state-dir>/cluster.yaml, with "
                   "--slurm the Slurm spec at <state-dir>/cluster-slurm.yaml].")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="workdir in the spec [default: current directory].")
@click.option("--nproc-per-node", type=click.IntRange(1), default=2, show_default=True)
@click.option("--slurm", is_flag=True,
              help="Also run a Slurm cluster: munged, slurmctld (own namespace) and a slurmd per host.")
@click.option("--slurm-nodes", type=click.IntRange(1), default=None,
              help="slurm.nodes in the Slurm spec [default: min(2, hosts)].")
@click.option("--rc-noise", is_flag=True,
              help="Give the hosts a root ~/.bashrc that prints a line to stdout and one to stderr "
                   "in every SSH session (then runs the original), like many real hosts' rc files.")
@_sim_errors
def up_cmd(n_hosts: int, subnet: str, prefix: str | None, state_dir: Path | None, out: Path | None,
           workdir: Path | None, nproc_per_node: int, slurm: bool, slurm_nodes: int | None,
           rc_noise: bool) -> None:
    """Build (or rebuild) a sim cluster and write its cluster spec."""
    t0 = time.monotonic()
    cluster = sim_up(SimConfig(n_hosts=n_hosts, prefix=prefix or DEFAULT_PREFIX, subnet=subnet,
                               state_dir=state_dir, spec_out=None if slurm else out, workdir=workdir,
                               nproc_per_node=nproc_per_node, slurm=slurm,
                               slurm_spec_out=out if slurm else None, slurm_nodes=slurm_nodes,
                               rc_noise=rc_noise))
    st = cluster.slurm
    if st is not None:
        click.echo(f"{st.controller_name:<8} {st.controller_addr:<15} slurmctld pid {st.slurmctld_pid}, "
                   f"munged pid {st.munged_pid}")
    for h in cluster.hosts:
        click.echo(f"{h.name:<8} {h.addr:<15} sshd pid {h.sshd_pid}"
                   + (f", slurmd pid {st.slurmd_pids.get(h.name)}" if st else ""))
    click.echo(f"sim cluster {cluster.prefix!r} up: {len(cluster.hosts)} hosts on {cluster.bridge} "
               f"({cluster.subnet}), ifname {cluster.ifname}, {time.monotonic() - t0:.1f}s"
               + (f", noisy rc over {cluster.rc_target}" if cluster.rc_file else ""))
    click.echo(f"cluster spec: {cluster.spec_path}")
    click.echo(f"ssh: ssh -i {cluster.key} -o UserKnownHostsFile={cluster.known_hosts} "
               f"root@{cluster.hosts[0].addr}")
    if st is not None:
        click.echo(f"slurm spec: {st.spec_path}")
        click.echo(f"slurm: export SLURM_CONF={st.conf}; sinfo")


@sim_group.command("down")
@_where
@click.option("--purge", is_flag=True, help="Also delete the state dir (keys, logs).")
@_sim_errors
def down_cmd(prefix: str | None, state_dir: Path | None, purge: bool) -> None:
    """Remove everything `sim up` made (idempotent)."""
    t0 = time.monotonic()
    res = sim_down(state_dir, prefix=prefix, purge=purge)
    click.echo(f"sim down: removed {len(res.namespaces)} namespaces, stopped {len(res.sshd_stopped)} sshd"
               + (f" and {len(res.slurm_stopped)} Slurm daemons" if res.slurm_stopped else "")
               + f", killed {len(res.killed)} leftover processes ({time.monotonic() - t0:.1f}s)")


@sim_group.command("status")
@_where
@_sim_errors
def status_cmd(prefix: str | None, state_dir: Path | None) -> None:
    """Table of hosts: namespace, sshd, link and faults, and of the Slurm daemons when there
    are some. Exit 1 when a host or daemon is unhealthy."""
    from rich.console import Console
    from rich.table import Table

    rows = sim_status(_state_dir(prefix, state_dir))
    table = Table("host", "addr", "netns", "sshd pid", "link", "qdisc", "fault")
    for r in rows:
        table.add_row(r.name, r.addr, "yes" if r.ns_exists else "MISSING",
                      f"{r.sshd_pid} " + ("alive" if r.sshd_alive else "DEAD") if r.sshd_pid else "-",
                      r.link, r.qdisc, r.fault)
    Console().print(table)
    daemons = slurm_status(_state_dir(prefix, state_dir))
    if daemons:
        dtable = Table("slurm daemon", "where", "pid", "state")
        for d in daemons:
            dtable.add_row(d.label, d.where, str(d.pid or "-"),
                           ("alive" if d.alive else "DEAD") + (f", node {d.node_state}" if d.node_state else ""))
        Console().print(dtable)
    if not all(r.healthy for r in rows) or not all(d.healthy for d in daemons):
        raise SystemExit(1)


@sim_group.command("fault")
@click.argument("host")
@_where
@click.option("--rate", default=None, help="Rate-limit the host's link both ways, e.g. 1gbit.")
@click.option("--down", is_flag=True, help="Set the host's link down.")
@click.option("--sshd-stop", is_flag=True, help="Stop the host's sshd.")
@click.option("--crash", is_flag=True, help="Crash the host: link down, every process of it SIGKILLed.")
@click.option("--cut-training", is_flag=True,
              help="Drop the host's traffic to and from the other hosts but sshd's and slurmd's.")
@click.option("--slow", type=int, default=None, metavar="PERCENT",
              help="Limit every process of the host together to PERCENT % of one CPU (cgroups).")
@click.option("--clear", is_flag=True, help="Undo all faults of the host (a crashed host's daemons start again).")
@_sim_errors
def fault_cmd(host: str, prefix: str | None, state_dir: Path | None, rate: str | None, down: bool,
              sshd_stop: bool, crash: bool, cut_training: bool, slow: int | None, clear: bool) -> None:
    """Inject a fault into HOST (name or address), or --clear it."""
    h = sim_fault(_state_dir(prefix, state_dir), host, rate=rate, down=down, sshd_stop=sshd_stop,
                  crash=crash, cut_training=cut_training, slow=slow, clear=clear)
    click.echo(f"{h.name} ({h.addr}): faults: {h.fault.describe()}")


@sim_group.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("host")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_where
@_sim_errors
def exec_cmd(host: str, command: tuple[str, ...], prefix: str | None, state_dir: Path | None) -> None:
    """Run COMMAND inside HOST: `ddplaunch sim exec dls2 -- hostname`."""
    require_root("ddplaunch sim exec")
    argv = load_cluster(_state_dir(prefix, state_dir)).exec_argv(host, command)
    os.execvp(argv[0], argv)
