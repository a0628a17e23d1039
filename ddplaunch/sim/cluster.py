"""The simulated cluster as a whole: config, state file, up / down / status, cluster spec.

`sim_up` builds hosts (netns.py) and puts one sshd on each (sshd.py); with `slurm` it adds
munged, a controller namespace with slurmctld and a slurmd per host (slurm.py). Everything it
starts is recorded in `<state_dir>/state.json`, which `sim_down`, `sim_status` and `sim_fault`
read. `up` first removes whatever the state file or the naming says exists, so it repairs a
crashed or half-built cluster.

The state dir holds the client key that root logs in with, so it must be ours alone: `up`
creates it with mkdir(0700) and then checks it through an O_NOFOLLOW descriptor (a directory,
owned by us, not writable by group or others; every parent owned by root or us and not
writable by others unless sticky, like /tmp). An existing one that fails (another user made it
first, a symlink, group-writable) is refused with a SimError. Keys are made fresh by every `up`,
so no key or authorized_keys file found in the dir is ever trusted. With Slurm the dir is 0711:
munged (user munge) and non-root job users must traverse it to reach munge/munge.socket.2,
etc/slurm.conf and slurm/jobs; the x bit lets them open known names, never list or create
entries, so nothing can be planted. The private files in it are 0600.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import CompletedProcess

from ddplaunch.sim import netns, slurm, sshd
from ddplaunch.sim.proc import SimError, require_root, require_tool, run

DEFAULT_PREFIX = "dls"
DEFAULT_SUBNET = "10.213.0.0/24"
STATE_FILE = "state.json"
# what the noisy login rc of `SimConfig(rc_noise=True)` prints in every SSH session
RC_NOISE_STDOUT = "ddplaunch-sim rc noise: this line is on stdout"
RC_NOISE_STDERR = "ddplaunch-sim rc noise: this line is on stderr"
STATE_VERSION = 1
LOCK_TIMEOUT_S = 120.0


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

    @property
    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir(self.prefix)


@dataclass
class Fault:
    """Faults injected into one host (see faults.py); all off by default."""

    rate: str | None = None
    down: bool = False
    sshd_stopped: bool = False

    def describe(self) -> str:
        parts = ([f"rate {self.rate}"] if self.rate else []) + (["link down"] if self.down else []) \
            + (["sshd stopped"] if self.sshd_stopped else [])
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
    slurm: slurm.SlurmState | None = None   # the Slurm layer, when built with `slurm`
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
    slurm_state = slurm.SlurmState.from_dict(data["slurm"]) if data.get("slurm") else None
    return SimCluster(**{**data, **paths, "hosts": hosts, "slurm": slurm_state})


@contextmanager
def prefix_lock(prefix: str, suffix: str = "lock", timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Serialize sim operations on one prefix across processes (flock on a /tmp file).

    The lock file is opened without following a symlink and must be ours: one planted by
    another user is refused (SimError), it is never written through.
    """
    path = Path(f"/tmp/ddplaunch-sim-{prefix}.{suffix}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SimError(f"cannot open the sim lock file {path} ({exc.strerror}): if another user "
                       f"created it, remove it (`rm {path}`) and try again") from exc
    with os.fdopen(fd, "r+") as fh:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            raise SimError(f"sim lock file {path} belongs to {_user(owner)}, not to us: "
                           f"remove it (`rm {path}`) and try again")
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    print(f"ddplaunch sim: waiting for {path} (another process uses prefix {prefix!r})",
                          file=sys.stderr, flush=True)
                    told = True
                if time.monotonic() > deadline:
                    raise SimError(f"another process holds {path} for more than {timeout:g}s "
                                   f"(a sim up/down of prefix {prefix!r} is running)") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- the state dir

def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse(path: Path, why: str) -> SimError:
    return SimError(f"refusing sim state dir {path}: {why}; another user could have planted keys "
                    f"in it that would let them log in as root on the sim hosts. Check and remove it "
                    f"(`rm -rf {path}`), or pass --state-dir with a new path")


def check_state_dir(path: Path) -> None:
    """Raise SimError unless `path` is a real directory (not a symlink), owned by us and not
    writable by group or others. Does not create anything."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SimError(f"sim state dir {path} does not exist") from None
    _check_dir_stat(path, st)


def _check_dir_stat(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"it is a symlink (to {os.readlink(path)})")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"it belongs to {_user(st.st_uid)}, not to {_user(os.geteuid())}")
    if st.st_mode & 0o022:
        raise _refuse(path, f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _check_parents(path: Path) -> None:
    """Every existing parent of `path` (resolved) must be owned by root or us and not writable
    by others unless sticky (like /tmp): else another user could swap the state dir."""
    for parent in [path.parent.resolve(), *path.parent.resolve().parents]:
        st = os.stat(parent)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not sticky):
            raise SimError(f"refusing sim state dir {path}: its parent {parent} ({_user(st.st_uid)}, "
                           f"mode {stat.S_IMODE(st.st_mode):04o}) lets another user replace it: "
                           "pass a --state-dir under directories only root can write (the default "
                           "/tmp/ddplaunch-sim-<prefix> is fine)")


def secure_state_dir(path: Path, mode: int = 0o700) -> bool:
    """Make `path` our private state dir: create it with mkdir(0700), or accept an existing
    one only when it passes `check_state_dir`; then set `mode` (0700, or 0711 for Slurm)
    through an O_NOFOLLOW descriptor. Returns True when this call created it.

    Raises:
        SimError: the dir or a parent is not safe (names it and the fix).
    """
    if mode & 0o022:
        raise SimError(f"internal: state dir mode {mode:04o} would be writable by others")
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_parents(path)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    check_state_dir(path)  # a clear message for a symlink / foreign dir
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # swapped for a symlink since the check
        raise _refuse(path, f"it cannot be opened as a directory ({exc.strerror})") from exc
    try:
        _check_dir_stat(path, os.fstat(fd))  # the object we hold, not a name that may change
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return created


# ----------------------------------------------------------------------------- up / down

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
    for h in hosts:
        host_dir = cluster.host_dir(h)
        host_dir.mkdir(parents=True, exist_ok=True)
        sshd.write_sshd_config(host_dir, h.addr, authorized, check=h is hosts[0])
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
        slurm.start_slurm(cluster, save=lambda: save_state(cluster))
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
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    for pid_file in state_dir.glob("hosts/*/sshd.pid"):
        pid_file.unlink(missing_ok=True)
    if purge:
        shutil.rmtree(state_dir, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- cluster spec

def render_spec(cluster: SimCluster, *, python: str, workdir: Path, nproc_per_node: int = 2) -> str:
    """The cluster spec (YAML) for launching on this sim over SSH (pure)."""
    q = _yaml_scalar
    return spec_text(
        cluster, f"a simulated cluster of {len(cluster.hosts)} hosts", "sim-" + cluster.prefix, "ssh",
        python=python, workdir=workdir, nproc_per_node=nproc_per_node,
        sections=["healthcheck:",
                  "  pair_parallelism: 1   # sim hosts share this machine's cores: test pairs one by one",
                  "ssh:",
                  "  user: root",
                  f"  key: {q(str(cluster.key))}",
                  f"  known_hosts: {q(str(cluster.known_hosts))}",
                  "  host_key_policy: strict",
                  # covers banner and auth too: 128 hosts handshaking at once on a few shared
                  # cores need more than the 5 s that catch a dead host quickly in a small sim
                  f"  connect_timeout: {max(5, -(-len(cluster.hosts) // 8))}",
                  "preflight:",
                  # every host's probe competes for the same cores: at 128 hosts the last of them
                  # reaches the master ~90 s after the first (pdsh takes as long for the same probe)
                  f"  timeout: {max(15, round(0.7 * len(cluster.hosts)))}"])


def spec_text(cluster: SimCluster, what: str, name: str, backend: str, *, python: str, workdir: Path,
              nproc_per_node: int, sections: list[str], list_hosts: bool = True) -> str:
    """A sim cluster spec: the keys every sim spec shares, the backend's `sections`, the job (pure)."""
    q = _yaml_scalar
    command = "ddplaunch sim up" + (" --slurm" if backend == "slurm" else "")
    lines = [f"# written by `{command}` — {what}",
             f"name: {q(name)}",
             f"backend: {backend}"]
    if list_hosts:
        lines.append("hosts:")
        lines += [f"  - {{addr: {q(h.addr)}, name: {q(h.name)}}}" for h in cluster.hosts]
    lines += [f"nproc_per_node: {nproc_per_node}",
              f"python: {q(python)}",
              f"workdir: {q(str(workdir))}",
              "dist_backend: gloo",
              f"socket_ifname: {q(cluster.ifname)}",
              "rdzv_timeout: 30",
              *sections,
              "job:",
              "  script: jobs/toy_ddp.py",
              ""]
    return "\n".join(lines)


def render_slurm_spec(cluster: SimCluster, *, python: str, workdir: Path, nproc_per_node: int = 2,
                      nodes: int | None = None) -> str:
    """The cluster spec (YAML) for launching on this sim through Slurm (pure).

    `nodes` defaults to min(2, number of hosts); Slurm picks which (no `hosts:` list, which would
    be the exact node list).
    """
    q = _yaml_scalar
    assert cluster.slurm is not None
    n = len(cluster.hosts)
    return spec_text(
        cluster, f"a simulated Slurm cluster of {n} nodes", "sim-" + cluster.prefix + "-slurm", "slurm",
        python=python, workdir=workdir, nproc_per_node=nproc_per_node, list_hosts=False,
        sections=["slurm:",
                  f"  conf: {q(str(cluster.slurm.conf))}",
                  f"  partition: {q(cluster.slurm.partition)}",
                  f"  nodes: {nodes or min(2, n)}"])


def _yaml_scalar(value: str) -> str:
    """A plain YAML scalar when that reads back as the same string, else a quoted one."""
    import yaml  # local: only `sim up` needs it

    if value and all(c.isalnum() or c in "/._-+" for c in value) \
            and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar
