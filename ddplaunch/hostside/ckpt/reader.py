"""Finding and reading the newest complete checkpoint: this host's RAM first, then the durable dir,
each copy checked against its manifest; a torn or corrupt one is skipped for the next (said once).
Under a process group every rank loads the same step: the newest that every rank can read.
"""

from __future__ import annotations

from typing import Any, Optional

from ddplaunch.hostside.ckpt import layout, statecodec
from ddplaunch.hostside.ckpt.layout import TornCheckpoint
from ddplaunch.hostside.ckpt.tier import Loaded, Source, Tier, Where, rank_world


def candidates(tier: Tier, part: int) -> list[int]:
    """Steps this process might load, newest first: RAM versions with a manifest, durable step
    directories (names only: no durable file is opened)."""
    pdir = tier.part_dir(part)
    ram = {s for s in layout.ram_steps(pdir) if (pdir / layout.version_name(s) / layout.MANIFEST).is_file()}
    return sorted(ram | set(layout.durable_steps(tier.config.durable)), reverse=True)


def _sources(tier: Tier, step: int, part: int) -> list[Source]:
    ram = tier.part_dir(part) / layout.version_name(step)
    durable = tier.config.durable / layout.step_name(step) / f"part-{part}"
    return [Source(Where.MEMORY, tier.config.host, ram), Source(Where.DURABLE, None, durable)]


def load_step(tier: Tier, step: int, part: int, map_location: Any = None) -> Optional[Loaded]:
    """Step `step` of this part from the first copy that is complete and intact, else None."""
    for source in _sources(tier, step, part):
        if not source.path.exists():
            continue
        try:
            manifest, meta, data = layout.read_verified(source.path, step, part)
            if source.where is Where.DURABLE and not layout.durable_parts_complete(tier.config.durable, step):
                raise TornCheckpoint(f"{source.path.parent}: not every part of step {step} has arrived")
            return Loaded(statecodec.unpack(meta, data, map_location), step, source)
        except TornCheckpoint as exc:
            tier.say_once(f"torn:{source.path}", f"checkpoint: skipping a torn copy of step {step} ({exc})")
    return None


def load(tier: Tier, all_ranks: bool = False, map_location: Any = None) -> Optional[Loaded]:
    """The newest complete checkpoint this rank can read (its own part with `all_ranks`, else the
    one part rank 0 saved); under a process group, the newest step that every rank can read."""
    tier.sealed()  # this process's own newest save counts
    rank, world = rank_world()
    part = rank if all_ranks else 0
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        return _agreed(tier, part, world, map_location)
    for step in candidates(tier, part):
        got = load_step(tier, step, part, map_location)
        if got is not None:
            return got
    return None


def _agreed(tier: Tier, part: int, world: int, map_location: Any) -> Optional[Loaded]:
    import torch.distributed as dist

    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, candidates(tier, part))
    common = set(seen[0]).intersection(*map(set, seen[1:]))
    newest = max((s for steps in seen for s in steps), default=None)
    if newest is not None and newest not in common:
        tier.say_once(f"not-common:{newest}", f"checkpoint: step {newest} is not readable by every rank "
                                              "(only in one host's RAM): loading the newest step they all hold")
    for step in sorted(common, reverse=True):
        got = load_step(tier, step, part, map_location)
        oks: list[Any] = [None] * world
        dist.all_gather_object(oks, got is not None)
        if all(oks):
            return got
    return None
