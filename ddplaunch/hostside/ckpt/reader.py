"""Finding and reading the newest complete checkpoint: this host's RAM first (its own saves, then
the replicas it holds of other hosts' parts), then the durable dir, each copy checked against its
manifest; a torn or corrupt one is skipped for the next (said once).

Under a process group with the one part rank 0 saved (DDP: the same state on every rank), the
newest step complete anywhere wins: the lowest rank whose host holds it in RAM reads it and sends
its bytes to the others (nothing is read from the durable dir then); a step no rank holds in RAM is
read from the durable dir by every rank. With `all_ranks` (each rank its own part) every rank loads
the newest step that every rank can read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ddplaunch.hostside.ckpt import layout, statecodec
from ddplaunch.hostside.ckpt.layout import TornCheckpoint
from ddplaunch.hostside.ckpt.tier import Loaded, Source, Tier, Where, rank_world

#: Bytes sent in one broadcast: bounds the staging buffer on the device of an NCCL group.
WIRE_CHUNK = 256 << 20


def _ram_dirs(tier: Tier, part: int) -> list[tuple[str, Path]]:
    """(origin, part dir) of every RAM copy of `part` on this host: its own saves, then its replicas."""
    c = tier.config
    return [(c.host, tier.part_dir(part))] + layout.replica_part_dirs(c.ram_root, c.run_id, c.host, part)


def ram_steps(tier: Tier, part: int) -> list[int]:
    """The steps this host holds sealed (with a manifest) in RAM, its own or a replica, newest first."""
    return sorted({s for _, pdir in _ram_dirs(tier, part) for s in layout.sealed_steps(pdir)}, reverse=True)


def candidates(tier: Tier, part: int) -> list[int]:
    """Steps this process might load, newest first: RAM versions with a manifest (its own and the
    replicas it holds), durable step directories (names only: no durable file is opened)."""
    return sorted(set(ram_steps(tier, part)) | set(layout.durable_steps(tier.config.durable)), reverse=True)


def _ram_sources(tier: Tier, step: int, part: int) -> list[Source]:
    return [Source(Where.MEMORY, tier.config.host, pdir / layout.version_name(step), origin)
            for origin, pdir in _ram_dirs(tier, part)]


def _durable_source(tier: Tier, step: int, part: int) -> Source:
    return Source(Where.DURABLE, None, tier.config.durable / layout.step_name(step) / f"part-{part}")


def _sources(tier: Tier, step: int, part: int) -> list[Source]:
    return _ram_sources(tier, step, part) + [_durable_source(tier, step, part)]


def _first_intact(tier: Tier, step: int, part: int, sources: list[Source],
                  map_location: Any) -> Optional[tuple[Loaded, bytes, bytearray]]:
    """Step `step` from the first of `sources` that is complete and intact, with its meta and data
    bytes (the state's tensors are views of the data, on the CPU); None when none is."""
    for source in sources:
        if not source.path.exists():
            continue
        try:
            _, meta, data = layout.read_verified(source.path, step, part)
            if source.where is Where.DURABLE and not layout.durable_parts_complete(tier.config.durable, step):
                raise TornCheckpoint(f"{source.path.parent}: not every part of step {step} has arrived")
            return Loaded(statecodec.unpack(meta, data, map_location), step, source), meta, data
        except TornCheckpoint as exc:
            tier.say_once(f"torn:{source.path}", f"checkpoint: skipping a torn copy of step {step} ({exc})")
    return None


def load_step(tier: Tier, step: int, part: int, map_location: Any = None) -> Optional[Loaded]:
    """Step `step` of this part from the first copy that is complete and intact, else None."""
    got = _first_intact(tier, step, part, _sources(tier, step, part), map_location)
    return got[0] if got is not None else None


def load(tier: Tier, all_ranks: bool = False, map_location: Any = None) -> Optional[Loaded]:
    """The newest complete checkpoint (this rank's own part with `all_ranks`, else the one part
    rank 0 saved); under a process group, agreed by every rank (the module's docstring says how)."""
    tier.sealed()  # this process's own newest save counts
    rank, world = rank_world()
    part = rank if all_ranks else 0
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        return _agreed_each(tier, part, world, map_location) if all_ranks else _agreed(tier, part, world, map_location)
    for step in candidates(tier, part):
        got = load_step(tier, step, part, map_location)
        if got is not None:
            _adopt(tier, got, part)
            return got
    return None


def _adopt(tier: Tier, got: Loaded, part: int) -> None:
    """A step read from this host's RAM that the durable dir lacks is made durable by this process."""
    if got.source.where is Where.MEMORY:
        tier.adopt(got.step, part, got.source.path)


def _agreed(tier: Tier, part: int, world: int, map_location: Any) -> Optional[Loaded]:
    """The one part every rank loads (a collective): the newest step complete anywhere, from the
    RAM of the lowest rank's host that holds it intact, else from the durable dir on every rank."""
    import torch.distributed as dist

    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (ram_steps(tier, part), layout.durable_steps(tier.config.durable)))
    for step in sorted({s for ram, durable in seen for s in (*ram, *durable)}, reverse=True):
        for holder in (r for r, (ram, _) in enumerate(seen) if step in ram):
            got = _sent_by(tier, step, part, holder, map_location)
            if got is not None:
                return got
        listed = [step in durable for _, durable in seen]
        if all(listed):
            got = _every_rank_reads(tier, step, part, [_durable_source(tier, step, part)], world, map_location)
            if got is not None:
                return got
        elif any(listed):
            tier.say_once(f"not-common:{step}", f"checkpoint: step {step} is in no host's RAM intact and not every "
                                                "rank sees it in the durable dir: trying an older step")
    return None


def _agreed_each(tier: Tier, part: int, world: int, map_location: Any) -> Optional[Loaded]:
    """Each rank's own part (a collective): the newest step that every rank can read."""
    import torch.distributed as dist

    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, candidates(tier, part))
    common = set(seen[0]).intersection(*map(set, seen[1:]))
    newest = max((s for steps in seen for s in steps), default=None)
    if newest is not None and newest not in common:
        tier.say_once(f"not-common:{newest}", f"checkpoint: step {newest} is not readable by every rank "
                                              "(only in one host's RAM): loading the newest step they all hold")
    for step in sorted(common, reverse=True):
        got = _every_rank_reads(tier, step, part, _sources(tier, step, part), world, map_location)
        if got is not None:
            return got
    return None


def _every_rank_reads(tier: Tier, step: int, part: int, sources: list[Source], world: int,
                      map_location: Any) -> Optional[Loaded]:
    """Step `step` read by every rank from its own `sources` (a collective); None on every rank
    unless every rank found an intact copy."""
    import torch.distributed as dist

    got = _first_intact(tier, step, part, sources, map_location)
    oks: list[Any] = [None] * world
    dist.all_gather_object(oks, got is not None)
    return got[0] if got is not None and all(oks) else None


def _sent_by(tier: Tier, step: int, part: int, holder: int, map_location: Any) -> Optional[Loaded]:
    """Step `step` as rank `holder` reads it from its host's RAM (verified) and broadcasts it (a
    collective); its `.source` on every rank says where `holder` read it. None on every rank when
    `holder`'s copies are torn."""
    import torch.distributed as dist

    mine = dist.get_rank() == holder
    got = _first_intact(tier, step, part, _ram_sources(tier, step, part), map_location) if mine else None
    # the record goes as a pickled object (on an NCCL group through the current CUDA device, as
    # torch does for every object collective: each rank must have called torch.cuda.set_device)
    head: list[Any] = [None if got is None else (got[0].source, got[1], len(got[2]))]
    dist.broadcast_object_list(head, src=holder)
    if head[0] is None:
        return None
    source, meta, size = head[0]
    data = got[2] if got is not None else bytearray(size)
    _broadcast_bytes(data, holder)
    if got is not None:
        _adopt(tier, got[0], part)
        return got[0]
    return Loaded(statecodec.unpack(meta, data, map_location), step, source)


def _broadcast_bytes(data: bytearray, src: int) -> None:
    """Rank `src`'s `data` into every other rank's `data` (the same length), in `WIRE_CHUNK` pieces."""
    import torch
    import torch.distributed as dist

    if not data:
        return
    flat = torch.frombuffer(data, dtype=torch.uint8)
    # NCCL moves only CUDA tensors: through a staging buffer on this rank's current device (Gloo,
    # MPI, or a group with a CPU backend such as "cpu:gloo,cuda:nccl" move the CPU bytes in place)
    staged = torch.empty(min(len(data), WIRE_CHUNK), dtype=torch.uint8, device=torch.cuda.current_device()) \
        if str(dist.get_backend()) == "nccl" else None
    for at in range(0, len(data), WIRE_CHUNK):
        piece = flat[at:at + WIRE_CHUNK]
        if staged is None:
            dist.broadcast(piece, src)
            continue
        wire = staged[:len(piece)]
        if dist.get_rank() == src:
            wire.copy_(piece)
        dist.broadcast(wire, src)
        if dist.get_rank() != src:
            piece.copy_(wire)
