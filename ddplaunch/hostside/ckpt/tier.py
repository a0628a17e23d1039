"""One process's memory tier: `save` copies a state's tensors into a reused /dev/shm buffer and
returns; a sealer thread checksums each RAM version and writes its manifest (from then on it is
complete); a persister thread writes the newest sealed version to the durable directory. RAM keeps
the newest `keep` versions (an evicted version's buffer becomes the next save's, its pages already
there). Past `memory_limit`, or on a full /dev/shm, a save is written to the durable dir at once.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from ddplaunch.hostside.ckpt import layout, statecodec
from ddplaunch.hostside.ckpt.config import Config
from ddplaunch.hostside.ckpt.layout import CheckpointError, TornCheckpoint

#: OS errors that mean "RAM is full here": the save goes to the durable dir instead.
_FULL = {errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG}


class CheckpointWarning(UserWarning):
    """Said once: a copy skipped as torn, saves that bypass RAM."""


class Where(Enum):
    MEMORY = "memory"
    DURABLE = "durable"


@dataclass(frozen=True)
class Source:
    """Where a loaded checkpoint was read: a host's RAM (`host`: the one whose RAM held it) or the
    durable directory (`host` None). `origin` is the host that saved it: `host` itself, or another
    host whose part `host` holds as a buddy's replica (None: read from the durable directory)."""

    where: Where
    host: Optional[str]
    path: Path
    origin: Optional[str] = None


class Loaded(tuple[Any, int]):
    """`(state, step)`, with `.source` saying where it was read."""

    def __new__(cls, state: Any, step: int, source: Source) -> Loaded:
        made = super().__new__(cls, (state, step))
        made.source = source
        return made

    source: Source

    @property
    def state(self) -> Any:
        return self[0]

    @property
    def step(self) -> int:
        return int(self[1])


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else torchrun's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Tier:
    """The tier of one process (see the module's docstring); `close` drains and stops it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._pinned: Counter[tuple[int, int]] = Counter()
        self._seal: list[tuple[int, int, int]] = []
        self._sealing = 0
        self._persist: Optional[tuple[int, int, int, Path]] = None  # step, part, parts, RAM version
        self._saved: Optional[int] = None
        self._durable: Optional[int] = None
        self._failed: dict[int, str] = {}
        self._said: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._closing = False

    def part_dir(self, part: int) -> Path:
        c = self.config
        return layout.ram_part_dir(c.ram_root, c.run_id, c.host, part)

    def say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, CheckpointWarning, stacklevel=4)

    # -- save -------------------------------------------------------------------------------

    def save(self, state: Any, step: int, all_ranks: bool = False) -> bool:
        """Copies `state` into RAM (or, past the limit or on a full /dev/shm, the durable dir) and
        returns; False on a rank that does not save (not rank 0, and not `all_ranks`)."""
        rank, world = rank_world()
        if not all_ranks and rank != 0:
            return False
        part, parts = (rank, world) if all_ranks else (0, 1)
        packed = statecodec.pack(state)
        meta = packed.meta(step, part, parts)
        refusal = self._over_limit(part, packed.nbytes)
        if refusal is None:
            try:
                self._write_ram(part, step, packed, meta)
            except OSError as exc:
                if exc.errno not in _FULL:
                    raise
                refusal = ("full", f"checkpoint: {self.config.ram_root} is full ({exc.strerror}): saves go "
                                   f"straight to {self.config.durable} until it has room")
        with self._cond:
            self._saved = step
            self._failed.pop(step, None)
        if refusal is not None:
            self.say_once(*refusal)
            try:
                self._write_durable_now(step, part, parts, packed, meta)
            except Exception as exc:
                with self._cond:
                    self._failed[step] = f"step {step} could not be written to {self.config.durable}: {exc}"
                raise CheckpointError(self._failed[step]) from exc
            return True
        self._start()
        with self._cond:
            self._seal.append((step, part, parts))
            self._cond.notify_all()
        return True

    def _over_limit(self, part: int, nbytes: int) -> Optional[tuple[str, str]]:
        limit = self.config.memory_limit
        if limit is None:
            return None
        kept = layout.ram_steps(self.part_dir(part))[:self.config.keep - 1]
        held = sum(_size(self.part_dir(part) / layout.version_name(s) / layout.DATA) for s in kept)
        if held + nbytes <= limit:
            return None
        return ("limit", f"checkpoint: {self.config.keep} versions of {nbytes} bytes exceed memory_limit "
                         f"({limit} bytes): saves go straight to {self.config.durable}, nothing is lost")

    def _write_ram(self, part: int, step: int, packed: statecodec.Packed, meta: bytes) -> None:
        base = layout.ram_base(self.config.ram_root)
        for d in (base, base / self.config.run_id, base / self.config.run_id / self.config.host, self.part_dir(part)):
            layout.private_dir(d)
        buf = self._take_buffer(part, step)
        try:
            fd = os.open(buf / layout.DATA, os.O_RDWR | os.O_CREAT, layout.FILE_MODE)
            try:
                if os.fstat(fd).st_size != packed.nbytes:
                    os.ftruncate(fd, packed.nbytes)
                if os.fstat(fd).st_blocks * 512 < packed.nbytes:  # a reused buffer has its pages
                    os.posix_fallocate(fd, 0, packed.nbytes)  # a full /dev/shm says ENOSPC here, not midway
                statecodec.write_at(fd, packed)
            finally:
                os.close(fd)
            layout.write_private(buf / layout.META, meta, sync=False)
            final = self.part_dir(part) / layout.version_name(step)
            if final.exists():
                shutil.rmtree(final)
            os.rename(buf, final)
        except BaseException:
            shutil.rmtree(buf, ignore_errors=True)
            raise
        self._evict(part)

    def _take_buffer(self, part: int, step: int) -> Path:
        """A directory `.new-<step>` for the save: the oldest version RAM will drop (or a stale
        buffer a dead process left), its pages reused; else a new one."""
        pdir = self.part_dir(part)
        new = pdir / f".new-{step}"
        with self._cond:
            stale = [pdir / n for n in os.listdir(pdir) if n.startswith(".new-")]
            versions = layout.ram_steps(pdir)
            drop = [s for s in versions[self.config.keep - 1:] if (part, s) not in self._pinned]
            if step in versions and (part, step) not in self._pinned:
                drop = [step]
            source = stale[0] if stale else (pdir / layout.version_name(drop[-1]) if drop else None)
            if source is None:
                new.mkdir(mode=layout.DIR_MODE)
                return new
            if source != new:
                os.rename(source, new)
        for name in (layout.MANIFEST, layout.META):
            (new / name).unlink(missing_ok=True)
        return new

    def _unpin(self, part: int, step: int) -> None:
        """Under the lock: one reader of (part, step) is done; a version nobody reads can be dropped."""
        self._pinned[(part, step)] -= 1
        if self._pinned[(part, step)] <= 0:
            del self._pinned[(part, step)]

    def _evict(self, part: int) -> None:
        with self._cond:
            versions = layout.ram_steps(self.part_dir(part))
            doomed = [s for s in versions[self.config.keep:] if (part, s) not in self._pinned]
        for s in doomed:
            shutil.rmtree(self.part_dir(part) / layout.version_name(s), ignore_errors=True)

    def _write_durable_now(self, step: int, part: int, parts: int, packed: statecodec.Packed, meta: bytes) -> None:
        def write(fd: int) -> tuple[int, int]:
            crc, size = 0, 0

            def out(chunk: Any) -> None:
                nonlocal crc, size
                view = memoryview(chunk).cast("B")
                crc, size = zlib.crc32(view, crc), size + len(view)
                while view:
                    view = view[os.write(fd, view):]
            statecodec.write_to(out, packed)
            return size, crc
        layout.write_durable(self.config.durable, step, part, parts, meta, write, self.config.host)
        self._durable_done(step, part)

    # -- the background threads -------------------------------------------------------------

    def _start(self) -> None:
        with self._cond:
            if self._threads:
                return
            self._threads = [threading.Thread(target=loop, name=f"ddplaunch-ckpt-{name}", daemon=True)
                             for name, loop in (("seal", self._seal_loop), ("persist", self._persist_loop))]
        for t in self._threads:
            t.start()

    def _seal_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._seal or self._closing)
                if not self._seal:
                    return
                step, part, parts = job = self._seal.pop(0)
                self._pinned[(part, step)] += 1
                self._sealing += 1
            try:
                layout.seal_ram(self.part_dir(part) / layout.version_name(step), step, part, parts)
                failure = None
            except Exception as exc:  # recorded: wait() raises it for the newest save
                failure = f"step {step} could not be sealed in RAM: {exc}"
            with self._cond:
                self._unpin(part, step)
            self._evict(part)
            with self._cond:
                self._sealing -= 1
                if failure:
                    self._failed[step] = failure
                elif self._persist is None or self._persist[0] < step:
                    self._persist = (*job, self.part_dir(part) / layout.version_name(step))
                self._cond.notify_all()

    def _persist_loop(self) -> None:
        try:
            layout.clean_stale(self.config.durable, self.config.host)
        except OSError:
            pass  # a durable dir that is not there yet holds nothing stale
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._persist or (self._closing and not self._seal))
                if self._persist is None:
                    return
                step, part, parts, version = self._persist
                self._persist = None
                self._pinned[(part, step)] += 1
            try:
                self._persist_one(step, part, parts, version)
                failure = None
            except Exception as exc:  # recorded: wait() raises it for the newest save
                failure = f"step {step} could not be written to {self.config.durable}: {exc}"
            with self._cond:
                self._unpin(part, step)
            self._evict(part)  # before wait() returns: RAM holds `keep` versions once the newest is durable
            if failure:
                with self._cond:
                    self._failed[step] = failure
                    self._cond.notify_all()
            else:
                self._durable_done(step, part)

    def _persist_one(self, step: int, part: int, parts: int, version: Path) -> None:
        with self._cond:
            if self._durable is not None and self._durable >= step:
                return  # a newer save went straight to the durable dir
        manifest = layout.Manifest.decode((version / layout.MANIFEST).read_bytes())
        meta = (version / layout.META).read_bytes()
        if (len(meta), zlib.crc32(meta)) != manifest.files[layout.META]:
            raise TornCheckpoint(f"{version}/{layout.META} changed in RAM after it was sealed")
        writer = layout.copy_file_writer(version / layout.DATA, manifest.files[layout.DATA])
        layout.write_durable(self.config.durable, step, part, parts, meta, writer, self.config.host)

    def adopt(self, step: int, part: int, version: Path) -> None:
        """A sealed RAM version this process did not save (a killed predecessor's, a buddy's copy of
        a lost host's save) that the durable dir lacks: persisted in the background like a save."""
        try:
            parts = layout.Manifest.decode((version / layout.MANIFEST).read_bytes()).parts
        except (OSError, ValueError, KeyError, CheckpointError):
            return  # torn: the reader skipped it already
        if (self.config.durable / layout.step_name(step) / f"part-{part}" / layout.MANIFEST).is_file():
            return  # this part is durable already (whether the step's other parts are is theirs to say)
        self._start()
        with self._cond:
            if self._persist is None or self._persist[0] < step:
                self._persist = (step, part, parts, version)
                self._cond.notify_all()

    def _durable_done(self, step: int, part: int) -> None:
        """Step `step` is durable: older durable steps beyond `durable_keep` go, then wait() returns."""
        keep = self.config.durable_keep
        if keep is not None and part == 0:
            complete = [s for s in layout.durable_steps(self.config.durable)
                        if layout.durable_parts_complete(self.config.durable, s)]
            if len(complete) >= keep:
                layout.remove_steps(self.config.durable, [s for s in layout.durable_steps(self.config.durable)
                                                          if s < complete[keep - 1]])
        with self._cond:
            self._durable = step if self._durable is None else max(self._durable, step)
            self._cond.notify_all()

    def sealed(self) -> None:
        """Returns once this process's saves are sealed in RAM (checksummed: loadable)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._seal and not self._sealing)

    # -- wait and close ---------------------------------------------------------------------

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Blocks until the newest save is durable; returns its step (None: nothing saved).

        Raises:
            CheckpointError: persisting the newest save failed.
            TimeoutError: it was not durable within `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._saved
            if target is None:
                return None

            def settled() -> bool:
                return (self._durable is not None and self._durable >= target) or target in self._failed
            while not settled():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"checkpoint step {target} was not durable in {self.config.durable} "
                                       f"within {timeout} s")
                self._cond.wait(left)
            if self._durable is None or self._durable < target:
                raise CheckpointError(self._failed[target])
        return target

    @property
    def saved_step(self) -> Optional[int]:
        """The step of this process's newest save (None: it saved nothing)."""
        with self._cond:
            return self._saved

    def close(self) -> Optional[str]:
        """Finishes persisting the newest save, then stops the threads; returns why the newest save
        could not be made durable (said as a warning too), None when it is (or nothing was saved)."""
        failed = None
        try:
            self.wait()
        except CheckpointError as exc:
            failed = str(exc)
            warnings.warn(failed, CheckpointWarning, stacklevel=2)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        return failed


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
