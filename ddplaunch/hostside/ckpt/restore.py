"""Before the job starts (`checkpoint.watch`, entry.py on every rank): the newest complete checkpoint
of the job's own directory put back where the job looks for it, on every host, so that its own
resume logic (`job.resume_args`, the Trainer's `get_last_checkpoint`) finds it; from a buddy's RAM
when the host is new. Runs in the job's process, before the job's own `init_process_group()`.

The node's local rank 0 takes part, the other ranks wait on the launcher's store for it: a group
of one process per node (Gloo, on its own prefix of the store, gone again before the job's own)
gathers which steps each host holds sealed in RAM (its own job-dir versions and its buddies'
copies, jobwatch.py) and which the durable dir records, per host that wrote them. The newest step
that some copy holds wins; each writer's part of it comes from the lowest node whose RAM holds it
intact (it reads, checks and broadcasts it), else from the durable dir (every node reads and checks
it; all must succeed); a part no copy gives whole makes the step unusable: the next older is
tried. The parts are unpacked together (a file two hosts wrote alike, as the Trainer's
`save_on_each_node` does, once), then each unit is renamed into the job dir whole; what the dir
holds of a newer step (half written when its host died) is removed, so the job's resume never
picks it.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional

import torch
import torch.distributed as dist

try:
    from ddplaunch.hostside.ckpt import jobfiles, jobwatch, layout
except ImportError:  # staged flat: beside agent.py (on its path), or loaded by entry.py (ckpt_siblings)
    jobfiles = sys.modules.get("ddplaunch_hostside_jobfiles") or importlib.import_module("jobfiles")
    jobwatch = sys.modules.get("ddplaunch_hostside_jobwatch") or importlib.import_module("jobwatch")
    layout = sys.modules.get("ddplaunch_hostside_layout") or importlib.import_module("layout")

PREFIX = "ddplaunch/restore"
DIR_WORD = "{checkpoint_dir}"
TIMEOUT_S = 600.0
#: Durable steps each node lists (newest first): enough to step past a few torn ones.
DURABLE_LOOK = 8
WIRE_CHUNK = 64 << 20


@dataclass(frozen=True)
class Restored:
    """The step put back, and where its largest part came from (what the run's summary says)."""

    step: int
    path: str
    source: str  # "memory" or "durable"
    host: str  # whose RAM held it ("" from the durable dir)
    origin: str  # the host that wrote it


@dataclass(frozen=True)
class Where:
    """This node's place in the tier: its job dir (by node rank), its host's parts (by host)."""

    ram_root: Path
    run_id: str
    host: str
    node: int
    durable: Optional[Path]

    @property
    def jobdir(self) -> Path:
        return jobfiles.files_dir(self.ram_root, self.run_id, self.node)

    @property
    def host_dir(self) -> Path:
        return layout.ram_base(self.ram_root) / self.run_id / self.host

    @classmethod
    def of(cls, env: Mapping[str, str]) -> Where:
        durable = env.get("DDPLAUNCH_CHECKPOINT_DURABLE", "")
        node = env.get("DDPLAUNCH_NODE_RANK") or env.get("GROUP_RANK") or "0"
        return cls(Path(env.get("DDPLAUNCH_CHECKPOINT_RAM", "/dev/shm")),
                   layout.safe_component(env.get("DDPLAUNCH_RUN_ID", ""), "run id"),
                   layout.safe_component(env.get("DDPLAUNCH_HOST", ""), "host"), int(node),
                   Path(durable).absolute() if durable else None)

    def prepared(self) -> Path:
        """The job dir, made (0700) with every directory above it, this host's. One another host
        left (a node this machine ran before for another host: the sim's hosts share /dev/shm) is
        emptied first: a spare starts with nothing of its own, as on its own machine."""
        jobdir = self.jobdir
        for d in (layout.ram_base(self.ram_root), jobdir.parent.parent, jobdir.parent, jobdir):
            layout.private_dir(d)
        owner = jobdir / jobfiles.OWNER
        try:
            held_by = owner.read_text().strip()
        except FileNotFoundError:
            held_by = self.host
        if held_by != self.host:
            for entry in os.scandir(jobdir):
                shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
        if held_by != self.host or not owner.exists():
            layout.write_private(owner, self.host.encode(), sync=False)
        return jobdir

    def version(self, origin: str, step: int) -> Path:
        base = self.host_dir if origin == self.host else self.host_dir / layout.REPLICAS / origin
        return base / f"part-{jobfiles.FILES_PART}" / layout.version_name(step)

    def held(self) -> dict[int, list[str]]:
        """{step: origins} of the job-dir versions this host holds sealed in RAM."""
        out: dict[int, list[str]] = {}
        dirs = [(self.host, self.host_dir / f"part-{jobfiles.FILES_PART}")] + \
            layout.replica_part_dirs(self.ram_root, self.run_id, self.host, jobfiles.FILES_PART)
        for origin, pdir in dirs:
            for step in layout.sealed_steps(pdir):
                out.setdefault(step, []).append(origin)
        return out

    def recorded(self) -> dict[int, list[str]]:
        """{step: hosts} the durable dir records as persisted, its newest DURABLE_LOOK steps."""
        if self.durable is None:
            return {}
        return {s: sorted(r["host"] for r in jobwatch.durable_records(self.durable, s) if isinstance(r.get("host"), str))
                for s in jobwatch.durable_steps(self.durable)[:DURABLE_LOOK]}


def _from_durable(where: Where, step: int, writer: str) -> Optional[tuple[Any, bytes]]:
    """`writer`'s part of `step` read from the durable dir and checked against its record."""
    assert where.durable is not None
    for record in jobwatch.durable_records(where.durable, step):
        if record.get("host") != writer:
            continue
        try:
            files, chunks = [], []
            for rel, (size, crc) in sorted(record["files"].items()):
                body = (where.durable / rel).read_bytes()
                if (len(body), zlib.crc32(body)) != (size, crc):
                    return None  # overwritten since (a name the job reuses) or damaged
                files.append([rel, size, 0o600])
                chunks.append(body)
            meta = {"format": jobfiles.FORMAT, "step": step, "units": record["units"], "files": files}
            packed = jobfiles.Packed.decode(json.dumps(meta).encode())
            return packed, b"".join(chunks)
        except (OSError, ValueError, KeyError, TypeError, layout.CheckpointError):
            return None
    return None


def _sent_by(where: Where, holder: int, step: int, writer: str) -> Optional[tuple[Any, bytes | bytearray]]:
    """`writer`'s part as node `holder` reads it from its RAM (checked) and broadcasts it."""
    got = None
    if dist.get_rank() == holder:
        try:
            _, meta, data = layout.read_verified(where.version(writer, step), step, jobfiles.FILES_PART)
            got = (meta, data)
        except layout.TornCheckpoint as exc:
            print(f"ddplaunch: checkpoint: skipping a torn copy of step {step} ({exc})", file=sys.stderr)
    head: list[Any] = [None if got is None else (got[0], len(got[1]))]
    dist.broadcast_object_list(head, src=holder)
    if head[0] is None:
        return None
    meta, size = head[0]
    data = got[1] if got is not None else bytearray(size)
    flat = torch.frombuffer(data, dtype=torch.uint8) if size else None
    for at in range(0, size, WIRE_CHUNK):
        assert flat is not None
        dist.broadcast(flat[at:at + WIRE_CHUNK], holder)
    return jobfiles.Packed.decode(meta), data


def _part(where: Where, seen: list[dict[str, Any]], step: int, writer: str) -> Optional[tuple[Any, Any, Restored]]:
    """`writer`'s part of `step` on every node (a collective): RAM first, then the durable dir."""
    for holder in (k for k, s in enumerate(seen) if writer in s["ram"].get(step, [])):
        got = _sent_by(where, holder, step, writer)
        if got is not None:
            return (*got, Restored(step, "", "memory", seen[holder]["host"], writer))
    if where.durable is not None and all(writer in s["durable"].get(step, []) for s in seen):
        got = _from_durable(where, step, writer)
        oks: list[Any] = [None] * len(seen)
        dist.all_gather_object(oks, got is not None)
        if got is not None and all(oks):
            return (*got, Restored(step, "", "durable", "", writer))
    return None


def _put(where: Where, step: int, parts: list[tuple[Any, Any, Restored]]) -> Restored:
    """The parts unpacked together and renamed into the job dir; what it holds of newer steps goes."""
    jobdir = where.jobdir
    staged = jobdir.parent / f".restore-{step}-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(mode=layout.DIR_MODE)
    try:
        units: dict[str, str] = {}
        for packed, data, _ in parts:
            jobfiles.unpack(packed, data, staged)
            units.update(dict(packed.units))
        for stale in jobfiles.find_units(jobdir):
            if stale.rel not in units and (jobfiles.number_in(Path(stale.rel).name) or -1) > step:
                target = jobdir / stale.rel
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        jobfiles.put_back(jobfiles.Packed(step, tuple(units.items()), ()), staged, jobdir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    main = max(parts, key=lambda p: len(p[1]))[2]
    first = sorted(units)[0]
    return Restored(step, str(jobdir / first), main.source, main.host, main.origin)


def agree(where: Where) -> Optional[Restored]:
    """The restore among the nodes' local ranks 0 (a collective of the current group)."""
    mine = {"host": where.host, "ram": where.held(), "durable": where.recorded()}
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    steps = sorted({s for k in seen for s in (*k["ram"], *k["durable"])}, reverse=True)
    for step in steps:
        writers = sorted({w for k in seen for w in (*k["ram"].get(step, []), *k["durable"].get(step, []))})
        parts = []
        for writer in writers:
            part = _part(where, seen, step, writer)
            if part is None:
                if dist.get_rank() == 0:
                    print(f"ddplaunch: checkpoint: step {step} of the job's dir: {writer}'s part is in no "
                          "copy whole; trying an older step", file=sys.stderr)
                break
            parts.append(part)
        else:
            return _put(where, step, parts)
    return None


def restore(env: Mapping[str, str]) -> Optional[Restored]:
    """Under torchrun: the restore (see the module) on this node's local rank 0, the others wait
    for it; returns what was put back (on the node's local rank 0), else None.

    Raises:
        RuntimeError: a collective or the store failed or timed out (the message says which).
    """
    where = Where.of(env)
    where.prepared()
    local, node = int(env.get("LOCAL_RANK", "0")), int(env.get("GROUP_RANK", "0"))
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in env or nodes <= 1 and int(env.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        with _group_of_one():
            return agree(where)
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout,
                          wait_for_workers=False)
    prefix = f"{PREFIX}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    done = f"{prefix}/node-{node}"
    if local != 0:
        store.wait([done], timeout)
        return None
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/group", store), rank=node,
                                world_size=nodes, timeout=timeout)
        try:
            return agree(where)
        finally:
            dist.destroy_process_group()
    finally:
        store.set(done, "1")


def begin(env: MutableMapping[str, str], argv: list[str]) -> tuple[list[str], Optional[Restored]]:
    """The job's dir made on this host and named to the job (`{checkpoint_dir}` in its arguments,
    DDPLAUNCH_CHECKPOINT_DIR), then the restore; (the job's arguments, what was put back)."""
    jobdir = str(Where.of(env).prepared())
    env["DDPLAUNCH_CHECKPOINT_DIR"] = jobdir
    got = restore(env)
    if got is not None and env.get("RANK", "0") == "0":
        where = f"{got.host}'s memory" if got.source == "memory" else "the durable dir"
        print(f"ddplaunch: checkpoint: step {got.step} put back into the job's dir from {where} "
              f"(written by {got.origin})", file=sys.stderr, flush=True)
    return [a.replace(DIR_WORD, jobdir) for a in argv], got


class _group_of_one:
    """A one-process Gloo group on a private store (one process, or one node with one rank)."""

    def __enter__(self) -> None:
        self.store = dist.HashStore()
        dist.init_process_group("gloo", store=self.store, rank=0, world_size=1)

    def __exit__(self, *_exc: Any) -> None:
        dist.destroy_process_group()
