"""The process group's part in DCP saves through the memory tier (dcp.py): this process's rank and
world, every rank's value of something, a token every rank of one save agrees on, and writing one
rank's own DCP files without collectives. Standard library and torch only."""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

from ddplaunch.hostside.ckpt.dcpfiles import METADATA


def distributed() -> bool:
    """Whether a process group is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """DCP without its warning that no process group means one process (it is meant: a rank's own
    RAM copy is read without collectives)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def gather(value: Any) -> list[Any]:
    """Every rank's `value` (a collective under a process group)."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def agreed_token() -> str:
    """A token of one save, rank 0's, the same on every rank (a collective)."""
    import torch.distributed as dist

    box = [uuid.uuid4().hex]
    if rank_and_world()[1] > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


def write_dcp(state_dict: dict[str, Any], directory: Path, rank: int, sync: bool) -> None:
    """This rank's DCP files (its data and a metadata of its own chunks, `.metadata`) in `directory`."""
    import torch.distributed.checkpoint as dcp

    with one_process():
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(directory, sync_files=sync),
                 no_dist=not distributed(), use_collectives=False)
    os.rename(directory / f"__{rank}{METADATA}", directory / METADATA)
