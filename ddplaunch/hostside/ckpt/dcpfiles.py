"""The files of DCP saves in the memory tier (hostside/ckpt/dcp.py says how it works): where they
live, each rank's manifest (its save's token, world size, a checksum per file), checking a copy
against it, the careful durable writes (temp, fsync, rename) and the merge of the ranks' own
metadata into a step's global `.metadata`, written last. Standard library and torch only.

    RAM:     <ram_root>/ddplaunch-ckpt-<uid>/<run>/<host>/dcp/rank-<R>/v-<step>/{.metadata,__R_0.distcp,MANIFEST}
    durable: <durable>/dcp/step-<step>/{.metadata, __R_0.distcp..., .ranks/R.metadata, .ranks/R.json}
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ddplaunch.hostside.ckpt import dcpmeta, layout
from ddplaunch.hostside.ckpt.config import Config
from ddplaunch.hostside.ckpt.layout import TornCheckpoint

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

DCP_DIR, RANKS, METADATA = "dcp", ".ranks", ".metadata"


@dataclass(frozen=True)
class RankManifest:
    """One rank's share of a DCP save: which save (`token`, agreed by every rank), at what world
    size, and each of its files' (size, CRC-32)."""

    step: int
    rank: int
    world: int
    token: str
    files: dict[str, tuple[int, int]] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({"format": layout.FORMAT, "step": self.step, "rank": self.rank, "world": self.world,
                           "token": self.token, "files": {k: list(v) for k, v in sorted(self.files.items())}},
                          sort_keys=True).encode()

    @classmethod
    def read(cls, path: Path) -> RankManifest:
        """Raises TornCheckpoint when it is missing or not a manifest of this format."""
        try:
            doc = json.loads(path.read_bytes())
            if doc.get("format") != layout.FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            return cls(int(doc["step"]), int(doc["rank"]), int(doc["world"]), str(doc["token"]),
                       {str(k): (int(v[0]), int(v[1])) for k, v in doc["files"].items()})
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise TornCheckpoint(f"{path}: {exc}") from exc


def rank_dir(config: Config, rank: int) -> Path:
    """This host's RAM versions of rank `rank`'s DCP saves."""
    return layout.ram_base(config.ram_root) / config.run_id / config.host / DCP_DIR / f"rank-{rank}"


def step_dir(durable: Path, step: int) -> Path:
    return durable / DCP_DIR / layout.step_name(step)


def published_steps(durable: Path) -> list[int]:
    """The durable DCP steps whose `.metadata` is written (complete), newest first."""
    return [s for s in layout.durable_steps(durable / DCP_DIR) if (step_dir(durable, s) / METADATA).is_file()]


def verify(directory: Path, manifest: RankManifest) -> None:
    """Raises TornCheckpoint unless every file `manifest` names matches its size and checksum."""
    for name, want in manifest.files.items():
        try:
            got = layout.crc_of_file(directory / name)
        except OSError as exc:
            raise TornCheckpoint(f"{directory / name}: {exc}") from exc
        if got != want:
            raise TornCheckpoint(f"{directory / name} does not match its checksum")


def ram_versions(rdir: Path, rank: int, world: int) -> dict[int, RankManifest]:
    """The sealed RAM versions in `rdir` of rank `rank`'s saves at world size `world`, by step."""
    found = {}
    for step in layout.sealed_steps(rdir):
        try:
            manifest = RankManifest.read(rdir / layout.version_name(step) / layout.MANIFEST)
        except TornCheckpoint:
            continue
        if (manifest.step, manifest.rank, manifest.world) == (step, rank, world):
            found[step] = manifest
    return found


def durable_problem(target: Path, rank: int, world: int) -> Optional[str]:
    """This loading rank's share of checking a durable step (the saving ranks' files spread over the
    `world` loading ranks, each file read once): what is wrong, or None."""
    try:
        saved = sorted(int(n[:-5]) for n in os.listdir(target / RANKS) if n.endswith(".json"))
        for r in saved[rank::world]:
            manifest = RankManifest.read(target / RANKS / f"{r}.json")
            verify(target, RankManifest(manifest.step, r, manifest.world, manifest.token,
                                        {n: v for n, v in manifest.files.items() if n != METADATA}))
        return None
    except (OSError, ValueError, TornCheckpoint) as exc:
        return str(exc)


def merge_metadata(parts: list[Metadata]) -> Metadata:
    """One global DCP metadata from the ranks' own (each naming only its chunks): chunks of a
    tensor joined (a chunk saved by several ranks, a replicated value, once), storage entries joined
    (the lowest rank's copy of a replicated value wins), the planner's key mappings joined."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[Any, Any] = {}
    for part in parts:
        for key, value in part.state_dict_metadata.items():
            have = state.get(key)
            if have is None:
                state[key] = TensorStorageMetadata(value.properties, value.size, list(value.chunks)) \
                    if isinstance(value, TensorStorageMetadata) else value
            elif isinstance(have, TensorStorageMetadata) and isinstance(value, TensorStorageMetadata):
                seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
                have.chunks.extend(c for c in value.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen)
        for index, info in (part.storage_data or {}).items():
            storage.setdefault(index, info)
        planner.update(part.planner_data or {})
    first = parts[0]
    return Metadata(state, planner_data=planner or first.planner_data, storage_data=storage,
                    storage_meta=first.storage_meta, version=first.version)


def _copy_synced(source: Path, target: Path) -> None:
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, layout.FILE_MODE)
    try:
        layout.copy_file_writer(source, (0, 0))(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, target)


def marked(path: Path, token: str) -> bool:
    try:
        return RankManifest.read(path).token == token
    except TornCheckpoint:
        return False


def _move_synced(source: Path, target: Path) -> None:
    """`source`, written and fsynced on the durable dir's filesystem already, renamed into place."""
    os.rename(source, target)


def persist_rank(durable: Path, version: Path, step: int, rank: int, world: int, token: str,
                 move: bool = False) -> Path:
    """Rank `rank`'s sealed RAM `version` into the durable step `step` (nothing to do when its
    manifest of this save is there already): a published step saved again is unpublished first (a
    reader never sees old metadata over new files), then the data files and the rank's metadata,
    each fsynced and renamed, its manifest last. `move`: `version` is a save written straight to
    the durable dir's filesystem (files fsynced), its files renamed in, not copied. Returns the
    step's directory."""
    manifest = RankManifest.read(version / layout.MANIFEST)
    target = step_dir(durable, step)
    layout.private_dir(durable)
    created = not target.exists()
    ranks = layout.private_dir(target / RANKS)
    if created:
        layout.fsync_dir(target.parent)
    mark = ranks / f"{rank}.json"
    if marked(mark, token):
        return target
    (target / METADATA).unlink(missing_ok=True)
    layout.fsync_dir(target)
    put = _move_synced if move else _copy_synced
    for name in manifest.files:
        if name != METADATA:
            put(version / name, target / name)
    put(version / METADATA, ranks / f"{rank}{METADATA}")
    layout.fsync_dir(target)
    layout.replace_synced(mark, RankManifest(step, rank, world, token, manifest.files).encode())
    layout.fsync_dir(ranks)
    return target


def missing_ranks(target: Path, world: int, token: str) -> list[int]:
    """The ranks of a save (`token`) whose manifest is not yet in its durable step."""
    return [r for r in range(world) if not marked(target / RANKS / f"{r}.json", token)]


def progress(target: Path) -> tuple[float, ...]:
    """What changes while any rank is still persisting into the durable step `target`: the mtimes of
    the step's directory, of its `.ranks`, and of every temporary file a rank is writing in either
    (a rank copying a large shard moves its file's mtime; a rank that died moves nothing)."""
    seen: list[float] = []
    for directory in (target, target / RANKS):
        try:
            seen.append(os.stat(directory).st_mtime)
            names = [n for n in os.listdir(directory) if n.startswith(".tmp-")]
        except OSError:
            continue
        for name in sorted(names):
            try:
                seen.append(os.stat(directory / name).st_mtime)
            except OSError:
                seen.append(-1.0)  # renamed meanwhile: itself a change
    return tuple(seen)


def publish(target: Path, world: int) -> None:
    """The step's `.metadata`, merged from every rank's, written last (temp, fsync, rename, directory
    fsync): from now on torch's FileSystemReader loads it. The ranks' metadata are read without
    running code (dcpmeta: only DCP's metadata classes; files named inside the step).

    Raises:
        TornCheckpoint: a rank's metadata is not DCP metadata of plain files (the step is not published).
    """
    parts = [dcpmeta.loads_metadata((target / RANKS / f"{r}{METADATA}").read_bytes(), target / RANKS / f"{r}{METADATA}")
             for r in range(world)]
    layout.replace_synced(target / METADATA, pickle.dumps(merge_metadata(parts)))
    layout.fsync_dir(target)


def prune(durable: Path, keep: Optional[int]) -> None:
    """Durable DCP steps older than the newest `keep` published ones go (None: all are kept)."""
    published = published_steps(durable)
    if keep is not None and len(published) >= keep:
        layout.remove_steps(durable / DCP_DIR, [s for s in layout.durable_steps(durable / DCP_DIR)
                                                if s < published[keep - 1]])
