"""The simulated cluster's life: `sim_up` builds it, `sim_down` removes it.

`sim_up` builds hosts (netns.py) and puts one sshd on each (sshd.py); with `slurm` it adds
munged, a controller namespace with slurmctld and a slurmd per host (slurm.py). Everything it
starts is recorded in the state file (state.py), which `sim_down`, `sim_status` and `sim_fault`
read. `up` first removes whatever the state file or the naming says exists, so it repairs a
crashed or half-built cluster. Keys are made fresh by every `up`, so no key or authorized_keys
file found in the state dir (statedir.py) is ever trusted. The private files in it are 0600.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddplaunch.sim import cgroups, netns, slurm, sshd
from ddplaunch.sim.image import podman_env
from ddplaunch.sim.proc import SimError, require_root, require_tool
from ddplaunch.sim.specs import render_slurm_spec, render_spec
from ddplaunch.sim.state import (DEFAULT_PREFIX, DEFAULT_SUBNET, STATE_FILE, SimCluster, SimConfig, SimHost,
                                 default_state_dir, load_cluster, save_state)
from ddplaunch.sim.statedir import prefix_lock, secure_state_dir

# what the noisy login rc of `SimConfig(rc_noise=True)` prints in every SSH session
RC_NOISE_STDOUT = "ddplaunch-sim rc noise: this line is on stdout"
RC_NOISE_STDERR = "ddplaunch-sim rc noise: this line is on stderr"


def check_requirements(slurm_too: bool = False) -> None:
    """Raise SimError naming the first missing requirement (root, tools, sshd; Slurm and
    munge with `slurm_too`)."""
    require_root()
    for tool in ("ip", "tc", "nsenter", "unshare"):
        require_tool(tool, "install iproute2 and util-linux: apt-get install iproute2 util-linux")
    sshd.require_sshd()
    if slurm_too:
        slurm.require_slurm()


def sim_up(cfg: SimConfig) -> SimCluster:
    """Build (or rebuild) a sim cluster of `cfg.n_hosts` hosts, each running sshd (and with
    `cfg.slurm` a Slurm cluster over them, waited for until every node is idle).

    Anything left from an earlier cluster of the same state dir or prefix is torn down first.
    Returns the cluster, whose state file and cluster spec(s) are written.

    Raises:
        SimError: not root, a tool is missing, the config is invalid, or a step failed
            (everything half-built is removed again).
    """
    check_requirements(slurm_too=cfg.slurm)
    naming = netns.Naming.parse(cfg.prefix, cfg.subnet)
    if not 1 <= cfg.n_hosts <= naming.max_hosts:
        raise SimError(f"--hosts must be 1..{naming.max_hosts} for subnet {naming.subnet}, "
                       f"got {cfg.n_hosts}")
    state_dir = cfg.resolved_state_dir.absolute()
    with prefix_lock(cfg.prefix):
        secure_state_dir(state_dir, 0o711 if cfg.slurm else 0o700)
        if (state_dir / STATE_FILE).exists():
            _teardown(state_dir, purge=False)
        slurm.stop_munged(state_dir)
        netns.destroy_network(naming)
        clash = netns.foreign_addr_in_subnet(naming)
        if clash:
            raise SimError(f"subnet {naming.subnet} is already used by {clash}: "
                           "pick another with --subnet")
        try:
            cluster = _build(cfg, naming, state_dir)
        except BaseException:
            _teardown(state_dir, purge=False, naming=naming)
            raise
    return cluster


def _build(cfg: SimConfig, naming: netns.Naming, state_dir: Path) -> SimCluster:
    key = state_dir / "client_key"
    sshd.new_keypair(key, f"ddplaunch-sim-{cfg.prefix}")   # fresh every time: never a planted one
    authorized = state_dir / "authorized_keys"
    authorized.unlink(missing_ok=True)
    sshd.write_new_file(authorized, (sshd.public_key(key) + "\n").encode(), 0o600)
    hosts = [SimHost(i, naming.host_name(i), str(naming.addr(i)), naming.ns(i))
             for i in range(1, cfg.n_hosts + 1)]
    etc_hosts = [(gateway_names(naming, hosts), str(naming.bridge_addr))]
    if cfg.slurm:
        etc_hosts.append((naming.controller_name, str(naming.controller_addr)))
    etc_hosts += [(h.name, h.addr) for h in hosts]
    hosts_file, resolv = netns.write_etc_files(state_dir / "etc", etc_hosts)
    cluster = SimCluster(prefix=cfg.prefix, subnet=str(naming.subnet), state_dir=state_dir, hosts=hosts,
                         bridge=naming.bridge, ifname=naming.ifname, key=key,
                         known_hosts=state_dir / "known_hosts",
                         spec_path=Path(cfg.spec_out or state_dir / "cluster.yaml").absolute(),
                         hosts_file=hosts_file, resolv_conf=resolv)
    if cfg.rc_noise:
        cluster.rc_file, cluster.rc_target = write_noisy_rc(state_dir / "etc" / "bashrc")
    if cfg.slurm:
        cluster.slurm = slurm.SlurmState(
            conf=state_dir / "etc" / "slurm.conf",
            spec_path=Path(cfg.slurm_spec_out or state_dir / "cluster-slurm.yaml").absolute(),
            controller_ns=naming.controller_ns, controller_name=naming.controller_name,
            controller_addr=str(naming.controller_addr))
    netns.create_network(naming, cfg.n_hosts, controller=cfg.slurm)
    save_state(cluster)  # from here on `down` finds everything, even if a later step fails
    entries = []
    set_env = [f"{k}={v}" for k, v in podman_env().items()]  # for the container tests
    if cfg.clean_home:
        (state_dir / "home").mkdir(mode=0o700, exist_ok=True)
        set_env.append(f"HOME={state_dir / 'home'}")
    for h in hosts:
        host_dir = cluster.host_dir(h)
        host_dir.mkdir(parents=True, exist_ok=True)
        sshd.write_sshd_config(host_dir, h.addr, authorized, check=h is hosts[0], set_env=set_env)
        entries.append((h.addr, sshd.public_key(host_dir / "ssh_host_ed25519_key")))
    # all at once; one that failed is stopped with its namespace by the teardown of sim_up
    pids = sshd.start_sshds([(cluster.host_dir(h), cluster.enter_prefix(h)) for h in hosts])
    for h, pid in zip(hosts, pids):
        h.sshd_pid = pid
    save_state(cluster)
    cluster.known_hosts.write_text(sshd.known_hosts_text(entries))
    python, workdir = cfg.python or sys.executable, Path(cfg.workdir or Path.cwd()).absolute()
    cluster.spec_path.parent.mkdir(parents=True, exist_ok=True)
    cluster.spec_path.write_text(render_spec(cluster, python=python, workdir=workdir,
                                             nproc_per_node=cfg.nproc_per_node))
    if cluster.slurm is not None:
        start_slurm(cluster, save=lambda: save_state(cluster), message_timeout=cfg.slurm_message_timeout)
        save_state(cluster)
        cluster.slurm.spec_path.parent.mkdir(parents=True, exist_ok=True)
        cluster.slurm.spec_path.write_text(render_slurm_spec(
            cluster, python=python, workdir=workdir, nproc_per_node=cfg.nproc_per_node,
            nodes=cfg.slurm_nodes))
    return cluster


def gateway_names(naming: netns.Naming, hosts: Sequence[SimHost]) -> str:
    """Names of the bridge address in the hosts file: `<prefix>gw`, plus this machine's
    hostname (the launcher, seen from the sim hosts) when it is a plain name of its own."""
    names = [f"{naming.prefix}gw"]
    me = socket.gethostname()
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}", me) and me != "localhost" \
            and me not in {h.name for h in hosts} | {naming.controller_name, names[0]}:
        names.append(me)
    return " ".join(names)


def noisy_rc_text(original: str) -> str:
    """The login rc of an `rc_noise` host: a line on stdout, one on stderr, then `original` (pure)."""
    return (f"# written by ddplaunch sim --rc-noise: an rc file that talks, like many real hosts' do\n"
            f"echo '{RC_NOISE_STDOUT}'\n"
            f"echo '{RC_NOISE_STDERR}' >&2\n"
            f"# ---- the original rc, copied at `sim up`:\n{original}")


def write_noisy_rc(path: Path) -> tuple[Path, Path]:
    """Write the noisy rc (0600: the copied rc may hold secrets) for root's ~/.bashrc;
    returns (rc file, the ~/.bashrc it is bind-mounted over inside every host).

    Raises:
        SimError: root has no ~/.bashrc to bind over (a bind mount needs an existing file).
    """
    target = Path(pwd.getpwuid(os.geteuid()).pw_dir) / ".bashrc"
    if not target.is_file():
        raise SimError(f"--rc-noise mounts a noisy rc over {target} inside the sim hosts, but there is "
                       f"no such file: create one (`touch {target}`) or leave out --rc-noise")
    path.unlink(missing_ok=True)
    sshd.write_new_file(path, noisy_rc_text(target.read_text(errors="replace")).encode(), 0o600)
    return path, target


@dataclass
class DownResult:
    """What `sim_down` removed."""

    prefix: str | None
    namespaces: list[str] = field(default_factory=list)
    sshd_stopped: list[int] = field(default_factory=list)
    slurm_stopped: list[int] = field(default_factory=list)   # munged, slurmctld, slurmds
    killed: list[int] = field(default_factory=list)


def sim_down(state_dir: Path | str | None = None, prefix: str | None = None,
             purge: bool = False) -> DownResult:
    """Remove a sim cluster: its Slurm daemons and sshds (by recorded PID), every process still
    inside its namespaces (e.g. job steps), the namespaces, veths and bridge (and with them
    their tc qdiscs).

    The cluster is found by its state file; without one, by the naming of `prefix` (the
    default prefix when neither argument is given). Idempotent: nothing there is fine.
    Files (keys, logs) stay in the state dir unless `purge`.

    Raises:
        SimError: not root, or a namespace/link could not be removed.
    """
    require_root()
    if state_dir is None:
        prefix = prefix or DEFAULT_PREFIX
        state_dir = default_state_dir(prefix)
    state_dir = Path(state_dir).absolute()
    if (state_dir / STATE_FILE).exists():
        prefix = load_cluster(state_dir).prefix
    if prefix is None:
        if purge:
            shutil.rmtree(state_dir, ignore_errors=True)
        return DownResult(None)
    with prefix_lock(prefix):
        return _teardown(state_dir, purge=purge, naming=netns.Naming.parse(prefix, DEFAULT_SUBNET))


def _teardown(state_dir: Path, purge: bool, naming: netns.Naming | None = None) -> DownResult:
    result = DownResult(naming.prefix if naming else None)
    try:
        cluster: SimCluster | None = load_cluster(state_dir)
    except SimError:
        cluster = None
    if cluster is not None:
        result.prefix = cluster.prefix
        naming = cluster.naming
        if cluster.slurm is not None:
            result.slurm_stopped = slurm.stop_slurm(cluster.slurm, state_dir)
        # sshds first, gracefully and all together, then whatever is left in the netns
        result.sshd_stopped = sshd.stop_sshds([(h.sshd_pid, cluster.host_dir(h)) for h in cluster.hosts])
    munged = slurm.stop_munged(state_dir)  # one whose PID never made it into the state
    if munged:
        result.slurm_stopped.append(munged)
    if naming is not None:
        result.namespaces = [ns for ns in netns.list_netns() if naming.owns_netns(ns)]
        result.killed = netns.destroy_network(naming)
        cgroups.remove_all(naming.prefix)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    for pid_file in state_dir.glob("hosts/*/sshd.pid"):
        pid_file.unlink(missing_ok=True)
    if purge:
        shutil.rmtree(state_dir, ignore_errors=True)
    return result


def start_slurm(cluster: SimCluster, save: Callable[[], None], message_timeout: int | None = None) -> slurm.SlurmState:
    """Write slurm.conf, start munged, slurmctld and every slurmd; wait until all nodes are idle.

    `cluster.slurm` must hold a fresh SlurmState (conf/spec paths, controller names); its
    PIDs are filled in and `save()` is called after each start, so `sim down` finds every
    daemon even when a later one fails.

    Raises:
        SimError: a daemon failed to start or the nodes were not idle in time (names the logs).
    """
    st = cluster.slurm
    assert st is not None
    base = st.base
    shutil.rmtree(base, ignore_errors=True)   # old controller state would resurrect old jobs
    spools = [base / "nodes" / h.name / "spool" for h in cluster.hosts]
    for d in (base / "ctl" / "state", base / "jobs", *spools):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(base / "jobs", 0o1777)            # jobs of non-root users write their output here
    st.conf.write_text(slurm.slurm_conf_text(
        cluster_name=cluster.prefix, controller=(st.controller_name, st.controller_addr),
        nodes=[(h.name, h.addr) for h in cluster.hosts], base=base, munge_socket=st.munge_socket,
        partition=st.partition, message_timeout=message_timeout))

    st.munged_pid = slurm.start_munged(cluster.state_dir)
    save()
    ctl_enter = cluster_enter_controller(cluster)
    st.slurmctld_pid = slurm.spawn([*ctl_enter, slurm.SLURMCTLD, "-D", "-f", str(st.conf)],
                              base / "ctl" / "slurmctld.out")
    save()
    for h in cluster.hosts:
        st.slurmd_pids[h.name] = slurm.spawn(
            [*cluster.enter_prefix(h), slurm.SLURMD, "-D", "-N", h.name, "-f", str(st.conf)],
            base / "nodes" / h.name / "slurmd.out")
    save()
    slurm.wait_nodes_idle(st, [h.name for h in cluster.hosts])
    return st


def cluster_enter_controller(cluster: SimCluster) -> list[str]:
    """argv prefix that runs a command in the controller namespace (pure)."""
    st = cluster.slurm
    assert st is not None
    return netns.enter_prefix(st.controller_ns, st.controller_name, cluster.hosts_file, cluster.resolv_conf)
