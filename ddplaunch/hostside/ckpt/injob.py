"""The functions of `ddplaunch.checkpoint` (the package's docstring says how the tier works): one
tier per process, configured from the arguments or the environment."""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ddplaunch.hostside import payloads
from ddplaunch.hostside.ckpt import layout, reader
from ddplaunch.hostside.ckpt.config import RUN_ENV, Config, resolve
from ddplaunch.hostside.ckpt.layout import CheckpointError, TornCheckpoint
from ddplaunch.hostside.ckpt.tier import CheckpointWarning, Loaded, Source, Tier, Where, rank_world

__all__ = ["CheckpointError", "CheckpointWarning", "Config", "Loaded", "Source", "TornCheckpoint", "Where",
           "close", "configure", "current_config", "free", "load", "save", "wait"]

_lock = threading.Lock()
_tier: Optional[Tier] = None


def configure(durable: Optional[os.PathLike[str] | str] = None, *, run_id: Optional[str] = None,
              host: Optional[str] = None, keep: Optional[int] = None, memory_limit: Optional[int] = None,
              durable_keep: Optional[int] = None, ram_root: Optional[os.PathLike[str] | str] = None) -> Config:
    """Sets this process's tier; what is not given comes from the environment (`config.py`).

    A tier configured before is closed first (its newest save made durable). Without a call, the
    first save or load configures from the environment alone.

    Raises:
        CheckpointError: no durable directory is known, or a value is unusable.
    """
    global _tier
    config = resolve(durable, run_id, host, keep, memory_limit, durable_keep, ram_root)
    with _lock:
        old, _tier = _tier, Tier(config)
    if old is not None:
        old.close()
    return config


def _current() -> Tier:
    global _tier
    with _lock:
        if _tier is None:
            _tier = Tier(resolve())
        return _tier


def current_config() -> Config:
    """This process's tier's configuration (the environment's when `configure` was not called).

    Raises:
        CheckpointError: no durable directory is known, or a value is unusable.
    """
    return _current().config


def save(state: Any, step: int, *, all_ranks: bool = False) -> bool:
    """Copies `state`'s tensors into this host's RAM and returns; persisting happens in the background.

    Args:
        state: any picklable structure of tensors (a model's and optimizer's state_dict) and small
            values (numbers, strings): those are pickled, tensor bytes never are.
        step: the checkpoint's step; `load` returns the highest complete one.
        all_ranks: every rank saves its own part (sharded states); by default only rank 0 saves.

    Returns:
        True where this rank saved, False where the call was a no-op (not rank 0).

    Raises:
        CheckpointError: a save that had to go to the durable directory could not be written.
    """
    return _current().save(state, step, all_ranks)


def load(*, all_ranks: bool = False, map_location: Any = None) -> Optional[Loaded]:
    """The newest complete checkpoint as `(state, step)` (`.source` says where from), or None.

    Tensors come back on the CPU unless `map_location` names a device. Under a process group every
    rank must call it; all get the same step. Under ddplaunch, rank 0 says what it loaded (a
    `Loaded` payload line the launcher reads: the step, and where it was read).
    """
    got = reader.load(_current(), all_ranks, map_location)
    if got is not None and rank_world()[0] == 0 and os.environ.get(RUN_ENV) and payloads.under_torchrun():
        source = got.source
        payloads.say(payloads.Loaded(0, str(source.path)[:300], "ddplaunch.checkpoint", step=got.step,
                                     source=source.where.value, host=source.host or "", origin=source.origin or ""))
    return got


def wait(timeout: Optional[float] = None) -> Optional[int]:
    """Blocks until this process's newest save is durable; returns its step (None: none saved).

    Raises:
        CheckpointError: persisting it failed (the reason is in the message).
        TimeoutError: it was not durable within `timeout` seconds.
    """
    with _lock:
        tier = _tier
    return tier.wait(timeout) if tier is not None else None


def free(run_id: Optional[str] = None, *, host: Optional[str] = None,
         ram_root: Optional[os.PathLike[str] | str] = None) -> None:
    """Removes a run's checkpoints from this machine's RAM (one host's part with `host`).

    Without `run_id`, this process's run, whose newest save is made durable first.
    """
    global _tier
    with _lock:
        tier = _tier
    if tier is not None and run_id in (None, tier.config.run_id):
        tier.close()
        with _lock:
            _tier = None if _tier is tier else _tier
        run_id = tier.config.run_id
        ram_root = ram_root if ram_root is not None else tier.config.ram_root
    if run_id is None:
        raise CheckpointError("free: which run? give its id (no tier is configured in this process)")
    layout.safe_component(run_id, "run id")
    run_dir = layout.ram_base(Path(ram_root) if ram_root is not None else Path("/dev/shm")) / run_id
    shutil.rmtree(run_dir / layout.safe_component(host, "host") if host else run_dir, ignore_errors=True)


def close() -> Optional[int]:
    """Finishes persisting this process's newest save and releases its tier; returns that step
    (None: nothing saved). Under ddplaunch a rank that saved says so (a `Durable` payload: its
    step, how long this waited, or why it is not durable), which the run's summary shows. Runs at
    interpreter exit by itself; call it before an `os._exit`, which skips exit handlers."""
    global _tier
    with _lock:
        tier, _tier = _tier, None
    return None if tier is None else closed_saying(tier, rank_world()[0])


def closed_saying(tier: Any, rank: Optional[int]) -> Optional[int]:
    """Closes `tier` (this module's, or dcp.py's: its newest save made durable) and returns that
    step; under ddplaunch `rank` (None: a rank that does not speak for its saves) says it in a
    `Durable` payload: its step, how long the close waited, why it is not durable."""
    started = time.monotonic()
    failed = tier.close()
    step: Optional[int] = tier.saved_step
    if step is not None and rank is not None and os.environ.get(RUN_ENV) and payloads.under_torchrun():
        payloads.say(payloads.Durable(rank, step, round(time.monotonic() - started, 3), (failed or "")[:300]))
    return step


atexit.register(close)
