"""Helpers for tests that run on a sim cluster (used by tests/simfixture.py).

`shared_cluster` brings a test cluster up once per process, however many fixtures ask for
it, and holds a per-prefix session lock so two test runs on one machine take turns instead
of tearing down each other's cluster. Prefix and subnet come from DDPLAUNCH_TEST_PREFIX /
DDPLAUNCH_TEST_SUBNET (defaults dlt, 10.213.7.0/24).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ddplaunch.sim.cluster import SimCluster, SimConfig, check_requirements, prefix_lock, sim_down, sim_up
from ddplaunch.sim.proc import SimError, run, wait_until

TEST_PREFIX = os.environ.get("DDPLAUNCH_TEST_PREFIX", "dlt")
TEST_SUBNET = os.environ.get("DDPLAUNCH_TEST_SUBNET", "10.213.7.0/24")
SESSION_LOCK_TIMEOUT_S = 600.0

_live: dict[str, tuple[SimCluster, int]] = {}  # prefix -> (cluster, users)


def missing_requirement() -> str | None:
    """Why no sim cluster can be built here (not root, no sshd, ...), or None."""
    try:
        check_requirements()
    except SimError as exc:
        return str(exc)
    return None


@contextmanager
def shared_cluster(n_hosts: int = 4, prefix: str = TEST_PREFIX, subnet: str = TEST_SUBNET,
                   workdir: Path | None = None) -> Iterator[SimCluster]:
    """Yield a running test cluster; the last user to leave tears it down (also on errors)."""
    if prefix in _live:
        cluster, users = _live[prefix]
        if len(cluster.hosts) < n_hosts:
            raise SimError(f"test cluster {prefix!r} already up with {len(cluster.hosts)} hosts, "
                           f"{n_hosts} requested: use another DDPLAUNCH_TEST_PREFIX")
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
                                   state_dir=state_dir, workdir=workdir))
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
