"""The simulated cluster as data: what `sim up` built, recorded in `<state_dir>/state.json`.

`SimCluster` (its hosts, keys, files and the Slurm layer), `save_state` and `load_cluster`, which
`sim down`, `sim status` and `sim fault` read. A state file is only read from a state dir that
passes statedir.check_state_dir (never one someone else could write).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import CompletedProcess

from ddplaunch.sim import netns
from ddplaunch.sim.proc import SimError, run
from ddplaunch.sim.slurm import SlurmState
from ddplaunch.sim.statedir import check_state_dir

DEFAULT_PREFIX = "dls"
DEFAULT_SUBNET = "10.213.0.0/24"
STATE_FILE = "state.json"
STATE_VERSION = 1


def default_state_dir(prefix: str) -> Path:
    return Path(f"/tmp/ddplaunch-sim-{prefix}")


@dataclass(frozen=True)
class SimConfig:
    """What `sim up` builds. `state_dir` defaults to /tmp/ddplaunch-sim-<prefix>."""

    n_hosts: int = 4
    prefix: str = DEFAULT_PREFIX
    subnet: str = DEFAULT_SUBNET
    state_dir: Path | None = None
    spec_out: Path | None = None       # default <state_dir>/cluster.yaml
    workdir: Path | None = None        # default: the current directory
    python: str | None = None          # default: sys.executable
    nproc_per_node: int = 2
    slurm: bool = False                # also run a Slurm cluster (munged, slurmctld, slurmds)
    slurm_spec_out: Path | None = None  # default <state_dir>/cluster-slurm.yaml
    slurm_nodes: int | None = None     # `slurm.nodes` in that spec; default min(2, n_hosts)
    rc_noise: bool = False             # root's ~/.bashrc on the hosts prints to stdout and stderr
    clean_home: bool = False           # sessions get an empty HOME (no rc file of this machine's: a
                                       # bench measures ddplaunch, not root's ~/.bashrc at 1,000 shells)
    slurm_message_timeout: int | None = None  # slurm.conf MessageTimeout (Slurm's default: 10 s);
                                       # a step of 128 nodes on 2 cores answers srun later than that

    @property
    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir(self.prefix)


@dataclass
class Fault:
    """Faults injected into one host (see faults.py); all off by default."""

    rate: str | None = None
    down: bool = False
    sshd_stopped: bool = False
    #: crashed: link down and every process of the host killed (its daemons too)
    crashed: bool = False
    #: training traffic cut: packets to/from the other hosts dropped but for sshd's and slurmd's
    training_cut: bool = False
    #: every process of the host limited to this percentage of one CPU (cgroups)
    slow: int | None = None

    def describe(self) -> str:
        parts = ([f"rate {self.rate}"] if self.rate else []) + (["crashed"] if self.crashed else []) \
            + (["link down"] if self.down and not self.crashed else []) \
            + (["sshd stopped"] if self.sshd_stopped else []) \
            + (["training traffic cut"] if self.training_cut else []) \
            + ([f"slowed to {self.slow}% of a CPU"] if self.slow is not None else [])
        return ", ".join(parts) or "-"


@dataclass
class SimHost:
    index: int
    name: str
    addr: str
    ns: str
    sshd_pid: int | None = None
    fault: Fault = field(default_factory=Fault)


@dataclass
class SimCluster:
    """A running sim cluster as recorded in its state file.

    `key`/`known_hosts` are the SSH client key and the known_hosts that holds exactly the
    hosts' keys; `spec_path` is the cluster spec written by `sim up`.
    """

    prefix: str
    subnet: str
    state_dir: Path
    hosts: list[SimHost]
    bridge: str
    ifname: str
    key: Path
    known_hosts: Path
    spec_path: Path
    hosts_file: Path
    resolv_conf: Path
    slurm: SlurmState | None = None   # the Slurm layer, when built with `slurm`
    rc_file: Path | None = None     # with rc_noise: the noisy rc, bind-mounted over rc_target
    rc_target: Path | None = None   # root's ~/.bashrc

    @property
    def binds(self) -> list[tuple[Path, Path]]:
        """Extra (source, target) bind mounts of every host (the noisy rc, when there is one)."""
        return [(self.rc_file, self.rc_target)] if self.rc_file and self.rc_target else []

    @property
    def naming(self) -> netns.Naming:
        return netns.Naming.parse(self.prefix, self.subnet)

    @property
    def addrs(self) -> list[str]:
        return [h.addr for h in self.hosts]

    def host(self, name_or_addr: str | SimHost) -> SimHost:
        """The host with this name (dls2) or address; raises SimError listing the valid ones."""
        if isinstance(name_or_addr, SimHost):
            return name_or_addr
        for h in self.hosts:
            if name_or_addr in (h.name, h.addr):
                return h
        valid = ", ".join(f"{h.name} ({h.addr})" for h in self.hosts)
        raise SimError(f"no sim host {name_or_addr!r} in {self.state_dir}: valid hosts are {valid}")

    def host_dir(self, host: str | SimHost) -> Path:
        return self.state_dir / "hosts" / self.host(host).name

    def enter_prefix(self, host: str | SimHost) -> list[str]:
        """argv prefix that runs whatever is appended to it inside `host`; pure."""
        h = self.host(host)
        return netns.enter_prefix(h.ns, h.name, self.hosts_file, self.resolv_conf, self.binds)

    def exec_argv(self, host: str | SimHost, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` inside `host` (its netns, hostname, /etc/hosts); pure."""
        h = self.host(host)
        return netns.enter_argv(h.ns, h.name, self.hosts_file, self.resolv_conf, argv, self.binds)

    def run(self, host: str | SimHost, argv: Sequence[str], *, timeout: float = 15.0,
            check: bool = True, input: str | None = None) -> CompletedProcess[str]:
        """Run `argv` inside `host` and capture its output (SimError on failure when check)."""
        return run(self.exec_argv(host, argv), timeout=timeout, check=check, input=input)


def host_exec_argv(cluster: SimCluster, host: str, argv: Sequence[str]) -> list[str]:
    """Function form of `SimCluster.exec_argv`."""
    return cluster.exec_argv(host, argv)


# ----------------------------------------------------------------------------- state file

def save_state(cluster: SimCluster) -> None:
    data = {"version": STATE_VERSION, **asdict(cluster)}
    data = json.loads(json.dumps(data, default=str))
    tmp = cluster.state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(cluster.state_dir / STATE_FILE)


def load_cluster(state_dir: Path | str) -> SimCluster:
    """Read the state file of a sim cluster.

    Raises:
        SimError: there is no (readable) state file; the message says how to create one.
    """
    path = Path(state_dir) / STATE_FILE
    if Path(state_dir).exists() or Path(state_dir).is_symlink():
        check_state_dir(Path(state_dir))  # never act on a state file someone else could write
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SimError(f"no sim cluster at {state_dir} (no {STATE_FILE}): "
                       "start one with `ddplaunch sim up`, or pass --prefix/--state-dir") from None
    except (OSError, ValueError) as exc:
        raise SimError(f"unreadable sim state {path}: {exc}; `ddplaunch sim up` rebuilds it") from exc
    if data.pop("version", None) != STATE_VERSION:
        raise SimError(f"sim state {path} has another format version; run `ddplaunch sim up` again")
    paths = {k: Path(data[k]) for k in ("state_dir", "key", "known_hosts", "spec_path",
                                        "hosts_file", "resolv_conf", "rc_file", "rc_target")
             if data.get(k) is not None}
    hosts = [SimHost(**{**h, "fault": Fault(**h["fault"])}) for h in data["hosts"]]
    slurm_state = SlurmState.from_dict(data["slurm"]) if data.get("slurm") else None
    return SimCluster(**{**data, **paths, "hosts": hosts, "slurm": slurm_state})
