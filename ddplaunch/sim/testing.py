"""Helpers for tests that run on a sim cluster (used by tests/simfixture.py).

`shared_cluster` brings a test cluster up once per process, however many fixtures ask for
it, and holds a per-prefix session lock so two test runs on one machine take turns instead
of tearing down each other's cluster. Prefix and subnet come from DDPLAUNCH_TEST_PREFIX /
DDPLAUNCH_TEST_SUBNET (defaults dlt, 10.213.7.0/24); the Slurm test cluster's from
DDPLAUNCH_TEST_SLURM_PREFIX / DDPLAUNCH_TEST_SLURM_SUBNET (defaults dlq, 10.213.9.0/24).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ddplaunch.sim.cluster import check_requirements, sim_down, sim_up
from ddplaunch.sim.proc import SimError, run, wait_until
from ddplaunch.sim.slurm import SlurmState
from ddplaunch.sim.state import SimCluster, SimConfig
from ddplaunch.sim.statedir import prefix_lock

TEST_PREFIX = os.environ.get("DDPLAUNCH_TEST_PREFIX", "dlt")
TEST_SUBNET = os.environ.get("DDPLAUNCH_TEST_SUBNET", "10.213.7.0/24")
SLURM_TEST_PREFIX = os.environ.get("DDPLAUNCH_TEST_SLURM_PREFIX", "dlq")
SLURM_TEST_SUBNET = os.environ.get("DDPLAUNCH_TEST_SLURM_SUBNET", "10.213.9.0/24")
SESSION_LOCK_TIMEOUT_S = 600.0

_live: dict[str, tuple[SimCluster, int]] = {}  # prefix -> (cluster, users)


def missing_requirement(slurm_too: bool = False) -> str | None:
    """Why no sim cluster (with `slurm_too`: Slurm cluster) can be built here, or None."""
    try:
        check_requirements(slurm_too=slurm_too)
    except SimError as exc:
        return str(exc)
    return None


@contextmanager
def shared_cluster(n_hosts: int = 4, prefix: str = TEST_PREFIX, subnet: str = TEST_SUBNET,
                   workdir: Path | None = None, slurm: bool = False,
                   rc_noise: bool = False) -> Iterator[SimCluster]:
    """Yield a running test cluster (with `slurm`, also a Slurm cluster whose nodes are idle;
    with `rc_noise`, root's ~/.bashrc on the hosts prints RC_NOISE_STDOUT to stdout and
    RC_NOISE_STDERR to stderr in every SSH session); the last user to leave tears it down
    (also on errors). A noisy and a quiet cluster need different prefixes."""
    if prefix in _live:
        cluster, users = _live[prefix]
        if len(cluster.hosts) < n_hosts or (slurm and cluster.slurm is None) \
                or rc_noise != (cluster.rc_file is not None):
            raise SimError(f"test cluster {prefix!r} already up with {len(cluster.hosts)} hosts"
                           f"{'' if cluster.slurm else ' without Slurm'}"
                           f"{' with' if cluster.rc_file else ' without'} rc noise, {n_hosts} requested"
                           f"{' with Slurm' if slurm else ''}{' with' if rc_noise else ' without'} rc noise: "
                           "use another prefix")
        _live[prefix] = (cluster, users + 1)
        try:
            yield cluster
        finally:
            _live[prefix] = (cluster, _live[prefix][1] - 1)
        return
    with ExitStack() as stack:
        stack.enter_context(prefix_lock(prefix, "session.lock", timeout=SESSION_LOCK_TIMEOUT_S))
        state_dir = Path(tempfile.mkdtemp(prefix=f"ddplaunch-sim-{prefix}-"))
        stack.callback(shutil.rmtree, state_dir, ignore_errors=True)
        stack.callback(sim_down, state_dir, prefix=prefix, purge=False)
        cluster = sim_up(SimConfig(n_hosts=n_hosts, prefix=prefix, subnet=subnet,
                                   state_dir=state_dir, workdir=workdir, slurm=slurm, rc_noise=rc_noise))
        _live[prefix] = (cluster, 1)
        stack.callback(_live.pop, prefix, None)
        yield cluster


def ssh_client(cluster: SimCluster, host: str, timeout: float = 5.0):  # -> paramiko.SSHClient
    """A connected paramiko client to `host` that trusts only the sim's known_hosts."""
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(str(cluster.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(cluster.host(host).addr, username="root", key_filename=str(cluster.key),
                   look_for_keys=False, allow_agent=False, timeout=timeout,
                   banner_timeout=timeout, auth_timeout=timeout)
    return client


def ssh_run(cluster: SimCluster, host: str, command: str, timeout: float = 10.0) -> tuple[int, str]:
    """Run `command` on `host` over real SSH; returns (exit status, stdout)."""
    client = ssh_client(cluster, host)
    try:
        _, stdout, _ = client.exec_command(command, timeout=timeout)
        out = stdout.read().decode()
        return stdout.channel.recv_exit_status(), out
    finally:
        client.close()


def is_listening(cluster: SimCluster, host: str, port: int) -> bool:
    """True when something in `host` listens on TCP `port`."""
    out = run(["nsenter", f"--net=/run/netns/{cluster.host(host).ns}", "ss", "-Hltn",
               f"sport = :{port}"], check=False).stdout
    return bool(out.strip())


def wait_listening(cluster: SimCluster, host: str, port: int, timeout: float = 10.0) -> None:
    """Poll until `host` listens on `port`; SimError after `timeout` seconds."""
    if not wait_until(lambda: is_listening(cluster, host, port), timeout, interval=0.05):
        raise SimError(f"nothing listens on {host}:{port} after {timeout:g}s")


# ----------------------------------------------------------------------------- Slurm clients

def slurm_run(cluster: SimCluster, argv: Sequence[str], timeout: float = 15.0,
              check: bool = True) -> str:
    """Run a Slurm client (sbatch, squeue, ...) against the cluster's controller; its stdout."""
    return run(argv, env=_slurm(cluster).env(), timeout=timeout, check=check).stdout


def sbatch(cluster: SimCluster, script: Path | str, *args: str) -> int:
    """Submit a batch script; returns the job id."""
    return int(slurm_run(cluster, ["sbatch", "--parsable", *args, str(script)]).strip().split(";")[0])


def job_state(cluster: SimCluster, job_id: int) -> str:
    """The job's state from `scontrol show job` (PENDING, RUNNING, COMPLETED, CANCELLED, ...)."""
    out = slurm_run(cluster, ["scontrol", "-o", "show", "job", str(job_id)], check=False)
    for tok in out.split():
        if tok.startswith("JobState="):
            return tok.split("=", 1)[1]
    return "UNKNOWN"


def wait_job_state(cluster: SimCluster, job_id: int, states: Sequence[str], timeout: float = 30.0) -> str:
    """Poll until the job is in one of `states`; returns it (SimError after `timeout`)."""
    last = ""

    def reached() -> bool:
        nonlocal last
        last = job_state(cluster, job_id)
        return last in states

    if not wait_until(reached, timeout, interval=0.1):
        raise SimError(f"job {job_id} not {'/'.join(states)} after {timeout:g}s (state {last})")
    return last


def wait_job_gone(cluster: SimCluster, job_id: int, timeout: float = 30.0) -> float:
    """Poll `squeue -h -j ID` (not `sbatch --wait`, which polls every ~10 s) until the job has
    left the queue; returns the seconds waited (SimError after `timeout`)."""
    t0 = time.monotonic()
    if not wait_until(lambda: not slurm_run(cluster, ["squeue", "-h", "-j", str(job_id)], check=False).strip(),
                      timeout, interval=0.1):
        raise SimError(f"job {job_id} still in squeue after {timeout:g}s")
    return time.monotonic() - t0


def _slurm(cluster: SimCluster) -> SlurmState:
    if cluster.slurm is None:
        raise SimError(f"sim cluster {cluster.prefix!r} has no Slurm: bring it up with --slurm")
    return cluster.slurm
