"""What the tier needs to know: the durable directory, the run, this host, how many versions RAM
keeps and how much RAM it may hold. From explicit arguments, else the environment the launcher sets:

    DDPLAUNCH_CHECKPOINT_DURABLE     the durable directory (else DDPLAUNCH_CHECKPOINT_DIR, the job's dir)
    DDPLAUNCH_RUN_ID                 the run (else derived from the durable directory's real path)
    DDPLAUNCH_HOST                   this host's name (else the hostname)
    DDPLAUNCH_CHECKPOINT_KEEP        versions kept in RAM (default 2)
    DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT  bytes of RAM one process's versions may hold (0: disk tier)
    DDPLAUNCH_CHECKPOINT_DURABLE_KEEP  complete steps kept in the durable dir (default: all)
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ddplaunch.hostside.ckpt.layout import CheckpointError, safe_component

DURABLE_ENV, DIR_ENV, RUN_ENV, HOST_ENV = ("DDPLAUNCH_CHECKPOINT_DURABLE", "DDPLAUNCH_CHECKPOINT_DIR",
                                           "DDPLAUNCH_RUN_ID", "DDPLAUNCH_HOST")
KEEP_ENV, LIMIT_ENV, DURABLE_KEEP_ENV = ("DDPLAUNCH_CHECKPOINT_KEEP", "DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT",
                                         "DDPLAUNCH_CHECKPOINT_DURABLE_KEEP")
RAM_ROOT = Path("/dev/shm")


@dataclass(frozen=True)
class Config:
    """One process's tier: where its checkpoints go and what RAM they may use."""

    durable: Path
    run_id: str
    host: str
    keep: int = 2
    memory_limit: Optional[int] = None
    durable_keep: Optional[int] = None
    ram_root: Path = RAM_ROOT

    def __post_init__(self) -> None:
        safe_component(self.run_id, "run id")
        safe_component(self.host, "host")
        if self.keep < 1:
            raise CheckpointError(f"keep is {self.keep}: RAM keeps at least the newest version")
        if self.memory_limit is not None and self.memory_limit < 0:
            raise CheckpointError(f"memory_limit is {self.memory_limit} bytes: give 0 or more")
        if self.durable_keep is not None and self.durable_keep < 1:
            raise CheckpointError(f"durable_keep is {self.durable_keep}: keep at least 1 (or None: all)")


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise CheckpointError(f"{name}={raw!r} is not a whole number") from None


def _clean(name: str) -> str:
    """A host name as one path component."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def resolve(durable: Optional[os.PathLike[str] | str] = None, run_id: Optional[str] = None,
            host: Optional[str] = None, keep: Optional[int] = None, memory_limit: Optional[int] = None,
            durable_keep: Optional[int] = None, ram_root: Optional[os.PathLike[str] | str] = None,
            env: Optional[Mapping[str, str]] = None) -> Config:
    """A Config from the arguments given, the rest from `env` (the process's environment).

    Raises:
        CheckpointError: no durable directory is named, or a value is not usable.
    """
    env = os.environ if env is None else env
    where = durable or env.get(DURABLE_ENV) or env.get(DIR_ENV)
    if not where:
        raise CheckpointError(f"checkpoint: no durable directory: pass configure(durable=...) or set "
                              f"{DURABLE_ENV} (or {DIR_ENV})")
    path = Path(where).expanduser().absolute()
    run = run_id or env.get(RUN_ENV) or \
        "dir-" + hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]
    limit = memory_limit if memory_limit is not None else _int(env, LIMIT_ENV)
    return Config(durable=path, run_id=run, host=host or _clean(env.get(HOST_ENV) or socket.gethostname() or "localhost"),
                  keep=keep if keep is not None else (_int(env, KEEP_ENV) or 2), memory_limit=limit,
                  durable_keep=durable_keep if durable_keep is not None else _int(env, DURABLE_KEEP_ENV),
                  ram_root=Path(ram_root) if ram_root is not None else RAM_ROOT)
