"""Fault injection on sim hosts: rate limits, dead links, stopped sshd, crashes — and undoing them.

The kernel here has no netem, so a "slow link" is a `tbf` rate limit on both legs of the
host's veth (egress in the host and egress on the bridge side, i.e. both directions).
A crash is what a machine that loses power looks like from the network: its link goes down
(no RST for anyone's connection) and every process of the host is SIGKILLed, its sshd and slurmd
too; and what it held in RAM is gone: its part of the checkpoint memory tier (hostside/ckpt/),
which the sim hosts share /dev/shm for, is removed. Every fault is recorded in the state file so `sim status` and `--clear` know about it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

from ddplaunch.hostside.ckpt.config import RAM_ROOT
from ddplaunch.hostside.ckpt.jobfiles import NODES, OWNER
from ddplaunch.hostside.ckpt.layout import safe_component
from ddplaunch.sim import cgroups, slurm, sshd
from ddplaunch.sim.netns import NETNS_DIR, netns_pids
from ddplaunch.sim.proc import SimError, require_root, run, stop_pids
from ddplaunch.sim.state import Fault, SimCluster, SimHost, load_cluster, save_state
from ddplaunch.sim.statedir import prefix_lock

RATE_RE = re.compile(r"^\d+(\.\d+)?([kmgt]i?)?(bit|bps)$", re.IGNORECASE)
TBF_OPTS = ["burst", "256kb", "latency", "50ms"]
#: The firewall chain of a host whose training traffic is cut, and the ports it still lets
#: through (sshd; slurmd: the management network).
CUT_CHAIN = "DDPLAUNCH_CUT"
MANAGEMENT_PORTS = ("22", "6818")


def sim_fault(target: Path | str | SimCluster, host: str, *, rate: str | None = None, down: bool = False,
              sshd_stop: bool = False, crash: bool = False, cut_training: bool = False,
              slow: int | None = None, clear: bool = False) -> SimHost:
    """Apply exactly one fault action to `host` (name or address) and record it.

    Args:
        target: the cluster's state dir, or a loaded SimCluster (updated in place).
        rate: rate-limit both directions of the host's link, e.g. "1gbit", "100mbit".
        down: set both legs of the host's link down (connections to it time out).
        sshd_stop: stop the host's sshd listener (by its recorded PID).
        crash: the link down, then SIGKILL to every process in the host's namespace, and its part of
            the checkpoint memory tier removed (`wipe_memory_tier`): a power loss.
        cut_training: drop every packet between the host and the other hosts except those of
            sshd and slurmd (a broken training fabric while the management network answers;
            the launcher's own traffic is untouched).
        slow: every process of the host gets together this percentage of one CPU (cgroups).
        clear: remove rate limits, bring the link up, restart sshd (and slurmd) if not running; a
            host that was down restarts its slurmd, as a booted one would (it registers at once).

    Returns:
        The host as now recorded.
    Raises:
        SimError: not exactly one action, bad rate, unknown host, or a command failed.
    """
    _one_action([rate is not None, down, sshd_stop, crash, cut_training, slow is not None, clear], rate, slow)
    require_root("ddplaunch sim fault")
    state_dir = target.state_dir if isinstance(target, SimCluster) else Path(target)
    with prefix_lock(load_cluster(state_dir).prefix):
        cluster = load_cluster(state_dir)  # re-read under the lock
        h = cluster.host(host)
        if rate is not None:
            _set_rate(cluster, h, rate)
            h.fault.rate = rate
        elif down:
            _set_link(cluster, h, "down")
            h.fault.down = True
        elif sshd_stop:
            sshd.stop_sshd(h.sshd_pid, cluster.host_dir(h))
            h.sshd_pid, h.fault.sshd_stopped = None, True
        elif crash:
            _set_link(cluster, h, "down")
            _kill_all(h)
            wipe_memory_tier(h.name)
            h.sshd_pid, h.fault.crashed, h.fault.down = None, True, True
            if cluster.slurm is not None:
                cluster.slurm.slurmd_pids.pop(h.name, None)
        elif cut_training:
            _cut_training(cluster, h)
            h.fault.training_cut = True
        elif slow is not None:
            cgroups.limit(cgroups.group_name(cluster.prefix, h.name), netns_pids(h.ns), slow)
            h.fault.slow = slow
        else:
            _clear(cluster, h)
        save_state(cluster)
    if isinstance(target, SimCluster):
        target.hosts, target.slurm = cluster.hosts, cluster.slurm
    return h


def _one_action(given: list[bool], rate: str | None, slow: int | None) -> None:
    if sum(given) != 1:
        raise SimError("give exactly one of --rate RATE, --down, --sshd-stop, --crash, --cut-training, "
                       "--slow PERCENT, --clear")
    if slow is not None and not 1 <= slow <= 100:
        raise SimError(f"bad --slow {slow}: a percentage of one CPU, 1 to 100")
    if rate is not None and not RATE_RE.match(rate):
        raise SimError(f"bad rate {rate!r}: use a tc rate such as 1gbit, 100mbit or 500kbit")


def _in_ns(h: SimHost, argv: list[str]) -> list[str]:
    # network-only entry is enough for tc/ip, and it needs no private /etc
    return ["nsenter", f"--net={NETNS_DIR / h.ns}", *argv]


def _set_rate(cluster: SimCluster, h: SimHost, rate: str) -> None:
    tbf = ["root", "tbf", "rate", rate, *TBF_OPTS]
    run(_in_ns(h, ["tc", "qdisc", "replace", "dev", cluster.ifname, *tbf]))       # host -> bridge
    run(["tc", "qdisc", "replace", "dev", cluster.naming.veth(h.index), *tbf])    # bridge -> host


def _set_link(cluster: SimCluster, h: SimHost, state: str) -> None:
    run(["ip", "link", "set", cluster.naming.veth(h.index), state])
    run(["ip", "-n", h.ns, "link", "set", cluster.ifname, state])


def _cut_training(cluster: SimCluster, h: SimHost) -> None:
    """A chain of the host's own firewall: packets to and from the other hosts dropped, but for
    sshd's and slurmd's (the management network)."""
    peers = ",".join(a for a in cluster.addrs if a != h.addr)
    if not peers:
        raise SimError(f"{h.name}: no other host to cut it off from")
    ipt = _in_ns(h, ["iptables", "-w"])
    run([*ipt, "-N", CUT_CHAIN], check=False)  # left from an earlier cut: flushed next
    run([*ipt, "-F", CUT_CHAIN])
    for port in MANAGEMENT_PORTS:
        for way in ("--dport", "--sport"):
            run([*ipt, "-A", CUT_CHAIN, "-p", "tcp", way, port, "-j", "RETURN"])
    run([*ipt, "-A", CUT_CHAIN, "-j", "DROP"])
    for hook, way in (("INPUT", "-s"), ("OUTPUT", "-d")):
        if run([*ipt, "-C", hook, way, peers, "-j", CUT_CHAIN], check=False).returncode != 0:
            run([*ipt, "-I", hook, way, peers, "-j", CUT_CHAIN])


def _uncut_training(cluster: SimCluster, h: SimHost) -> None:
    ipt = _in_ns(h, ["iptables", "-w"])
    for hook in ("INPUT", "OUTPUT"):
        rules = run([*ipt, "-S", hook], check=False).stdout or ""
        for rule in rules.splitlines():
            if rule.startswith(f"-A {hook} ") and rule.endswith(f"-j {CUT_CHAIN}"):
                run([*ipt, "-D", *rule.split()[1:]], check=False)
    run([*ipt, "-F", CUT_CHAIN], check=False)
    run([*ipt, "-X", CUT_CHAIN], check=False)


def _kill_all(h: SimHost) -> None:
    """SIGKILL every process in the host's network namespace (all of them ours: the sim's own
    sshd and slurmd, and what they started), until none is left."""
    for _ in range(50):  # a process forked while we kill is found by the next scan
        pids = netns_pids(h.ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    raise SimError(f"{h.name}: processes keep appearing in namespace {h.ns}: {netns_pids(h.ns)[:10]}")


def wipe_memory_tier(host: str, ram_root: Path = RAM_ROOT) -> list[Path]:
    """What a power loss does to `host`'s RAM: its part of the checkpoint memory tier, of every
    run and every user (`<ram_root>/ddplaunch-ckpt-<uid>/<run>/<host>/`), removed; the parts other
    hosts hold on this machine are left. Returns the directories removed."""
    safe_component(host, "host")
    removed = []
    for base in sorted(ram_root.glob("ddplaunch-ckpt-*")):
        if not base.is_dir() or base.is_symlink():
            continue
        for run_dir in sorted(base.iterdir()):
            if not run_dir.is_dir() or run_dir.is_symlink():
                continue
            # its own part, and the job dirs of the nodes it ran (`checkpoint.watch`: each names its host)
            owned = [d for d in sorted(run_dir.glob(f"{NODES}/*")) if _owner(d) == host]
            for part in [run_dir / host, *owned]:
                if part.is_dir() and not part.is_symlink():
                    shutil.rmtree(part, ignore_errors=True)
                    removed.append(part)
    return removed


def _owner(node_dir: Path) -> str:
    try:
        return (node_dir / OWNER).read_text().strip()
    except OSError:
        return ""


def _clear(cluster: SimCluster, h: SimHost) -> None:
    for argv in (_in_ns(h, ["tc", "qdisc", "del", "dev", cluster.ifname, "root"]),
                 ["tc", "qdisc", "del", "dev", cluster.naming.veth(h.index), "root"]):
        run(argv, check=False)  # fails harmlessly when there is no root qdisc
    _set_link(cluster, h, "up")
    if h.fault.training_cut:
        _uncut_training(cluster, h)
    if h.fault.slow is not None:
        cgroups.release(cgroups.group_name(cluster.prefix, h.name))
    host_dir = cluster.host_dir(h)
    if not sshd.is_our_sshd(h.sshd_pid, host_dir):
        h.sshd_pid = sshd.start_sshd(host_dir, cluster.enter_prefix(h))
    st = cluster.slurm
    pid = st.slurmd_pids.get(h.name) if st is not None else None
    if st is not None and pid and h.fault.down and slurm.is_our_daemon(f"slurmd@{h.name}", pid, st):
        # a host back from an outage comes back booted: its slurmd starts and registers at once
        # (one whose link only came back waits for slurmctld to ping it, up to SlurmdTimeout)
        stop_pids([pid], grace=slurm.STOP_GRACE_S)
    if st is not None and not slurm.is_our_daemon(f"slurmd@{h.name}", st.slurmd_pids.get(h.name), st):
        # it registers again by itself and, with ReturnToService=2, goes back to service
        st.slurmd_pids[h.name] = slurm.spawn([*cluster.enter_prefix(h), slurm.SLURMD, "-D", "-N", h.name,
                                              "-f", str(st.conf)], st.base / "nodes" / h.name / "slurmd.out")
    h.fault = Fault()
