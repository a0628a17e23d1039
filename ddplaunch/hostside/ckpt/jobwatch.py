"""The node's watch over its job's own checkpoint directory (`checkpoint.watch`: unmodified
scripts). Standard library only: the node agent runs it in a thread (a look each LOOK_S), and the
job's local rank 0 once more after the script returned (entry.py: nothing the job wrote last is
left to a process that may be gone).

Each look finds the dir's checkpoints (jobfiles.py). A unit counts once it is complete (its
marker, a whole zip) and unchanged since the look before (the job is done writing it); the newest
step's units are packed into this host's RAM tier as a sealed version of part FILES_PART (the
buddy copies, replicas.py, send it like an API save; RAM keeps `keep` versions) and persisted to
the durable dir as the job's own files, each written carefully (temp, fsync, rename, directory
fsync; the job's marker last), so the durable dir is the checkpoint dir the job would have written
without ddplaunch. A record of what each host persisted of a step, with each file's size and
CRC-32, is written last:

    <durable>/<the job's paths>                          the files, as the job named them
    <durable>/.ddplaunch/files/step-<N>/<host>.json       what <host> persisted of step N
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

try:
    from ddplaunch.hostside.ckpt import jobfiles, layout
except ImportError:  # staged flat: beside agent.py (on its path), or loaded by entry.py (ckpt_siblings)
    jobfiles = sys.modules.get("ddplaunch_hostside_jobfiles") or importlib.import_module("jobfiles")
    layout = sys.modules.get("ddplaunch_hostside_layout") or importlib.import_module("layout")

WATCH_ENV = "DDPLAUNCH_CHECKPOINT_WATCH"
LOOK_S = 1.0
RECORDS = Path(".ddplaunch") / "files"
MARKERS = (jobfiles.HF_MARKER, jobfiles.DCP_MARKER)


def record_dir(durable: Path, step: int) -> Path:
    return durable / RECORDS / layout.step_name(step)


class Watch:
    """One host's watch (see the module): `look()` seals and persists what is new."""

    def __init__(self, jobdir: Path, host_dir: Path, durable: Optional[Path], host: str, keep: int,
                 say: Callable[[str], None]) -> None:
        self.jobdir, self.host_dir, self.durable, self.host, self.keep, self.say = \
            jobdir, host_dir, durable, host, keep, say
        self.part_dir = host_dir / f"part-{jobfiles.FILES_PART}"
        self.seen: dict[str, tuple[tuple[str, int, int], ...]] = {}
        self.steps: dict[tuple[str, tuple[tuple[str, int, int], ...]], Optional[int]] = {}
        self.newest: Optional[int] = None
        self.newest_content: frozenset[Any] = frozenset()
        self.durable_step: Optional[int] = None
        self.said: set[str] = set()

    def say_once(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.say(text)

    def _step(self, unit: Any) -> Optional[int]:
        key = (unit.rel, unit.files)
        if key not in self.steps:
            try:
                self.steps[key] = jobfiles.step_of(self.jobdir, unit)
            except jobfiles.Incomplete:
                return None  # looked at again once it changes
            except jobfiles.Unreadable as exc:
                self.steps[key] = None
                self.say_once(f"step:{unit.rel}", f"checkpoint: {exc}: not copied nor persisted")
        return self.steps[key]

    def look(self, final: bool = False) -> Optional[int]:
        """One look; with `final` (the job has ended) a complete unit need not be seen twice.
        Returns the step it sealed, None when nothing was new."""
        units = jobfiles.find_units(self.jobdir)
        ready = [u for u in units if final or self.seen.get(u.rel) == u.files]
        self.seen = {u.rel: u.files for u in units}
        if len(self.steps) > 4 * len(units) + 64:  # what is gone from the dir is forgotten
            self.steps = {k: v for k, v in self.steps.items() if self.seen.get(k[0]) == k[1]}
        by_step: dict[int, list[Any]] = {}
        for unit in ready:
            step = self._step(unit)
            if step is not None:
                by_step.setdefault(step, []).append(unit)
        if not by_step:
            return None
        step = max(by_step)
        content = frozenset((u.rel, u.files) for u in by_step[step])
        if self.newest is not None and (step < self.newest or (step == self.newest and content <= self.newest_content)):
            return None
        if self._durable_already(step, by_step[step]):  # (a watch that starts late: entry.py's at the end)
            self.newest, self.newest_content, self.durable_step = step, content, step
            return None
        version = self._seal(step, by_step[step])
        if version is None:
            return None
        self.newest, self.newest_content = step, content
        if self.durable is not None:
            try:
                persist(version, step, self.durable, self.host)
                self.durable_step = step
            except (OSError, layout.CheckpointError) as exc:
                self.say_once(f"durable:{step}", f"checkpoint: step {step} of the job's dir not persisted to "
                                                 f"{self.durable}: {exc}")
        return step

    def _durable_already(self, step: int, units: list[Any]) -> bool:
        """Whether this host's record of `step` in the durable dir lists exactly these files."""
        if self.durable is None or not (self.part_dir / layout.version_name(step) / layout.MANIFEST).is_file():
            return False
        files = {rel: size for u in units for rel, size, _ in u.files}
        return any(r.get("host") == self.host and {k: v[0] for k, v in r.get("files", {}).items()} == files
                   for r in durable_records(self.durable, step))

    def _seal(self, step: int, units: list[Any]) -> Optional[Path]:
        """The version of `step` sealed in RAM (None: a file changed while it was copied: next look)."""
        for d in (self.host_dir.parent.parent, self.host_dir.parent, self.host_dir, self.part_dir):
            layout.private_dir(d)
        tmp = self.part_dir / f".new-{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=layout.DIR_MODE)
        try:
            jobfiles.pack(self.jobdir, units, step, tmp)
            if not jobfiles.unchanged(self.jobdir, units):
                shutil.rmtree(tmp, ignore_errors=True)
                return None
            final = self.part_dir / layout.version_name(step)
            if final.exists():  # the same step again (a unit more): the old one goes first
                old = self.part_dir / f".old-{step}-{os.getpid()}"
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
            layout.seal_ram(final, step, jobfiles.FILES_PART, 1)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            self.say_once(f"seal:{step}", f"checkpoint: step {step} of the job's dir not kept in RAM: {exc}")
            return None
        for old_step in layout.ram_steps(self.part_dir)[self.keep:]:
            shutil.rmtree(self.part_dir / layout.version_name(old_step), ignore_errors=True)
        return final


def _careful(target: Path, body: memoryview, host: str) -> None:
    """`body` as `target`: a temporary beside it (named by the host: hosts persist the same file of
    a step side by side), fsynced, renamed, the directory fsynced."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=layout.DIR_MODE)
    layout.replace_synced(target, body, host)
    layout.fsync_dir(target.parent)


def persist(version: Path, step: int, durable: Path, host: str) -> None:
    """A sealed RAM version's files into the durable dir as the job named them (the markers last),
    then this host's record of them. Raises layout.TornCheckpoint: the RAM copy does not match
    its manifest."""
    _, meta, data = layout.read_verified(version, step, jobfiles.FILES_PART)
    packed = jobfiles.Packed.decode(meta)
    view, at, spans = memoryview(data), 0, []
    for rel, size, _ in packed.files:
        spans.append((rel, at, size))
        at += size
    sums = {}
    for rel, at, size in sorted(spans, key=lambda s: Path(s[0]).name in MARKERS):
        body = view[at:at + size]
        _careful(durable / rel, body, host)
        sums[rel] = [size, zlib.crc32(body)]
    record = {"format": jobfiles.FORMAT, "step": step, "host": host, "units": [list(u) for u in packed.units],
              "files": sums}
    _careful(record_dir(durable, step) / f"{host}.json", memoryview(json.dumps(record, sort_keys=True).encode()), host)


def durable_steps(durable: Path) -> list[int]:
    """The steps some host recorded as persisted in the durable dir, newest first."""
    return layout.durable_steps(durable / RECORDS)


def durable_records(durable: Path, step: int) -> list[dict[str, Any]]:
    """What each host persisted of `step` (its record), by host; unreadable records are left out."""
    out = []
    try:
        names = sorted(os.listdir(record_dir(durable, step)))
    except OSError:
        return []
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            try:
                doc = json.loads((record_dir(durable, step) / name).read_text())
                if doc.get("format") == jobfiles.FORMAT and doc.get("step") == step:
                    out.append(doc)
            except (OSError, ValueError, AttributeError):
                continue
    return out


def from_env(env: Mapping[str, str], say: Callable[[str], None]) -> Optional[Watch]:
    """The watch the node's environment plans (None: `checkpoint.watch` is not on)."""
    if env.get(WATCH_ENV) != "1":
        return None
    run_id, host = env.get("DDPLAUNCH_RUN_ID", ""), env.get("DDPLAUNCH_HOST", "")
    if not (run_id and host):
        return None
    ram = Path(env.get("DDPLAUNCH_CHECKPOINT_RAM", "/dev/shm"))
    run_id, host = layout.safe_component(run_id, "run id"), layout.safe_component(host, "host")
    node = int(env.get("DDPLAUNCH_NODE_RANK") or env.get("GROUP_RANK") or "0")
    durable = env.get("DDPLAUNCH_CHECKPOINT_DURABLE", "")
    keep = int(env.get("DDPLAUNCH_CHECKPOINT_KEEP", "2") or 2)
    return Watch(jobfiles.files_dir(ram, run_id, node), layout.ram_base(ram) / run_id / host,
                 Path(durable).absolute() if durable else None, host, max(1, keep), say)


def start(env: Mapping[str, str], say: Callable[[str], None]) -> Optional[threading.Event]:
    """The watch in a thread, a look each LOOK_S until the returned event is set."""
    watch = from_env(env, say)
    if watch is None:
        return None
    stopping = threading.Event()

    def loop() -> None:
        while not stopping.wait(LOOK_S):
            try:
                watch.look()
            except Exception as exc:  # a look that fails is said once; the next one tries again
                watch.say_once(f"look:{type(exc).__name__}", f"checkpoint: watching {watch.jobdir} failed: {exc}")

    threading.Thread(target=loop, daemon=True, name="ddplaunch-jobdir-watch").start()
    return stopping


def finish(env: Mapping[str, str], say: Callable[[str], None]) -> Optional[tuple[int, str]]:
    """The job has ended: one last look (a complete unit counts at once) and the newest step this
    host wrote made durable. (its step, why it is not durable or "") or None: it wrote none."""
    watch = from_env(env, say)
    if watch is None:
        return None
    watch.look(final=True)
    if watch.newest is None:
        return None
    failed = "" if watch.durable is None or watch.durable_step == watch.newest else \
        f"step {watch.newest} of the job's dir was not persisted to {watch.durable}"
    return watch.newest, failed
