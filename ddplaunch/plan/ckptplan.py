"""The spec's `checkpoint:` section planned: the tier's environment for every rank
(hostside/ckpt/config.py reads it), `{checkpoint_dir}` in the job's arguments, and each node's
buddies for the memory tier's copies (hostside/ckpt/replicas.py, run by the node's agent)."""

from __future__ import annotations

from typing import Mapping

from ddplaunch.errors import PlanError
from ddplaunch.spec.model import CHECKPOINT_DIR_WORD, CheckpointTier, ClusterSpec

#: The node's environment for its agent's copies (hostside/ckpt/replicas.py reads the same names).
PORT_ENV, BUDDIES_ENV, KEY_ENV = ("DDPLAUNCH_CHECKPOINT_PORT", "DDPLAUNCH_CHECKPOINT_BUDDIES",
                                  "DDPLAUNCH_CHECKPOINT_KEY")
#: `checkpoint.watch`, and the node whose job dir the agent watches (hostside/ckpt/jobwatch.py).
WATCH_ENV, NODE_ENV = "DDPLAUNCH_CHECKPOINT_WATCH", "DDPLAUNCH_NODE_RANK"


def checkpoint_env(spec: ClusterSpec) -> dict[str, str]:
    """The `checkpoint:` section as the tier's environment (hostside/ckpt/config.py); empty without one."""
    ckpt, where, durable = spec.checkpoint, spec.checkpoint_dir(), spec.checkpoint_durable()
    if ckpt is None or where is None or durable is None:
        return {}
    env = {"DDPLAUNCH_CHECKPOINT_DIR": where, "DDPLAUNCH_CHECKPOINT_DURABLE": durable,
           "DDPLAUNCH_CHECKPOINT_KEEP": str(ckpt.keep)}
    limit = ckpt.memory_limit_bytes
    if limit is not None:  # None: no limit but the tmpfs's
        env["DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT"] = str(limit)
    if ckpt.watch:  # the job's dir in each host's RAM: entry.py names it, restores it; the agent watches it
        env[WATCH_ENV] = "1"
    return env


def watched(spec: ClusterSpec) -> bool:
    """Whether the job's own checkpoint dir is memory-backed and watched (`checkpoint.watch`)."""
    return spec.checkpoint is not None and spec.checkpoint.watch


def checkpoint_args(spec: ClusterSpec, args: list[str]) -> list[str]:
    """The job's arguments with `{checkpoint_dir}` replaced by the job's checkpoint dir (each stays
    one word: the renderers quote it).

    Raises:
        PlanError: an argument names `{checkpoint_dir}` and the spec has no `checkpoint:` section.
    """
    where = spec.checkpoint_dir()
    if watched(spec):
        return args  # the host's memory-backed dir: entry.py replaces the word there (its path holds the uid)
    if where is None:
        if any(CHECKPOINT_DIR_WORD in a for a in args):
            raise PlanError(f"job arguments: {CHECKPOINT_DIR_WORD} names the checkpoint: section's path; "
                            "add a checkpoint: section with a path")
        return args
    return [a.replace(CHECKPOINT_DIR_WORD, where) for a in args]


def replica_port(master_port: int) -> int:
    """Where a stage's agents take their buddies' copies: beside the stage's master port."""
    return master_port + 1


def buddies(rank: int, addrs: list[str], replicas: int) -> list[int]:
    """The nodes that hold node `rank`'s copies: the next `replicas` nodes on other machines,
    around the ring of nodes (each host's copies go one way: with 3 or more hosts, no two hosts
    hold each other's alone)."""
    out: list[int] = []
    for k in range(1, len(addrs)):
        j = (rank + k) % len(addrs)
        if addrs[j] != addrs[rank] and addrs[j] not in (addrs[b] for b in out):
            out.append(j)
        if len(out) == replicas:
            break
    return out


def replica_env(spec: ClusterSpec, rank: int, addrs: list[str], master_port: int,
                environ: Mapping[str, str]) -> dict[str, str]:
    """Node `rank`'s buddies (`label=addr:port`), the port its agent listens on and the run's key
    (`environ`'s: the supervisor makes one per run, a secret) for a memory tier with `replicas`;
    empty otherwise, or where no other machine takes part."""
    ckpt = spec.checkpoint
    if ckpt is None or ckpt.tier is not CheckpointTier.MEMORY or ckpt.replicas < 1 or spec.checkpoint_dir() is None:
        return {}
    chosen = buddies(rank, addrs, ckpt.replicas)
    if not chosen:
        return {}
    port = replica_port(master_port)
    return {PORT_ENV: str(port), KEY_ENV: environ.get(KEY_ENV, ""),
            BUDDIES_ENV: ",".join(f"{spec.hosts[j].label}={addrs[j]}:{port}" for j in chosen)}
