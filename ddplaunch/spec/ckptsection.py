"""The spec's `checkpoint:` section (ddplaunch.checkpoint, hostside/ckpt/): where the job's
checkpoints go, which tier takes a save first, how many versions RAM keeps. plan/launch.py turns
it into every rank's environment (hostside/ckpt/config.py reads it) and `{checkpoint_dir}` in the
job's arguments; the pre-flight checks the durable dir on every host."""

from __future__ import annotations

from enum import StrEnum
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddplaunch.spec.values import Line, parse_size
from ddplaunch.spec.yamlsafe import show


class CheckpointTier(StrEnum):
    """Where a save lands first: host RAM (persisted in the background) or the durable dir."""

    MEMORY = "memory"
    DISK = "disk"


#: What `job.args` (and `job.resume_args`, `up -- ARGS`) may name: the job's checkpoint dir.
CHECKPOINT_DIR_WORD = "{checkpoint_dir}"


class CheckpointSpec(BaseModel):
    """The job's checkpoints (ddplaunch.checkpoint, hostside/ckpt/): where they go, which tier
    takes a save first, how many versions RAM keeps. Planned into every rank's environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section (model._Strict)

    #: the job's checkpoint dir, relative to workdir (or absolute): DDPLAUNCH_CHECKPOINT_DIR and
    #: `{checkpoint_dir}` in job.args
    path: Line
    #: the shared directory saves are persisted to (relative to workdir, or absolute; it must exist
    #: and be writable on every host: the pre-flight checks); default: `path`
    durable: Optional[Line] = None
    tier: CheckpointTier = CheckpointTier.DISK
    #: copies of each save in other hosts' RAM (the memory tier; hostside/ckpt/replicas.py)
    replicas: int = Field(default=1, ge=0, le=16)
    #: versions RAM keeps
    keep: int = Field(default=2, ge=1, le=1000)
    #: bytes of RAM one process's versions may hold (4096, 512M, 8GiB); past it a save goes to
    #: the durable dir; default: no limit but the tmpfs's size
    memory_limit: Optional[Union[int, str]] = None
    #: an unmodified script (HF Trainer, Lightning, nanoGPT): `path` is memory-backed on every host
    #: (`{checkpoint_dir}` and DDPLAUNCH_CHECKPOINT_DIR name it there), the job's own complete
    #: checkpoints in it are copied to buddies and persisted to `durable` as its own files, and put
    #: back before every relaunch (hostside/ckpt/jobwatch.py, restore.py); needs `tier: memory`
    watch: bool = False

    @field_validator("path", "durable")
    @classmethod
    def _host_path(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and (not value.strip() or value.startswith("~")):
            raise ValueError(f"{show(repr(value), 60)} is not a directory on the hosts: give a path relative "
                             "to workdir, or an absolute one (~ is not expanded)")
        return value

    @field_validator("memory_limit")
    @classmethod
    def _limit(cls, value: Optional[Union[int, str]]) -> Optional[Union[int, str]]:
        if value is not None:
            parse_size(value)
        return value

    @model_validator(mode="after")
    def _watch_in_memory(self) -> "CheckpointSpec":
        if self.watch and self.tier is not CheckpointTier.MEMORY:
            raise ValueError("watch: true makes the job's checkpoint dir memory-backed: it needs tier: memory")
        return self

    @property
    def memory_limit_bytes(self) -> Optional[int]:
        """The RAM limit in bytes: 0 for the disk tier, None for no limit."""
        if self.tier is CheckpointTier.DISK:
            return 0
        return parse_size(self.memory_limit) if self.memory_limit is not None else None
