"""A job's own checkpoints in its memory-backed directory (`checkpoint.watch`: unmodified scripts,
the HF Trainer, Lightning, nanoGPT, pytorch/examples): which of its entries are checkpoints, when
one is complete, which step it holds, and a version of them packed into the tier. Standard
library only (the node agent runs it with `-S`; the job's process loads it beside entry.py).

A *unit* is one checkpoint the job wrote, found at most MAX_DEPTH directories deep:

- a directory holding the HF Trainer's `trainer_state.json` (its step: the state's `global_step`;
  a `checkpoint-N` directory without one is still being written),
  or DCP's `.metadata` or `.distcp` shards (its step: the last number in its name);
- a `.ckpt`, `.pt` or `.pth` file (Lightning, nanoGPT, torch.save): complete once its zip
  directory is whole; its step is the pickled dict's `global_step`, `iter_num` or `step`, read
  without unpickling anything but plain containers (no class of the job is imported or run), else
  `step=N` or the last number in its name.

A name starting with `.` or `tmp`, or ending `.tmp`/`.part`, is a write in progress (HF's
`tmp-checkpoint-N`, fsspec's temporaries): never a unit. Symbolic links are not followed.

A *version* of a step is every unit of that step on this host, packed as the tier packs a save
(layout.py: `meta` and `data` with a MANIFEST, in part FILES_PART), so the buddy copies
(replicas.py), the checks and the careful write treat both alike: `meta` is this module's JSON
(the files, their sizes and modes), `data` the files' bytes one after another.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import re
import shutil
import stat
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

try:
    from ddplaunch.hostside import payloads
    from ddplaunch.hostside.ckpt import layout
except ImportError:  # staged flat: beside agent.py (on its path), or loaded by entry.py (ckpt_siblings)
    layout = sys.modules.get("ddplaunch_hostside_layout") or importlib.import_module("layout")
    payloads = sys.modules.get("ddplaunch_hostside_payloads") or importlib.import_module("payloads")

#: The tier part a host's job-dir versions take (the API's parts are ranks, far below).
FILES_PART = 1_000_000
NODES, OWNER, FORMAT = "nodes", ".ddplaunch-host", "ddplaunch-files/1"
HF_MARKER, DCP_MARKER, DCP_SHARD = "trainer_state.json", ".metadata", ".distcp"
SAVE_SUFFIXES = (".ckpt", ".pt", ".pth")
#: The Trainer's checkpoint dirs: one without its trainer_state.json is still being written.
HF_DIR = re.compile(r"checkpoint-\d+")
MAX_DEPTH, MAX_FILES = 4, 20_000
PICKLE_MAX = 64 << 20


class Unreadable(Exception):
    """A unit whose step cannot be told (its message says why)."""


class Incomplete(Unreadable):
    """A unit the job is still writing (a Trainer's checkpoint dir without its state yet)."""


def files_dir(ram_root: Path, run_id: str, node: int) -> Path:
    """The job's checkpoint directory of node `node`: in RAM, freed with the run. Named by the node,
    not the host, so that a spare that takes the node's place has the same path (a path the job
    kept in its own state, as Lightning's ModelCheckpoint keeps its dirpath, still holds); its OWNER
    file names the host whose RAM it is (restore.py empties one another host left)."""
    return layout.ram_base(ram_root) / run_id / NODES / str(node)


@dataclass(frozen=True)
class Unit:
    """One checkpoint the job wrote: its path under the job dir and its files as last seen."""

    rel: str
    kind: str  # "hf", "dcp" or "torch"
    files: tuple[tuple[str, int, int], ...]  # (path under the job dir, bytes, mtime in ns), sorted


def in_progress(name: str) -> bool:
    return name.startswith((".", "tmp")) or name.endswith((".tmp", ".part", ".partial"))


def _tree(top: Path, rel: str) -> Iterator[tuple[str, int, int]]:
    for base, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not in_progress(d))
        for name in sorted(names):
            if in_progress(name) and name != DCP_MARKER:
                continue
            st = os.lstat(os.path.join(base, name))
            if stat.S_ISREG(st.st_mode):
                sub = os.path.relpath(os.path.join(base, name), top)
                yield f"{rel}/{sub}", st.st_size, st.st_mtime_ns


def find_units(root: Path) -> list[Unit]:
    """Every unit under `root`, by path."""
    out: list[Unit] = []

    def walk(d: Path, rel: str, depth: int) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        names = {e.name for e in entries}
        hf = HF_MARKER in names or HF_DIR.fullmatch(d.name) is not None
        if rel and (hf or DCP_MARKER in names or any(n.endswith(DCP_SHARD) for n in names)):
            out.append(Unit(rel, "hf" if hf else "dcp", tuple(_tree(d, rel))[:MAX_FILES]))
            return
        for e in entries:
            if in_progress(e.name):
                continue
            sub = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False) and depth < MAX_DEPTH:
                walk(Path(e.path), sub, depth + 1)
            elif e.is_file(follow_symlinks=False) and e.name.endswith(SAVE_SUFFIXES):
                st = e.stat(follow_symlinks=False)
                out.append(Unit(sub, "torch", ((sub, st.st_size, st.st_mtime_ns),)))

    walk(root, "", 0)
    return out


def number_in(name: str) -> Optional[int]:
    m = re.search(r"step[=_-]?(\d+)", name) or re.search(r"(\d+)\D*$", name)
    return int(m.group(1)) if m else None


class _Plain(dict):  # type: ignore[type-arg]
    """What any class of a pickle becomes when its step is read: an inert container."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        super().__init__()

    def __setstate__(self, _state: Any) -> None:
        pass

    def append(self, _item: Any) -> None:
        pass

    def extend(self, _items: Any) -> None:
        pass


class _Inert(pickle.Unpickler):
    """Unpickles containers and numbers; every class is `_Plain`, every tensor's storage None."""

    SAFE = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
            ("builtins", "slice"), ("builtins", "complex")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.SAFE:
            return super().find_class(module, name)
        return _Plain

    def persistent_load(self, pid: Any) -> Any:
        return None


def pickled_step(path: Path) -> Optional[int]:
    """The step a torch.save file (its zip's `data.pkl`) holds under payloads.STEP_KEYS, None when it names none.

    Raises:
        Unreadable: the file is not a whole torch.save archive.
    """
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not names or z.getinfo(names[0]).file_size > PICKLE_MAX:
                raise Unreadable(f"{path.name}: no data.pkl of a torch.save archive")
            raw = z.read(names[0])
        state = _Inert(io.BytesIO(raw)).load()
    except (zipfile.BadZipFile, OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError,
            AttributeError, IndexError, KeyError) as exc:
        raise Unreadable(f"{path.name}: {exc}") from exc
    return payloads.step_in(state)


def step_of(root: Path, unit: Unit) -> int:
    """The step `unit` holds (its completeness is checked on the way).

    Raises:
        Unreadable: it is not complete, or nothing in it or its name says its step.
    """
    path = root / unit.rel
    if unit.kind == "hf":
        try:
            doc = json.loads((path / HF_MARKER).read_text())
        except FileNotFoundError as exc:
            raise Incomplete(f"{unit.rel}: no {HF_MARKER} yet") from exc
        except (OSError, ValueError) as exc:
            raise Unreadable(f"{unit.rel}/{HF_MARKER}: {exc}") from exc
        step = doc.get("global_step") if isinstance(doc, dict) else None
        if isinstance(step, int) and step >= 0:
            return step
        raise Unreadable(f"{unit.rel}/{HF_MARKER} names no global_step")
    if unit.kind == "torch" and zipfile.is_zipfile(path):
        step = pickled_step(path)
        if step is not None:
            return step
    named = number_in(path.name)
    if named is None:
        raise Unreadable(f"{unit.rel}: neither its contents nor its name say which step it holds")
    return named


# -- a version: the units of one step, packed ---------------------------------------------------

def pack(root: Path, units: list[Unit], step: int, version: Path) -> None:
    """Writes `units` (all of step `step`) into the version directory `version` (meta, data); the
    caller seals it (layout.seal_ram) once it has checked that no file changed meanwhile."""
    entries = []
    fd = os.open(version / layout.DATA, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, layout.FILE_MODE)
    try:
        for unit in units:
            for rel, size, _ in unit.files:
                with open(root / rel, "rb") as src:
                    layout._sendfile(src.fileno(), fd, size)
                entries.append([rel, size, stat.S_IMODE(os.stat(root / rel).st_mode)])
    finally:
        os.close(fd)
    meta = {"format": FORMAT, "step": step, "units": [[u.rel, u.kind] for u in units], "files": entries}
    layout.write_private(version / layout.META, json.dumps(meta, sort_keys=True).encode(), sync=False)


def unchanged(root: Path, units: list[Unit]) -> bool:
    """Whether every file of `units` still has the size and time it had when they were found."""
    try:
        return all((st.st_size, st.st_mtime_ns) == (size, mtime)
                   for rel, size, mtime in (f for u in units for f in u.files) for st in [os.lstat(root / rel)])
    except OSError:
        return False


@dataclass(frozen=True)
class Packed:
    """A version's meta read back: its step, units and files (path, bytes, mode) in data's order."""

    step: int
    units: tuple[tuple[str, str], ...]
    files: tuple[tuple[str, int, int], ...]

    @classmethod
    def decode(cls, raw: bytes) -> Packed:
        """Raises layout.TornCheckpoint: not this module's meta, or a path that leaves the job dir."""
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            files = tuple((str(r), int(n), int(m)) for r, n, m in doc["files"])
            units = tuple((str(r), str(k)) for r, k in doc["units"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise layout.TornCheckpoint(f"not a job-dir checkpoint's meta: {exc}") from exc
        for rel in [r for r, _, _ in files] + [r for r, _ in units]:
            parts = Path(rel).parts
            if not parts or Path(rel).is_absolute() or ".." in parts:
                raise layout.TornCheckpoint(f"a job-dir checkpoint names {rel!r}, outside the job dir")
        return cls(int(doc["step"]), units, files)


def unpack(packed: Packed, data: bytes | bytearray | memoryview, into: Path) -> None:
    """The files of a version under `into` (a staging directory the caller renames into place)."""
    at = 0
    view = memoryview(data)
    for rel, size, mode in packed.files:
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True, mode=layout.DIR_MODE)
        layout.write_private(target, view[at:at + size], sync=False)
        os.chmod(target, mode & 0o700 or layout.FILE_MODE)
        at += size
    if at != len(view):
        raise layout.TornCheckpoint(f"a job-dir checkpoint's data holds {len(view)} bytes, its files {at}")


def put_back(packed: Packed, staged: Path, root: Path) -> None:
    """Each unit of `staged` (unpacked there) moved to its place under `root`, replacing what is
    there under that name (a unit is renamed whole: the job never sees half of one)."""
    for rel, _ in packed.units:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True, mode=layout.DIR_MODE)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.rename(staged / rel, target)
