"""What the checkpoint tier holds, read from its directories (`ckpt ls`, `ckpt verify`): every step
of a durable dir and of a run's RAM on this machine (each host's own saves and the buddies'
replicas it holds), and the DCP steps of the durable dir (`<durable>/dcp/step-N/`: one part per
saving rank, complete once its `.metadata` is published), each part checked against its manifest by
sizes, or by sizes and CRC-32 read in chunks (`checksums=True`). Only the manifests (JSON) are
parsed: no state is loaded or unpickled, and no file that is not a regular file is opened. The
paths are hostside/ckpt/layout.py's and dcpfiles.py's. Data and file I/O."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Iterator, Optional

from ddplaunch.errors import EXIT_BAD_INPUT, DdplaunchError
from ddplaunch.hostside.ckpt import layout
from ddplaunch.hostside.ckpt.config import RAM_ROOT
from ddplaunch.hostside.ckpt.dcpfiles import DCP_DIR, METADATA, RANKS, RankManifest
from ddplaunch.record.runs import RUN_ID_RE, load_run, run_dir

_PART = re.compile(r"part-(\d+)")
_DCP_RANK_FILE = re.compile(r"(\d+)\.(?:json|metadata)")
_DCP_DATA = re.compile(r"__(\d+)_\d+\.distcp")
#: A manifest is a few hundred bytes; a bigger file is not one (and is never read whole).
MAX_MANIFEST = 1 << 20


class CheckpointSourceError(DdplaunchError):
    """`ckpt ls|verify DIR|RUN` named no directory and no recorded run (bad input, exit 2)."""

    exit_code = EXIT_BAD_INPUT


class Place(StrEnum):
    DURABLE = "durable"
    MEMORY = "memory"


class Format(StrEnum):
    """How a step was saved: `ddplaunch.checkpoint.save` (parts `part-R/`) or `dcp_save` (a DCP
    checkpoint under `<durable>/dcp/`, a part per saving rank; its steps are apart from the others')."""

    TIER = "tier"
    DCP = "dcp"


class PartState(StrEnum):
    """One copy of a part, as its manifest judges it."""

    OK = "ok"
    #: no manifest: a RAM version not sealed yet, or a copy cut short; never loaded, not corrupt
    TORN = "torn"
    #: the manifest is unreadable, too big, or names another step or part
    BAD_MANIFEST = "bad-manifest"
    #: a file the manifest names is missing or not a regular file
    MISSING_FILE = "missing-file"
    SIZE_MISMATCH = "size-mismatch"
    CRC_MISMATCH = "crc-mismatch"

    @property
    def corrupt(self) -> bool:
        """A copy whose manifest says it is complete and whose files say otherwise."""
        return self not in (PartState.OK, PartState.TORN)


@dataclass(frozen=True)
class PartCopy:
    """One copy of one part: its state, the file at fault (`data`, `meta`, `MANIFEST`), the parts
    its manifest names, its bytes (the manifest's sizes, else what is on disk), when its manifest
    was written, and for a mismatch what the manifest expects and what the file holds (bytes for a
    size, the CRC-32 for a checksum)."""

    part: int
    state: PartState
    path: Path
    file: Optional[str] = None
    parts: Optional[int] = None
    nbytes: int = 0
    mtime: Optional[float] = None
    expected: Optional[int] = None
    found: Optional[int] = None


@dataclass(frozen=True)
class Copy:
    """One place holding parts of a step: the durable dir (`path`: the step's directory), or one
    host's RAM (`path`: the host's directory, or under it the replicas of `origin`'s parts)."""

    place: Place
    path: Path
    parts: tuple[PartCopy, ...]
    host: Optional[str] = None
    origin: Optional[str] = None
    #: a DCP step's: whether its `.metadata` is written (None: not a DCP step)
    published: Optional[bool] = None

    @property
    def ok_parts(self) -> list[int]:
        return [p.part for p in self.parts if p.state is PartState.OK]


@dataclass(frozen=True)
class StoredStep:
    """Every copy of one step that was found; complete when each of its parts is intact somewhere."""

    step: int
    copies: tuple[Copy, ...]
    format: Format = Format.TIER

    @property
    def unpublished(self) -> bool:
        """A DCP step no copy of which has its `.metadata` (never loaded, whatever its ranks hold)."""
        return self.format is Format.DCP and not any(c.published for c in self.copies)

    @property
    def parts(self) -> Optional[int]:
        """How many parts the step's manifests name (None: no part has a readable manifest)."""
        named = [p.parts for c in self.copies for p in c.parts if p.parts is not None]
        return max(named) if named else None

    @property
    def missing(self) -> list[int]:
        """The parts intact in no copy (all of them unknown when no manifest names the count)."""
        ok = {p for c in self.copies for p in c.ok_parts}
        return [p for p in range(self.parts or 0) if p not in ok]

    @property
    def complete(self) -> bool:
        return self.parts is not None and not self.missing and not self.unpublished

    @property
    def corrupt(self) -> list[tuple[Copy, PartCopy]]:
        return [(c, p) for c in self.copies for p in c.parts if p.state.corrupt]

    @property
    def nbytes(self) -> int:
        """One copy of each part's bytes: the checkpoint's size (intact copies first)."""
        best: dict[int, int] = {}
        for part in sorted((p for c in self.copies for p in c.parts), key=lambda p: p.state is PartState.OK):
            best[part.part] = part.nbytes  # an intact copy's (sorted last) wins
        return sum(best.values())

    @property
    def mtime(self) -> Optional[float]:
        """When its newest intact part was sealed or persisted."""
        times = [p.mtime for c in self.copies for p in c.parts if p.state is PartState.OK and p.mtime]
        return max(times) if times else None


@dataclass(frozen=True)
class Places:
    """Where `ckpt` looks: a durable dir (None: the run's spec names none) and, for a run, its RAM
    on this machine (`<ram_root>/ddplaunch-ckpt-<uid>/<run>`: every host's that runs here)."""

    durable: Optional[Path]
    run_id: Optional[str] = None
    ram: Optional[Path] = None


@dataclass(frozen=True)
class Listing:
    """What `scan` found: the places, whether the durable dir exists here, every step newest first."""

    places: Places
    durable_found: bool
    steps: tuple[StoredStep, ...]
    checksums: bool

    @property
    def corrupt(self) -> bool:
        return any(s.corrupt for s in self.steps)


def places_of(target: str, ram_root: Optional[Path] = None) -> Places:
    """DIR (an existing directory: its steps only) or RUN (a recorded run: the durable dir of its
    spec's `checkpoint:` section and its RAM on this machine under `ram_root`, default /dev/shm).

    Raises:
        CheckpointSourceError: neither a directory nor a recorded run.
        RunNotFoundError: the run's record is unreadable.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        return Places(path.absolute())
    if path.exists():
        raise CheckpointSourceError(f"{target}: not a directory (give a checkpoint dir or a run id)")
    if not RUN_ID_RE.fullmatch(target) or ".." in target or not (run_dir(target) / "record.json").exists():
        raise CheckpointSourceError(f"{target}: no such directory, and no recorded run of that id "
                                    "(`ddplaunch runs` lists them)")
    record = load_run(target)
    try:
        durable = record.spec.validated.checkpoint_durable()
    except ValueError as err:
        raise CheckpointSourceError(f"run {target}: its recorded spec does not validate here "
                                    f"({type(err).__name__}); give its checkpoint dir instead") from None
    ram = layout.ram_base(ram_root if ram_root is not None else RAM_ROOT) / target
    return Places(Path(durable) if durable is not None else None, target, ram)


def scan(places: Places, checksums: bool = False) -> Listing:
    """Every step the places hold, newest first, each copy of each part checked (`checksums`: every
    file read in chunks against its CRC-32, else sizes only)."""
    found: dict[int, list[Copy]] = {}
    durable = places.durable
    if durable is not None:
        for step in layout.durable_steps(durable):
            copy = _durable_copy(durable, step, checksums)
            if copy is not None:
                found.setdefault(step, []).append(copy)
    if places.ram is not None:
        for step, copy in _ram_copies(places.ram, checksums):
            found.setdefault(step, []).append(copy)
    steps = [StoredStep(s, tuple(copies)) for s, copies in found.items()]
    if durable is not None:
        steps += [StoredStep(s, (copy,), Format.DCP) for s in layout.durable_steps(durable / DCP_DIR)
                  if (copy := _dcp_copy(durable / DCP_DIR / layout.step_name(s), s, checksums)) is not None]
    steps.sort(key=lambda s: (s.step, s.format is Format.DCP), reverse=True)
    return Listing(places, durable is not None and durable.is_dir(), tuple(steps), checksums)


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _part_dirs(directory: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), directory / m.group(0)) for m in map(_PART.fullmatch, _listdir(directory)) if m)


def _durable_copy(durable: Path, step: int, checksums: bool) -> Optional[Copy]:
    step_dir = durable / layout.step_name(step)
    parts = [check_part(pdir, step, part, checksums) for part, pdir in _part_dirs(step_dir)]
    kept = tuple(p for p in parts if p is not None)
    return Copy(Place.DURABLE, step_dir, kept) if kept or step_dir.is_dir() else None


def _ram_copies(ram: Path, checksums: bool) -> Iterator[tuple[int, Copy]]:
    """(step, copy) of every version each host of the run holds here: its own, then its replicas."""
    for host in _listdir(ram):
        if not _safe(host):
            continue
        holders = [(host, ram / host)] + [(origin, ram / host / layout.REPLICAS / origin)
                                          for origin in _listdir(ram / host / layout.REPLICAS) if _safe(origin)]
        for origin, base in holders:
            by_step: dict[int, list[PartCopy]] = {}
            for part, pdir in _part_dirs(base):
                for step in layout.ram_steps(pdir):
                    got = check_part(pdir / layout.version_name(step), step, part, checksums)
                    if got is not None:
                        by_step.setdefault(step, []).append(got)
            for step, parts in by_step.items():
                yield step, Copy(Place.MEMORY, base, tuple(parts), host, origin)


def _safe(name: str) -> bool:
    try:
        layout.safe_component(name, "name")
        return True
    except layout.CheckpointError:
        return False


def _regular_size(path: Path) -> Optional[int]:
    """The size of a regular file (never a link, device or pipe: those are not opened), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _disk_bytes(part_dir: Path) -> int:
    return sum(_regular_size(part_dir / name) or 0 for name in (layout.DATA, layout.META))


def _manifest(part_dir: Path, step: int, part: int) -> tuple[layout.Manifest, float]:
    """The part's manifest when it names this step and part, and when it was written.

    Raises:
        FileNotFoundError: there is none.
        ValueError: it is unreadable, too big, or names another step or part.
    """
    size = _regular_size(part_dir / layout.MANIFEST)
    if size is None:
        if not (part_dir / layout.MANIFEST).exists():
            raise FileNotFoundError(part_dir / layout.MANIFEST)
        raise ValueError("not a regular file")
    if size > MAX_MANIFEST:
        raise ValueError("too big")
    try:
        with open(part_dir / layout.MANIFEST, "rb") as f:
            raw, mtime = f.read(MAX_MANIFEST + 1), os.fstat(f.fileno()).st_mtime
        manifest = layout.Manifest.decode(raw)
    except (OSError, KeyError, TypeError, AttributeError, layout.CheckpointError) as err:
        raise ValueError(str(err)) from None
    if (manifest.step, manifest.part) != (step, part) or set(manifest.files) != {layout.DATA, layout.META}:
        raise ValueError("names another step or part")
    return manifest, mtime


def check_part(part_dir: Path, step: int, part: int, checksums: bool) -> Optional[PartCopy]:
    """One copy of a part judged against its manifest; None when it vanished while read (a RAM
    version the tier evicted meanwhile)."""
    try:
        manifest, mtime = _manifest(part_dir, step, part)
    except FileNotFoundError:
        return PartCopy(part, PartState.TORN, part_dir, layout.MANIFEST, nbytes=_disk_bytes(part_dir)) \
            if part_dir.is_dir() else None
    except ValueError:
        return PartCopy(part, PartState.BAD_MANIFEST, part_dir, layout.MANIFEST, nbytes=_disk_bytes(part_dir))

    def judged(state: PartState, file: Optional[str] = None, expected: Optional[int] = None,
               found: Optional[int] = None) -> Optional[PartCopy]:
        if state is PartState.MISSING_FILE and not part_dir.is_dir():
            return None
        return PartCopy(part, state, part_dir, file, manifest.parts, sum(n for n, _ in manifest.files.values()),
                        mtime, expected, found)

    for name in (layout.META, layout.DATA):
        problem = _file_problem(part_dir / name, manifest.files[name], checksums)
        if problem is not None:
            return judged(problem[0], name, *problem[1:])
    return judged(PartState.OK)


def _file_problem(path: Path, want: tuple[int, int], checksums: bool
                  ) -> Optional[tuple[PartState, Optional[int], Optional[int]]]:
    """What is wrong with one file against its manifest's (size, CRC-32), and the expected and found
    values; None when nothing is."""
    want_size, want_crc = want
    size = _regular_size(path)
    if size is None:
        return PartState.MISSING_FILE, None, None
    if size != want_size:
        return PartState.SIZE_MISMATCH, want_size, size
    if checksums:
        try:
            size, crc = layout.crc_of_file(path)
        except OSError:
            return PartState.MISSING_FILE, None, None
        if size != want_size:
            return PartState.SIZE_MISMATCH, want_size, size
        if crc != want_crc:
            return PartState.CRC_MISMATCH, want_crc, crc
    return None


def _dcp_copy(step_dir: Path, step: int, checksums: bool) -> Optional[Copy]:
    """A durable DCP step: each rank that left a file in it, judged against its manifest
    (`.ranks/R.json`; its metadata is `.ranks/R.metadata`), and whether `.metadata` is published."""
    ranks = {int(m.group(1)) for m in map(_DCP_RANK_FILE.fullmatch, _listdir(step_dir / RANKS)) if m} | \
        {int(m.group(1)) for m in map(_DCP_DATA.fullmatch, _listdir(step_dir)) if m}
    if not ranks and not step_dir.is_dir():
        return None
    parts = [check_dcp_rank(step_dir, step, rank, checksums) for rank in sorted(ranks)]
    tokens = [t for _, t in parts if t is not None]
    save = max(set(tokens), key=tokens.count) if tokens else None
    kept = tuple(p if t == save else PartCopy(p.part, PartState.BAD_MANIFEST, step_dir, p.file, p.parts, p.nbytes)
                 for p, t in parts)
    return Copy(Place.DURABLE, step_dir, kept, published=_regular_size(step_dir / METADATA) is not None)


def check_dcp_rank(step_dir: Path, step: int, rank: int, checksums: bool) -> tuple[PartCopy, Optional[str]]:
    """One rank's files of a durable DCP step judged against its manifest, with the save (token) its
    manifest names (None: none readable)."""
    mark = step_dir / RANKS / f"{rank}.json"
    mine = [n for n in _listdir(step_dir) if (m := _DCP_DATA.fullmatch(n)) and int(m.group(1)) == rank]
    on_disk = sum(_regular_size(step_dir / n) or 0 for n in mine)
    size = _regular_size(mark)
    if size is None and not mark.exists():
        return PartCopy(rank, PartState.TORN, step_dir, f"{RANKS}/{rank}.json", nbytes=on_disk), None
    try:
        if size is None or size > MAX_MANIFEST:
            raise layout.TornCheckpoint("not a regular file, or too big")
        manifest, mtime = RankManifest.read(mark), os.stat(mark).st_mtime
        if (manifest.step, manifest.rank) != (step, rank) or not all(_plain(n) for n in manifest.files):
            raise layout.TornCheckpoint("names another step, rank or place")
    except (OSError, layout.TornCheckpoint):
        return PartCopy(rank, PartState.BAD_MANIFEST, step_dir, f"{RANKS}/{rank}.json", nbytes=on_disk), None
    nbytes = sum(n for n, _ in manifest.files.values())
    for name, want in sorted(manifest.files.items()):
        file = f"{RANKS}/{rank}{METADATA}" if name == METADATA else name
        problem = _file_problem(step_dir / file, want, checksums)
        if problem is not None:
            return PartCopy(rank, problem[0], step_dir, file, manifest.world, nbytes, mtime, *problem[1:]), \
                manifest.token
    return PartCopy(rank, PartState.OK, step_dir, None, manifest.world, nbytes, mtime), manifest.token


def _plain(name: str) -> bool:
    """A file name inside its directory (a manifest naming `../x` or `a/b` is not trusted)."""
    return name not in ("", ".", "..") and os.path.basename(name) == name
