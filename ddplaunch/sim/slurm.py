"""A real Slurm cluster on the sim hosts: munged, slurmctld in a controller namespace, one
slurmd per host.

munged runs in the root namespace as user munge with its own key and a socket under the
state dir (pathname sockets are reachable from every namespace). slurmctld runs in host 0
(`<prefix>0`, hostname `<prefix>ctl`, network+10); each slurmd runs inside its host through
the same nsenter wrapper as sshd. Clients (sbatch, squeue, ...) run anywhere with
SLURM_CONF=<state>/etc/slurm.conf: they only talk to the controller's address.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddplaunch.sim.proc import SimError, pid_alive, pid_cmdline, read_pid, require_tool, run, stop_pids, wait_until


SLURMCTLD, SLURMD, MUNGED = "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"
SLURM_FIX = "install Slurm and munge: apt-get install slurm-wlm munge (or scripts/bootstrap.sh --test)"
PARTITION = "debug"
MUNGE_USER = "munge"
IDLE_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0   # a slurmd/slurmctld needs ~2 s to exit on SIGTERM

# Keep the Popen objects of daemons we started, so they are never garbage-collected while
# running (which would warn); `pid_alive` reaps them once they are stopped.
_daemons: list[subprocess.Popen[bytes]] = []


@dataclass
class SlurmState:
    """The Slurm layer of a sim cluster, as recorded in its state file."""

    conf: Path
    spec_path: Path
    controller_ns: str
    controller_name: str
    controller_addr: str
    partition: str = PARTITION
    munged_pid: int | None = None
    slurmctld_pid: int | None = None
    slurmd_pids: dict[str, int] = field(default_factory=dict)   # host name -> PID

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SlurmState:
        return cls(**{**data, "conf": Path(data["conf"]), "spec_path": Path(data["spec_path"]),
                      "slurmd_pids": {k: int(v) for k, v in data.get("slurmd_pids", {}).items()}})

    @property
    def base(self) -> Path:
        """<state>/slurm: controller state, node spools, logs, job outputs."""
        return self.conf.parent.parent / "slurm"

    @property
    def munge_socket(self) -> Path:
        return munge_dir(self.conf.parent.parent) / "munge.socket.2"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, squeue, scancel, ...): SLURM_CONF set."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}


def munge_dir(state_dir: Path) -> Path:
    return state_dir / "munge"


def require_slurm() -> None:
    """Raise SimError with the apt-get fix unless the Slurm daemons, clients and munged exist."""
    for tool in (SLURMCTLD, SLURMD, MUNGED, "sinfo", "sbatch", "squeue", "scancel", "scontrol",
                 "runuser"):
        require_tool(tool, SLURM_FIX)
    try:
        import pwd
        pwd.getpwnam(MUNGE_USER)
    except KeyError:
        raise SimError(f"no user {MUNGE_USER!r}: {SLURM_FIX}") from None


# ----------------------------------------------------------------------------- pure parts

def slurm_conf_text(*, cluster_name: str, controller: tuple[str, str], nodes: Sequence[tuple[str, str]],
                    base: Path, munge_socket: Path, partition: str = PARTITION,
                    message_timeout: int | None = None) -> str:
    """slurm.conf of a sim cluster (pure). `controller` and `nodes` are (name, addr) pairs;
    `message_timeout`: how long Slurm's daemons and srun wait for an answer (default 10 s)."""
    ctl_name, ctl_addr = controller
    lines = [
        "# written by ddplaunch sim",
        f"ClusterName={cluster_name}",
        f"SlurmctldHost={ctl_name}({ctl_addr})",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={base}/ctl/state",
        f"SlurmctldPidFile={base}/ctl/slurmctld.pid",
        f"SlurmctldLogFile={base}/ctl/slurmctld.log",
        f"SlurmdSpoolDir={base}/nodes/%n/spool",
        f"SlurmdPidFile={base}/nodes/%n/slurmd.pid",
        f"SlurmdLogFile={base}/nodes/%n/slurmd.log",
        # all hosts share one kernel: no cgroups, processes tracked by parentage
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",
    ]
    lines += [f"MessageTimeout={int(message_timeout)}"] if message_timeout else []
    lines += [f"NodeName={name} NodeAddr={addr} CPUs=2 RealMemory=2000 State=UNKNOWN"
              for name, addr in nodes]
    lines += [f"PartitionName={partition} Nodes={','.join(n for n, _ in nodes)} Default=YES "
              "MaxTime=INFINITE State=UP", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- up

def start_munged(state_dir: Path) -> int:
    """Start a private munged (own key, socket under `state_dir`/munge, user munge); its PID.

    A munged left by an earlier cluster of this state dir is stopped first.
    """
    d = munge_dir(state_dir)
    stop_munged(state_dir)
    closed = [p for p in state_dir.absolute().parents if not os.stat(p).st_mode & 0o001]
    if closed:  # munged runs as user munge and must reach its socket and log
        raise SimError(f"munged (user {MUNGE_USER}) cannot traverse {closed[0]} (mode "
                       f"{oct(os.stat(closed[0]).st_mode & 0o777)}): put the sim state dir where every "
                       "parent is world-searchable, e.g. the default under /tmp")
    d.mkdir(parents=True, exist_ok=True)
    key, pid_file, socket = d / "munge.key", d / "munged.pid", d / "munge.socket.2"
    for stale in (pid_file, socket, d / "munge.socket.2.lock"):
        stale.unlink(missing_ok=True)
    if not key.is_file() or key.stat().st_size < 32:
        key.write_bytes(os.urandom(1024))
    shutil.chown(d, MUNGE_USER, MUNGE_USER)
    for f in d.iterdir():
        shutil.chown(f, MUNGE_USER, MUNGE_USER)
    os.chmod(d, 0o755)    # munged insists that everyone may traverse its socket dir
    os.chmod(key, 0o400)
    # the state dir must be traversable by munge (and by job users) to reach the socket
    os.chmod(state_dir, os.stat(state_dir).st_mode & 0o777 | 0o711)
    run(["runuser", "-u", MUNGE_USER, "--", MUNGED, f"--socket={socket}", f"--key-file={key}",
         f"--log-file={d / 'munged.log'}", f"--pid-file={pid_file}", f"--seed-file={d / 'munged.seed'}"])
    if not wait_until(lambda: socket.is_socket() and read_pid(pid_file) is not None, 10.0):
        raise SimError(f"munged made no socket {socket} within 10s: see {d / 'munged.log'}")
    pid = read_pid(pid_file)
    assert pid is not None
    return pid


def wait_nodes_idle(st: SlurmState, names: Sequence[str], timeout: float = IDLE_TIMEOUT_S) -> None:
    """Poll `sinfo` until every node in `names` is idle; SimError (with log paths) otherwise."""
    last = ""

    def idle() -> bool:
        nonlocal last
        dead = [n for n, p in daemon_pids(st).items() if not pid_alive(p)]
        if dead:
            raise SimError(f"Slurm daemon(s) {', '.join(dead)} exited during start: see the logs "
                           f"under {st.base} ({_last_log_line(st, dead[0])})")
        last = run(["sinfo", "-h", "-N", "-o", "%N %T"], env=st.env(), check=False).stdout
        states = dict(line.split(None, 1) for line in last.splitlines() if " " in line)
        return all(states.get(n, "").strip() == "idle" for n in names)

    if not wait_until(idle, timeout, interval=0.2):
        raise SimError(f"Slurm nodes not idle after {timeout:g}s (sinfo: {last.strip() or 'nothing'}): "
                       f"see {st.base}/ctl/slurmctld.log and {st.base}/nodes/*/slurmd.log")


def spawn(argv: Sequence[str], out: Path) -> int:
    """Start a foreground (-D) daemon in its own session, output to `out`; its PID.

    The host wrapper only execs, so this PID is the daemon's own.
    """
    with open(out, "ab") as fh:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _daemons.append(proc)
    return proc.pid


# ----------------------------------------------------------------------------- down / status

def daemon_pids(st: SlurmState) -> dict[str, int]:
    """Label -> recorded PID of every daemon: munged, slurmctld, slurmd@<host>."""
    pids = {"munged": st.munged_pid, "slurmctld": st.slurmctld_pid,
            **{f"slurmd@{h}": p for h, p in st.slurmd_pids.items()}}
    return {k: v for k, v in pids.items() if v}


def is_our_daemon(label: str, pid: int | None, st: SlurmState) -> bool:
    """True when `pid` is alive and still the daemon we started (guards against PID reuse)."""
    if not pid_alive(pid):
        return False
    cmd = pid_cmdline(pid or 0)
    if label == "munged":
        return str(st.munge_socket) in cmd
    if label.startswith("slurmd@"):
        return str(st.conf) in cmd and f" -N {label.split('@', 1)[1]} " in cmd
    return str(st.conf) in cmd and SLURMCTLD in cmd


def stop_slurm(st: SlurmState, state_dir: Path) -> list[int]:
    """Stop every slurmd and slurmctld (all signalled at once), then munged; by recorded PID.

    Job steps left inside the node namespaces are ended with the namespaces. Returns the
    PIDs that were stopped.
    """
    pids = daemon_pids(st)
    slurm = [p for label, p in pids.items() if label != "munged" and is_our_daemon(label, p, st)]
    stop_pids(slurm, grace=STOP_GRACE_S)
    munged = stop_munged(state_dir)
    stopped = slurm + ([munged] if munged else [])
    st.munged_pid, st.slurmctld_pid, st.slurmd_pids = None, None, {}
    return stopped


def stop_munged(state_dir: Path) -> int | None:
    """Stop the munged of `state_dir` (found by its pid file, checked by its socket path);
    returns its PID, or None when none ran."""
    d = munge_dir(state_dir)
    pid = read_pid(d / "munged.pid")
    if pid is None or not pid_alive(pid) or str(d / "munge.socket.2") not in pid_cmdline(pid):
        return None
    stop_pids([pid])
    return pid


def _last_log_line(st: SlurmState, label: str) -> str:
    if label == "munged":
        log = munge_dir(st.conf.parent.parent) / "munged.log"
    elif label == "slurmctld":
        log = st.base / "ctl" / ("slurmctld.log" if (st.base / "ctl" / "slurmctld.log").is_file()
                                 else "slurmctld.out")
    else:
        node_dir = st.base / "nodes" / label.split("@", 1)[1]
        log = node_dir / "slurmd.log" if (node_dir / "slurmd.log").is_file() else node_dir / "slurmd.out"
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no {log}"
    return f"{log}: {lines[-1]}" if lines else f"{log} is empty"
