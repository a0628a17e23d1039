"""What a sim cluster looks like right now: per host, namespace, sshd, link and shaping;
per Slurm daemon, whether it runs and (for a slurmd) its node's state in `sinfo`.

Status reads the state file and then checks reality (namespaces, PIDs, link state, root
qdiscs), so it also shows what a crash or a manual change left behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ddplaunch.sim import netns, slurm, sshd
from ddplaunch.sim.proc import require_root, run
from ddplaunch.sim.state import load_cluster


@dataclass(frozen=True)
class HostStatus:
    name: str
    addr: str
    ns: str
    ns_exists: bool
    sshd_pid: int | None
    sshd_alive: bool
    link: str       # operstate of the in-host interface: up, down, lowerlayerdown, or "-"
    qdisc: str      # root qdisc kinds "in-host/bridge-side", e.g. "tbf/tbf", "-" when default
    fault: str      # the faults recorded in the state, "-" for none

    @property
    def healthy(self) -> bool:
        return self.ns_exists and self.sshd_alive and self.link == "up"


def sim_status(state_dir: Path | str) -> list[HostStatus]:
    """Status of every host of the cluster at `state_dir` (SimError when there is none)."""
    require_root("ddplaunch sim status")
    cluster = load_cluster(state_dir)
    existing = set(netns.list_netns())
    bridge_links = netns.list_links()
    out = []
    for h in cluster.hosts:
        exists = h.ns in existing
        link, inner = "-", "-"
        if exists:
            info = netns.list_links(h.ns).get(cluster.ifname, {})
            link = str(info.get("operstate", "-")).lower()
            inner = _root_qdisc(["nsenter", f"--net={netns.NETNS_DIR / h.ns}", "tc"], cluster.ifname)
        veth = cluster.naming.veth(h.index)
        outer = _root_qdisc(["tc"], veth) if veth in bridge_links else "-"
        qdisc = "-" if inner == outer == "-" else f"{inner}/{outer}"
        out.append(HostStatus(h.name, h.addr, h.ns, exists, h.sshd_pid,
                              sshd.is_our_sshd(h.sshd_pid, cluster.host_dir(h)), link, qdisc,
                              h.fault.describe()))
    return out


@dataclass(frozen=True)
class DaemonStatus:
    label: str            # munged, slurmctld, slurmd@<host>
    where: str            # "root netns" or the namespace
    pid: int | None
    alive: bool
    node_state: str       # sinfo state of a slurmd's node (idle, alloc, down*, ...), "" otherwise

    @property
    def healthy(self) -> bool:
        return self.alive and (not self.label.startswith("slurmd@") or not self.node_state.endswith("*"))


def slurm_status(state_dir: Path | str) -> list[DaemonStatus]:
    """Status of every Slurm daemon of the cluster at `state_dir`; [] without a Slurm layer."""
    require_root("ddplaunch sim status")
    cluster = load_cluster(state_dir)
    st = cluster.slurm
    if st is None:
        return []
    nodes: dict[str, str] = {}
    if slurm.is_our_daemon("slurmctld", st.slurmctld_pid, st):
        out = run(["sinfo", "-h", "-N", "-o", "%N %T"], env=st.env(), check=False, timeout=5).stdout
        nodes = dict(line.split(None, 1) for line in out.splitlines() if " " in line)
    where = {"munged": "root netns", "slurmctld": st.controller_ns,
             **{f"slurmd@{h.name}": h.ns for h in cluster.hosts}}
    pids = {"munged": st.munged_pid, "slurmctld": st.slurmctld_pid,
            **{f"slurmd@{h.name}": st.slurmd_pids.get(h.name) for h in cluster.hosts}}
    return [DaemonStatus(label, where[label], pid, slurm.is_our_daemon(label, pid, st),
                         nodes.get(label.split("@", 1)[1], "?").strip() if "@" in label else "")
            for label, pid in pids.items()]


def _root_qdisc(tc: list[str], dev: str) -> str:
    """Kind of the root qdisc of `dev` when it is a shaping one, else "-"."""
    proc = run([*tc, "-j", "qdisc", "show", "dev", dev], check=False)
    try:
        entries = json.loads(proc.stdout or "[]")
    except ValueError:
        return "?"
    for q in entries:
        if q.get("root") and q.get("kind") not in ("noqueue", "pfifo_fast", "fq_codel", "mq", "noop"):
            return str(q["kind"])
    return "-"
