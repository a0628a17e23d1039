"""The cluster specs `sim up` writes: one for SSH over the sim hosts, one for its Slurm (pure)."""

from __future__ import annotations

import json
from pathlib import Path

from ddplaunch.sim.state import SimCluster


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
