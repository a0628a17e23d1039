"""Pytest fixtures for tests that need a real (simulated) cluster.

Import them where needed (`from tests.simfixture import sim_cluster`) or re-export them
from tests/conftest.py. `sim_cluster` is session-scoped: a 4-host cluster with prefix
`dlt` on 10.213.7.0/24 (env DDPLAUNCH_TEST_PREFIX / DDPLAUNCH_TEST_SUBNET), torn down at the
end of the session, also after failures. Tests are skipped where it cannot be built (not
root, no sshd). A test that injects a fault must clear it (`sim_fault(..., clear=True)`).

`slurm_cluster` is a session-scoped 3-host sim cluster that also runs Slurm (munged,
slurmctld, a slurmd per host; all nodes idle), prefix `dlq` on 10.213.9.0/24 (env
DDPLAUNCH_TEST_SLURM_PREFIX / DDPLAUNCH_TEST_SLURM_SUBNET), so it can be up next to
`sim_cluster`. Clients need SLURM_CONF=cluster.slurm.conf (`cluster.slurm.env()`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from ddplaunch.sim import SimCluster
from ddplaunch.sim.testing import SLURM_TEST_PREFIX, SLURM_TEST_SUBNET, missing_requirement, shared_cluster

SIM_HOSTS = 4
SLURM_HOSTS = 3


def real_system(reason: str | None):
    """Decorator of a real-system test that uses no sim fixture: marked root (counted, and with
    CI=true failing when skipped, by conftest) and skipped with `reason` where it cannot run."""
    def apply(fn):
        return pytest.mark.root(pytest.mark.skipif(bool(reason), reason=reason or "")(fn))
    return apply


def sim_skip_reason() -> str | None:
    """Reason to skip sim tests here, or None (for `pytest.mark.skipif`)."""
    reason = missing_requirement()
    return f"needs root, ip and sshd: {reason}" if reason else None


@pytest.fixture(scope="session")
def sim_cluster() -> Iterator[SimCluster]:
    """A running 4-host sim cluster (SimCluster: .hosts, .spec_path, .key, .known_hosts, .run)."""
    reason = sim_skip_reason()
    if reason:
        pytest.skip(reason)
    with shared_cluster(SIM_HOSTS) as cluster:
        drop_leftover_cuts([h.addr for h in cluster.hosts])
        yield cluster


def slurm_skip_reason() -> str | None:
    """Reason to skip Slurm sim tests here, or None (for `pytest.mark.skipif`)."""
    reason = missing_requirement(slurm_too=True)
    return f"needs root, ip, sshd, Slurm and munge: {reason}" if reason else None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SimCluster]:
    """A running 3-host sim cluster with Slurm (SimCluster with .slurm: conf, env(), PIDs)."""
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    with shared_cluster(SLURM_HOSTS, prefix=SLURM_TEST_PREFIX, subnet=SLURM_TEST_SUBNET,
                        slurm=True) as cluster:
        drop_leftover_cuts([h.addr for h in cluster.hosts])
        yield cluster


def drop_leftover_cuts(addrs: list[str]) -> None:
    """Remove what a test killed mid-way may have left on this machine between it and the sim
    hosts `addrs`: iptables DROP rules (test_recovery's launcher cut off) and blackhole routes
    (test_bastion's unroutable hosts). Every later test would find the hosts unreachable."""
    listed = subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines():
        words = line.split()
        if words[:1] == ["-A"] and "DROP" in words and any(f"{a}/32" in words for a in addrs):
            subprocess.run(["iptables", "-w", "-D", *words[1:]], capture_output=True, timeout=30)
    for addr in addrs:
        subprocess.run(["ip", "route", "del", "blackhole", f"{addr}/32"], capture_output=True, timeout=10)


#: How long a Slurm test waits for the nodes the test before it used to be idle again (a cancelled
#: job that held a node that was down stays COMPLETING until that node answers: up to ~40 s seen).
SETTLE_S = 120.0


def slurm_nodes_idle(cluster: SimCluster) -> SimCluster:
    """`cluster` once every Slurm node is idle (SimError naming sinfo's answer after SETTLE_S): a
    test starts on the cluster it assumes, whatever the test before it left completing."""
    from ddplaunch.sim.slurm import wait_nodes_idle

    assert cluster.slurm is not None
    wait_nodes_idle(cluster.slurm, [h.name for h in cluster.hosts], timeout=SETTLE_S)
    return cluster


@pytest.fixture(scope="session")
def noisy_sim_cluster() -> Iterator[SimCluster]:
    """A 2-host sim cluster whose root ~/.bashrc prints to stdout and stderr in every SSH session
    (RC_NOISE_STDOUT / RC_NOISE_STDERR), like real hosts' conda, module or banner lines."""
    reason = sim_skip_reason()
    if reason:
        pytest.skip(reason)
    with shared_cluster(2, prefix=os.environ.get("DDPLAUNCH_TEST_NOISY_PREFIX", "dln"),
                        subnet=os.environ.get("DDPLAUNCH_TEST_NOISY_SUBNET", "10.213.10.0/24"),
                        rc_noise=True) as cluster:
        yield cluster


def podman_skip_reason() -> str | None:
    """Reason to skip real-container tests here, or None."""
    import shutil

    if os.geteuid() != 0:
        return "needs root (podman as root, debootstrap)"
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        return "needs podman, runc, uidmap, debootstrap: scripts/bootstrap.sh --test"
    return None


@pytest.fixture(scope="session")
def image() -> str:
    """The real-container test image (ddplaunch/sim/image.py), built on first use (~2 minutes,
    1.15 GB) and kept in podman's storage as the cache."""
    import sys
    import time

    from ddplaunch.sim.image import ensure_test_image

    reason = podman_skip_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    name = ensure_test_image()
    sys.stderr.write(f"test image {name} ready in {time.monotonic() - t0:.1f}s\n")
    return name

