"""When a DCP save bypasses RAM (dcp.py): past the tier's `memory_limit`, or when /dev/shm is full, a
rank's DCP files are written straight to the durable dir's filesystem, fsynced, into a hidden
directory beside the steps (`<durable>/dcp/.direct-<step>-<rank>-<token>/`), then sealed and renamed
into the step like a RAM version's files are copied: said once, nothing lost. Standard library and
torch only."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Optional

from ddplaunch.hostside.ckpt import layout
from ddplaunch.hostside.ckpt.config import Config
from ddplaunch.hostside.ckpt.dcpfiles import DCP_DIR

#: OS errors that mean "RAM is full here" (tier.py's): the save goes to the durable dir instead.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG})


def is_full(exc: BaseException) -> bool:
    """Whether `exc` says RAM is full: an OSError of FULL_ERRNOS, itself, as the cause of another,
    or among the failures of DCP's CheckpointException (which wraps each rank's exception)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        one = todo.pop()
        if id(one) in seen:
            continue
        seen.add(id(one))
        if isinstance(one, OSError) and one.errno in FULL_ERRNOS:
            return True
        failures = getattr(one, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
        todo += [e for e in (one.__cause__, one.__context__) if e is not None]
    return False


def state_nbytes(state: Any) -> int:
    """The bytes this rank's share of a DCP state dict holds: each tensor's local shard (a DTensor's
    own part), nested in dicts, lists and tuples; other values count nothing (they are small)."""
    import torch

    total, todo = 0, [state]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo += list(value.values())
        elif isinstance(value, (list, tuple)):
            todo += list(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _dir_bytes(directory: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def over_limit(config: Config, rank_ram: Path, nbytes: int) -> Optional[tuple[str, str]]:
    """Why a save of `nbytes` may not go to RAM under `memory_limit` (the newest `keep - 1` versions
    RAM keeps beside it, plus this one), as (key, message) said once; None when it fits."""
    limit = config.memory_limit
    if limit is None:
        return None
    held = sum(_dir_bytes(rank_ram / layout.version_name(s)) for s in layout.ram_steps(rank_ram)[:config.keep - 1])
    if held + nbytes <= limit:
        return None
    return ("limit", f"checkpoint: {config.keep} DCP versions of {nbytes} bytes exceed memory_limit ({limit} bytes): "
                     f"saves go straight to {config.durable}, nothing is lost")


def full_message(config: Config, exc: BaseException) -> tuple[str, str]:
    """What is said once when /dev/shm is full."""
    return ("full", f"checkpoint: {config.ram_root} is full ({type(exc).__name__}): DCP saves go straight to "
                    f"{config.durable} until it has room")


def direct_dir(durable: Path, step: int, rank: int, token: str) -> Path:
    """Where a save that bypasses RAM is written before it is renamed into its step (hidden: never
    a step, never listed)."""
    return durable / DCP_DIR / f".direct-{step}-{rank}-{token[:12]}"
