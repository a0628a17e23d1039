"""Where a checkpoint's parts live and how a reader knows one is complete: the paths of both tiers,
their permissions, the manifest (written last, a checksum per file) and the careful durable write
(temp, fsync, rename, directory fsync). Standard library only.

A part is one process's share of a checkpoint (`part-R/`: `data`, `meta`, `MANIFEST`); a step is
complete when every one of its parts has its manifest and every file matches it.

    RAM:     <ram_root>/ddplaunch-ckpt-<uid>/<run>/<host>/part-<R>/v-<step>/{data,meta,MANIFEST}
    replica: <ram_root>/ddplaunch-ckpt-<uid>/<run>/<host>/replicas/<origin>/part-<R>/v-<step>/...
             (a buddy's copy of <origin>'s part, in <host>'s RAM: hostside/ckpt/replicas.py)
    durable: <durable>/step-<step>/part-<R>/{data,meta,MANIFEST}
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

FORMAT = 1
DATA, META, MANIFEST = "data", "meta", "MANIFEST"
REPLICAS = "replicas"
FILE_MODE, DIR_MODE = 0o600, 0o700
CHUNK = 8 << 20
_SAFE = re.compile(r"[A-Za-z0-9._-]+")
_VERSION = re.compile(r"v-(\d{12})")
_STEP = re.compile(r"step-(\d{12})")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or a tier's directory is not safe to use."""


class TornCheckpoint(CheckpointError):
    """A copy that is incomplete or does not match its manifest: never loaded."""


def safe_component(value: str, what: str) -> str:
    """`value` as one path component: a run id or host never climbs out of its directory."""
    if not _SAFE.fullmatch(value) or value in (".", ".."):
        raise CheckpointError(f"{what} {value!r} cannot name a directory (letters, digits, '.', '_', '-')")
    return value


def private_dir(path: Path) -> Path:
    """Creates `path` (and its parents) 0700 if missing; refuses one that is a link or not ours."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise CheckpointError(f"{path} is not a directory of this user's: refusing to keep checkpoints there")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def ram_base(ram_root: Path) -> Path:
    return ram_root / f"ddplaunch-ckpt-{os.getuid()}"


def ram_part_dir(ram_root: Path, run_id: str, host: str, part: int) -> Path:
    return ram_base(ram_root) / run_id / host / f"part-{part}"


def replica_part_dir(ram_root: Path, run_id: str, host: str, origin: str, part: int) -> Path:
    """Where `host` keeps its copy of `origin`'s part (a buddy's replica), apart from its own saves."""
    return ram_base(ram_root) / run_id / host / REPLICAS / origin / f"part-{part}"


def replica_part_dirs(ram_root: Path, run_id: str, host: str, part: int) -> list[tuple[str, Path]]:
    """(origin, directory) of every replica of part `part` that `host` holds, by origin."""
    base = ram_base(ram_root) / run_id / host / REPLICAS
    try:
        origins = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    return [(o, base / o / f"part-{part}") for o in origins if _SAFE.fullmatch(o) and o not in (".", "..")]


def version_name(step: int) -> str:
    return f"v-{step:012d}"


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def _steps(directory: Path, pattern: re.Pattern[str]) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for m in map(pattern.fullmatch, names) if m), reverse=True)


def ram_steps(part_dir: Path) -> list[int]:
    """The steps this part holds in RAM, newest first (complete or not)."""
    return _steps(part_dir, _VERSION)


def sealed_steps(part_dir: Path) -> list[int]:
    """The steps this part holds sealed in RAM (their manifest written), newest first."""
    return [s for s in ram_steps(part_dir) if (part_dir / version_name(s) / MANIFEST).is_file()]


def durable_steps(durable: Path) -> list[int]:
    """The steps the durable directory names, newest first (complete or not): a listing, no file opened."""
    return _steps(durable, _STEP)


@dataclass(frozen=True)
class Manifest:
    """What a complete part holds: its step, which of how many parts, each file's size and CRC-32."""

    step: int
    part: int
    parts: int
    files: dict[str, tuple[int, int]]

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "step": self.step, "part": self.part, "parts": self.parts,
                           "files": {k: {"bytes": n, "crc32": c} for k, (n, c) in sorted(self.files.items())}},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise TornCheckpoint(f"manifest format {doc.get('format')!r}, not {FORMAT}")
        return cls(int(doc["step"]), int(doc["part"]), int(doc["parts"]),
                   {k: (int(v["bytes"]), int(v["crc32"])) for k, v in doc["files"].items()})


def crc_of_file(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file, read in chunks (zlib releases the GIL on each)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def read_verified(part: Path, step: int, part_no: int) -> tuple[Manifest, bytes, bytearray]:
    """The manifest, meta and data of a complete part, each file checked against the manifest.

    Raises:
        TornCheckpoint: the manifest or a file is missing, or a file's size or checksum differs.
    """
    try:
        manifest = Manifest.decode((part / MANIFEST).read_bytes())
        if (manifest.step, manifest.part) != (step, part_no) or set(manifest.files) != {DATA, META}:
            raise TornCheckpoint(f"{part}: its manifest names step {manifest.step} part {manifest.part}")
        meta = (part / META).read_bytes()
        size = manifest.files[DATA][0]
        data = bytearray(size)
        with open(part / DATA, "rb") as f:
            got = f.readinto(data)
            extra = f.read(1)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TornCheckpoint(f"{part}: {exc}") from exc
    if got != size or extra:
        raise TornCheckpoint(f"{part}/{DATA} holds a different number of bytes than its manifest says")
    for name, body in ((META, meta), (DATA, data)):
        if (len(body), zlib.crc32(body)) != manifest.files[name]:
            raise TornCheckpoint(f"{part}/{name} does not match its checksum")
    return manifest, meta, data


def write_private(path: Path, body: bytes | bytearray | memoryview, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(path: Path, body: bytes | bytearray | memoryview, tag: str = "") -> None:
    """`body` as `path`: a temporary file beside it (named by `tag`, the writer, and this process),
    fsynced, then renamed over it (the directory's fsync is the caller's)."""
    tmp = path.with_name(f".tmp-{path.name}-{tag + '-' if tag else ''}{os.getpid()}")
    write_private(tmp, body, sync=True)
    os.rename(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_ram(version: Path, step: int, part: int, parts: int) -> Manifest:
    """Checksums a RAM version's files and writes its manifest (temp, rename): from now on it is complete."""
    manifest = Manifest(step, part, parts, {name: crc_of_file(version / name) for name in (DATA, META)})
    tmp = version / f".{MANIFEST}.tmp"
    write_private(tmp, manifest.encode(), sync=False)
    os.rename(tmp, version / MANIFEST)
    return manifest


#: Writes a part's data file into an open descriptor and returns its (size, CRC-32).
DataWriter = Callable[[int], tuple[int, int]]


def copy_file_writer(source: Path, expected: Optional[tuple[int, int]] = None) -> DataWriter:
    """A `DataWriter` copying `source` in the kernel (no pass through Python), trusting `expected`."""
    def write(fd: int) -> tuple[int, int]:
        with open(source, "rb") as src:
            _sendfile(src.fileno(), fd, os.fstat(src.fileno()).st_size)
        return expected if expected is not None else crc_of_file(source)
    return write


def _sendfile(src: int, dst: int, size: int) -> None:
    done = 0
    while done < size:
        sent = os.sendfile(dst, src, done, min(size - done, 1 << 30))
        if sent == 0:
            raise CheckpointError("the RAM copy shrank while it was persisted")
        done += sent


def write_durable(durable: Path, step: int, part: int, parts: int, meta: bytes, data: DataWriter,
                  tag: str) -> Path:
    """The careful write of one part: a temporary directory, every file fsynced, the manifest last,
    then renamed into `step-N/part-R` and both directories fsynced. A reader never sees a part
    without its manifest; a crash leaves only a `.tmp-` directory nobody reads. Returns the part."""
    private_dir(durable)
    step_dir = durable / step_name(step)
    tmp = step_dir / f".tmp-part-{part}-{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for attempt in range(3):
        created = not step_dir.exists()
        step_dir.mkdir(mode=DIR_MODE, exist_ok=True)
        if created:
            fsync_dir(durable)
        try:
            tmp.mkdir(mode=DIR_MODE)
            break
        except FileNotFoundError:  # another writer's clean_stale removed the step dir while it was empty
            if attempt == 2:
                raise
    fd = os.open(tmp / DATA, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        data_sum = data(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_private(tmp / META, meta, sync=True)
    manifest = Manifest(step, part, parts, {DATA: data_sum, META: (len(meta), zlib.crc32(meta))})
    write_private(tmp / MANIFEST, manifest.encode(), sync=True)
    fsync_dir(tmp)
    final = step_dir / f"part-{part}"
    if final.exists():  # the same step saved again: the old part goes, then the new one takes its name
        old = step_dir / f".old-part-{part}-{tag}-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(step_dir)
    return final


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(durable: Path, tag: str) -> list[Path]:
    """Removes what a killed writer of this host (`tag`) left in the durable dir: its `.tmp-` part
    directories (never visible to a reader, but they hold the disk), and a step directory left empty
    by them. Returns what it removed."""
    removed = []
    for step in durable_steps(durable):
        step_dir = durable / step_name(step)
        try:
            names = os.listdir(step_dir)
        except OSError:
            continue
        for name in names:
            m = re.fullmatch(r"\.(?:tmp|old)-part-\d+-(.+)-(\d+)", name)
            if m and m.group(1) == tag and int(m.group(2)) != os.getpid() and not _alive(int(m.group(2))):
                shutil.rmtree(step_dir / name, ignore_errors=True)
                removed.append(step_dir / name)
        try:
            step_dir.rmdir()  # only when empty
            removed.append(step_dir)
        except OSError:
            pass
    return removed


def durable_parts_complete(durable: Path, step: int) -> bool:
    """Whether every part a durable step's manifests name is there with its manifest (sizes and
    checksums are checked when it is read)."""
    step_dir = durable / step_name(step)
    try:
        first = Manifest.decode((step_dir / "part-0" / MANIFEST).read_bytes())
        return all((step_dir / f"part-{p}" / MANIFEST).is_file() for p in range(first.parts))
    except (OSError, ValueError, KeyError, CheckpointError):
        return False


def remove_steps(durable: Path, steps: Iterable[int]) -> None:
    for step in steps:
        shutil.rmtree(durable / step_name(step), ignore_errors=True)
