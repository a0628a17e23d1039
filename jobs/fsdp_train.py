"""A small transformer trained with FSDP2 (or DDP): sharded DCP checkpoints, resume at any world size.

A plain torchrun script (needs only torch; relies on RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT, and optionally DDPLAUNCH_DIST_TIMEOUT). Every transformer block and the
root module are wrapped with ``torch.distributed.fsdp.fully_shard``; ``--strategy ddp`` trains
the same model on the same data with DistributedDataParallel, for the cross-check.

- Data: a fixed synthetic next-token task. Step ``s`` always uses the same global batch; rank
  ``r`` of ``W`` takes rows ``[r*B/W, (r+1)*B/W)`` of it, so the training is the same at any
  world size that divides ``--global-batch``.
- Checkpoints: torch.distributed.checkpoint (one file per rank) of the model and optimizer
  state, every ``--ckpt-every`` steps, at the end, and on SIGUSR2 (then exit 75). Written into
  ``step_N.tmp/``, renamed to ``step_N/`` once every rank has finished, then ``latest`` is
  replaced atomically. A restarted run resumes from the newest complete ``step_N/`` at any
  world size (DCP reshards on load); ``*.tmp`` directories are ignored.
- Loading runs no code from the checkpoint. DCP itself (torch 2.x) unpickles ``.metadata`` with
  plain ``pickle.load`` and non-tensor values (Adam's param_groups) with
  ``torch.load(weights_only=False)``: here the metadata goes through an unpickler that knows only
  DCP's own metadata classes, and those values through weights_only loading. A checkpoint that
  needs more, or a checkpoint directory another user can write, is refused with one line, exit 2.
- ``--ckpt-tier``: the same state through ddplaunch's checkpoint memory tier instead
  (``ddplaunch.checkpoint.dcp_save``/``dcp_load``): each rank's shards land in its host's RAM and
  are persisted to ``<ckpt-dir>/dcp/step-N/`` (a plain DCP directory) in the background.
- End: every rank gathers the full (unsharded) parameters and hashes them; the ranks compare
  (``rank=R full_params_sha256=...``, then ``replicas agree`` or exit 1).
"""

import argparse
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import stat
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, SEQ_LEN = 32, 16
DATA_SEED = 1234  # the task never changes; --seed varies the initial weights and the data order
STEP_DIR_RE = re.compile(r"^step_(\d+)$")
#: Exit status after a preemption warning: checkpoint written, run again to resume (EX_TEMPFAIL).
PREEMPTED_EXIT = 75
#: Exit status when the newest checkpoint is refused (unsafe to load, or not this job's).
REFUSED_EXIT = 2
_preempt = {"signalled": False}


def say(line: str) -> None:
    """Writes one whole flushed line; local ranks share a stdout pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def burn_cpu(ms: float) -> None:
    """Spend `ms` milliseconds of this thread's CPU time (wall time stretches on a slow CPU)."""
    start = time.thread_time()
    while (time.thread_time() - start) * 1e3 < ms:
        pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps")
    p.add_argument("--global-batch", type=int, default=32,
                   help="sequences per step over all ranks; must be divisible by the world size")
    p.add_argument("--samples", type=int, default=2048, help="synthetic data set size")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-name", default=os.environ.get("DDPLAUNCH_RUN_NAME", "default"))
    p.add_argument("--ckpt-dir", default=None,
                   help="default: $DDPLAUNCH_CHECKPOINT_DIR (the spec's checkpoint.path), $DDPLAUNCH_CKPT_DIR, "
                        "else checkpoints/<run name>-fsdp; "
                        "must be storage every rank can read (DCP writes one file per rank)")
    p.add_argument("--ckpt-every", type=int, default=10, help="steps; 0 = only at the end")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    p.add_argument("--ckpt-tier", action="store_true",
                   help="checkpoint through ddplaunch's memory tier (ddplaunch.checkpoint.dcp_save/dcp_load): "
                        "a save lands in host RAM and is persisted to <ckpt-dir>/dcp/ in the background; a "
                        "resume at the same world size reads RAM, at another the durable copy (resharded)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    # Test hooks.
    p.add_argument("--fail-at-step", type=int, default=None, help="with --fail-rank: exit 3 there")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--burn-ms", type=float, default=0.0,
                   help="CPU milliseconds to spend per step (a step slows down where the CPU does)")
    p.add_argument("--corrupt-rank", type=int, default=None,
                   help="perturb this rank's gathered copy before hashing (tests the check)")
    p.add_argument("--dump-final", default=None, help="rank 0 torch.saves the full parameters here")
    args = p.parse_args(argv)
    args.ckpt_dir = args.ckpt_dir or os.environ.get("DDPLAUNCH_CHECKPOINT_DIR") or \
        os.environ.get("DDPLAUNCH_CKPT_DIR") or \
        os.path.join("checkpoints", f"{args.run_name}-fsdp")
    return args


# --------------------------------------------------------------------------- data and model

def make_data(samples: int) -> torch.Tensor:
    """``samples`` sequences of SEQ_LEN+1 tokens: x[t+1] = (x[t] + x[t-1]) mod VOCAB.

    Each sequence starts from two random tokens; from the third token on, the next token is
    determined by the two before it, which the model learns to read with attention.
    """
    gen = torch.Generator().manual_seed(DATA_SEED)
    seqs = torch.empty(samples, SEQ_LEN + 1, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, VOCAB, (samples, 2), generator=gen)
    for t in range(2, SEQ_LEN + 1):
        seqs[:, t] = (seqs[:, t - 1] + seqs[:, t - 2]) % VOCAB
    return seqs


def global_batch_indices(step: int, samples: int, global_batch: int, seed: int) -> torch.Tensor:
    """The data set rows of step ``step``'s global batch: a function of the step alone.

    Epoch ``e`` visits the rows in a permutation seeded by (seed, e); a resumed run at any
    world size therefore sees exactly the batches an uninterrupted run would.
    """
    per_epoch = samples // global_batch
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[i * global_batch:(i + 1) * global_batch]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ_LEN, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        # Logits as (batch*seq, vocab), a fresh tensor: FSDP2 warns when a wrapped module
        # returns a view (an in-place op on it would skip its pre-backward hook).
        return self.head(self.ln_f(x).reshape(-1, x.shape[-1]))


def settle_ddp_buckets(ddp: DDP, device: torch.device) -> None:
    """Runs one throwaway forward and backward (gradients discarded, no optimizer step).

    DDP regroups its gradient buckets by the order gradients became ready in the first backward
    of every start, which moves gradients within the all-reduced buffers and so (beyond 2 ranks)
    changes the order the ranks' values are summed in: a resumed run's first step would differ
    from the uninterrupted run's in the last bits. After this pass every real step of every start
    uses the regrouped buckets. (train.py gets the same with find_unused_parameters=True, which
    prints a warning on every rank when no parameter is unused.)
    """
    ddp(torch.zeros(1, SEQ_LEN, dtype=torch.long, device=device)).sum().backward()
    for param in ddp.parameters():
        param.grad = None


def build(strategy: str, dim: int, layers: int, heads: int, seed: int, device: torch.device,
          lr: float = 1e-2):
    """The model (same initial weights on every rank and for either strategy) and its optimizer.

    FSDP2: each block is its own FSDP unit (its parameters are all-gathered just before its
    forward and backward and resharded after; its gradients are reduce-scattered), and the root
    covers the rest (embeddings, final norm, head).
    """
    torch.manual_seed(seed)
    model = TinyLM(dim, layers, heads).to(device)
    world = dist.get_world_size()
    if strategy == "fsdp":
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        settle_ddp_buckets(wrapped, device)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=lr)
    return model, wrapped, optimizer


# --------------------------------------------------------------------------- checkpoints

def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def complete_checkpoints(ckpt_dir: str) -> list:
    """(step, path) of every complete checkpoint, oldest first.

    Only a finished save is ever renamed to ``step_N`` (and only after DCP wrote its
    ``.metadata`` and rank 0 its ``meta.json``); ``step_N.tmp`` and anything else is ignored.
    """
    found = []
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    for name in names:
        m = STEP_DIR_RE.match(name)
        path = os.path.join(ckpt_dir, name)
        if m and os.path.isfile(os.path.join(path, ".metadata")) and \
                os.path.isfile(os.path.join(path, "meta.json")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def save_checkpoint(args, model, optimizer, step: int, meta: dict) -> float:
    """Every rank writes its shard into step_N.tmp/; rank 0 publishes it. Returns seconds."""
    rank = dist.get_rank()
    final = os.path.join(args.ckpt_dir, f"step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        # 0700 directories (DCP's own mkdir keeps an existing one's mode): resuming refuses a
        # checkpoint that others can write, and DCP's files inside get the umask's modes.
        os.makedirs(args.ckpt_dir, mode=0o700, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a save that died midway
        os.mkdir(tmp, 0o700)
    dist.barrier()
    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # fsyncs every file
    # dcp.save returns on a rank once it wrote its own file and the coordinator the metadata;
    # the barrier makes sure every rank's file is complete before the directory is published.
    dist.barrier()
    if rank == 0:
        write_atomically(os.path.join(tmp, "meta.json"),
                         json.dumps(dict(meta, step=step, world_size=dist.get_world_size()),
                                    indent=1).encode())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_atomically(os.path.join(args.ckpt_dir, "latest"), f"step_{step}\n".encode())
        fsync_dir(args.ckpt_dir)
        done = complete_checkpoints(args.ckpt_dir)
        for _, old in done[:-args.keep] if args.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # nobody runs ahead of a checkpoint that may be needed to resume
    return time.perf_counter() - start


class CheckpointRefused(Exception):
    """A checkpoint (or its directory) this job will not resume from; the message is one line."""


CHECKPOINT_ADVICE = ("if this job did not write it, move it out of the checkpoint directory and "
                     "find out who could; it is never loaded unsafely")

#: Every global a DCP ``.metadata`` pickle may name (torch 2.x FileSystemWriter): DCP's metadata
#: classes, torch.Size, dtypes (see _MetadataUnpickler), layouts and the save's path. Building
#: these runs no code of consequence; anything else (os.system, builtins.eval...) is refused
#: before it is even looked up. A torch that pickles metadata differently fails closed.
DCP_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler resolving only DCP_METADATA_GLOBALS and torch dtypes (torch.float32...)."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it needs the global {module}.{name}, "
                                     "which DCP metadata never holds")


def read_dcp_metadata(step_dir: str):
    """The DCP Metadata of ``step_dir``, unpickled without running code, and checked.

    Each file it names must be a plain name inside ``step_dir`` (DCP would open a ``../`` path
    as given), without load-time transforms (this job writes none).
    """
    path = os.path.join(step_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as exc:  # noqa: BLE001 -- whatever these untrusted bytes do wrong: refused
        reason = str(exc) if isinstance(exc, pickle.UnpicklingError) else \
            f"{type(exc).__name__}: {exc}"
        raise CheckpointRefused(f"refusing {path}: {(reason.splitlines() or ['?'])[0][:200]}; "
                                f"nothing from it was loaded: {CHECKPOINT_ADVICE}") from None
    if not isinstance(metadata, dcp.Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointRefused(f"refusing {path}: not DCP metadata; {CHECKPOINT_ADVICE}")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
                or getattr(info, "transform_descriptors", None):
            raise CheckpointRefused(f"refusing {path}: it points at {name!r}, not a plain file of "
                                    f"{step_dir}; {CHECKPOINT_ADVICE}")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, but ``.metadata`` comes from `read_dcp_metadata`, not pickle.load.

    (No ``rank`` keyword on read_metadata: DCP then never looks for per-rank metadata files.)
    """

    def read_metadata(self):
        metadata = read_dcp_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with weights_only=True.

    DCP saves them (here Adam's param_groups: floats, tuples, bools, names) with torch.save and
    its planner loads them with weights_only=False. The parent still places the value: it gets
    a re-serialized copy of what weights_only loading returned, plain data by then.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, map_location="cpu", weights_only=True)
        copy = io.BytesIO()
        torch.save(obj, copy)
        copy.seek(0)
        super().load_bytes(read_item, copy)


def refuse_if_others_can_write(path: str, files: bool = False) -> None:
    """CheckpointRefused unless only this user (or root) can have written ``path`` (see train.py).

    ``files``: ``path`` is a step directory; if others can enter it, each file in it must not be
    writable by them either (DCP creates its files with the umask's modes).
    """
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise CheckpointRefused(f"refusing {path}: it belongs to uid {st.st_uid}, not to this job's "
                                f"user (uid {me}) or root; resume only from a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointRefused(f"refusing {path}: others can write it (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}), so anyone among them could plant "
                                f"a checkpoint; check its contents, then `chmod -R go-w {path}`, or "
                                f"use a --ckpt-dir only you can write")
    if files and st.st_mode & (stat.S_IXGRP | stat.S_IXOTH):
        for name in os.listdir(path):
            refuse_if_others_can_write(os.path.join(path, name))


def pick_checkpoint(ckpt_dir: str):
    """Rank 0: (path, meta) of the newest complete checkpoint, checked; None if there is none.

    An older checkpoint is never tried instead of a refused one: quietly going back in time
    would hide a planted file.
    """
    if not os.path.exists(ckpt_dir):
        return None
    refuse_if_others_can_write(ckpt_dir)
    done = complete_checkpoints(ckpt_dir)
    if not done:
        return None
    path = done[-1][1]
    refuse_if_others_can_write(path, files=True)
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(f"refusing {path}: meta.json does not load ({exc}); "
                                f"{CHECKPOINT_ADVICE}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or \
            not isinstance(meta.get("world_size"), int):
        raise CheckpointRefused(f"refusing {path}: meta.json lacks an integer step or world_size; "
                                f"{CHECKPOINT_ADVICE}")
    read_dcp_metadata(path)  # refused here, with one line, before any rank reads it
    return path, meta


def load_latest(args, model, optimizer):
    """Loads the newest complete checkpoint, whatever world size wrote it; returns its meta.

    Rank 0 picks and checks the directory (every rank must agree on it); each rank then reads
    just the pieces of every saved shard that overlap its own shard. Raises CheckpointRefused
    on every rank if the checkpoint is not safe to load.
    """
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = pick_checkpoint(args.ckpt_dir)
        except CheckpointRefused as exc:
            box[0] = str(exc)  # every rank must learn of the refusal, or the others would hang
    dist.broadcast_object_list(box, src=0)  # JSON values or a str: nothing loaded by pickle
    if isinstance(box[0], str):
        raise CheckpointRefused(box[0])
    if box[0] is None:
        return None, 0.0
    path, meta = box[0]
    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=WeightsOnlyLoadPlanner())
    except dcp.CheckpointException as exc:  # raised on every rank when any rank failed
        unsafe = [e for e, _ in exc.failures.values()
                  if isinstance(e, (pickle.UnpicklingError, CheckpointRefused))]
        if not unsafe:
            raise
        lines = str(unsafe[0]).strip().splitlines() or ["?"]
        reason = next((line for line in lines if "GLOBAL" in line), lines[0]).strip()
        raise CheckpointRefused(f"refusing {path}: a value in it does not load with "
                                f"weights_only=True ({reason[:200]}); {CHECKPOINT_ADVICE}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dist.barrier()
    return dict(meta, path=path), time.perf_counter() - start


def tier_meta(meta: dict, step: int) -> dict:
    """What a tier checkpoint says of itself beside the state (DCP saves each value with torch.save)."""
    return dict(meta, step=step, world_size=dist.get_world_size())


def save_to_tier(model, optimizer, step: int, meta: dict) -> float:
    """Every rank's shards into its host's RAM (ddplaunch.checkpoint); returns the seconds it stalled."""
    from ddplaunch import checkpoint

    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint.dcp_save({"model": model_sd, "optim": optim_sd, "meta": tier_meta(meta, step)}, step)
    return time.perf_counter() - start


def load_from_tier(model, optimizer, meta: dict):
    """The newest complete tier checkpoint (every rank's RAM, else the durable copy, resharded);
    returns its meta with ``path`` and ``source`` (memory or durable) and the seconds it took."""
    from ddplaunch import checkpoint

    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "meta": tier_meta(dict(meta, start_loss=0.0), 0)}
    got = checkpoint.dcp_load(state, planner=WeightsOnlyLoadPlanner(), reader=SafeFileSystemReader)
    if got is None:
        return None, 0.0
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dist.barrier()
    return dict(state["meta"], path=str(got.source.path), source=got.source.where.value), \
        time.perf_counter() - start


# --------------------------------------------------------------------------- checks

def full_params(model) -> dict:
    """Every parameter unsharded, on every rank (all-gathers FSDP's shards; DDP: a copy)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def params_sha256(full: dict) -> str:
    """Hashes names and bytes of the full parameters, in sorted name order, on CPU."""
    import hashlib
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(name.encode())
        digest.update(full[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def check_replicas(full: dict, rank: int, world: int) -> bool:
    """Every rank prints its hash; rank 0 compares them all. Same verdict on every rank."""
    mine = params_sha256(full)
    say(f"rank={rank} full_params_sha256={mine}")
    hashes = [None] * world
    dist.all_gather_object(hashes, mine)
    if len(set(hashes)) == 1:
        if rank == 0:
            say(f"replicas agree: {hashes[0][:16]} on {world} ranks")
        return True
    if rank == 0:
        groups = {}
        for r, h in enumerate(hashes):
            groups.setdefault(h, []).append(r)
        detail = "; ".join(f"ranks {ranks} have {h[:16]}" for h, ranks in
                           sorted(groups.items(), key=lambda item: -len(item[1])))
        say(f"replicas DIFFER: {len(groups)} distinct hashes: {detail}")
    return False


def preemption_agreed(device: torch.device) -> bool:
    """True on every rank once any rank got SIGUSR2 (a tiny all_reduce per step: every rank
    stops at the same step)."""
    flag = torch.tensor([1.0 if _preempt["signalled"] else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def init_distributed(backend: str, timeout: timedelta, device: torch.device) -> None:
    """init_process_group from the torchrun env, safe across torchrun restarts (see train.py:
    a restarted worker must not read its dead predecessor's keys in the agent's store); on CUDA
    bound to the rank's device."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    bound = {"device_id": device} if device.type == "cuda" else {}
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, **bound)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"ddplaunch/restart{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout, **bound)


def finish_tier(args) -> None:
    """With --ckpt-tier: the newest save made durable before the process ends (os._exit skips
    the tier's own exit handler)."""
    if args.ckpt_tier:
        from ddplaunch import checkpoint
        checkpoint.dcp_close()


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    # Slurm's warning ahead of the time limit (`--signal`, forwarded by torchrun's
    # --signals-to-handle): checkpoint at the next step every rank agrees on, then exit 75.
    signal.signal(signal.SIGUSR2, lambda signum, frame: _preempt.update(signalled=True))
    args = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=float(os.environ.get("DDPLAUNCH_DIST_TIMEOUT", "300")))
    init_distributed(backend, timeout, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.global_batch % world:
        if rank == 0:
            say(f"fsdp_train: --global-batch {args.global_batch} is not divisible by the "
                f"world size {world}; choose a multiple of {world}")
        dist.destroy_process_group()
        return 2
    local_batch = args.global_batch // world
    if rank == 0:
        say(f"fsdp_train: strategy={args.strategy} world_size={world} backend={backend} "
            f"host={socket.gethostname()} restart={restart} global_batch={args.global_batch} "
            f"local_batch={local_batch} ckpt_dir={args.ckpt_dir}")

    data = make_data(args.samples)
    model, wrapped, optimizer = build(args.strategy, args.dim, args.layers, args.heads, args.seed,
                                      device, args.lr)
    meta_base = {"strategy": args.strategy, "seed": args.seed, "global_batch": args.global_batch,
                 "dim": args.dim, "layers": args.layers, "heads": args.heads}
    step, start_loss = 0, None
    if args.ckpt_tier:
        from ddplaunch import checkpoint
        checkpoint.configure(durable=os.environ.get("DDPLAUNCH_CHECKPOINT_DURABLE") or args.ckpt_dir,
                             durable_keep=args.keep if args.keep > 0 else None)
    try:
        resumed, load_s = load_from_tier(model, optimizer, meta_base) if args.ckpt_tier else \
            load_latest(args, model, optimizer)
    except CheckpointRefused as exc:
        if rank == 0:
            sys.stderr.write(f"fsdp_train: {exc}\n")
            sys.stderr.flush()
        del wrapped, model, optimizer
        dist.destroy_process_group()
        return REFUSED_EXIT
    if resumed:
        step, start_loss = resumed["step"], resumed.get("start_loss")
        if rank == 0:
            say(f"resumed from {resumed['path']} at step {step} (written by "
                f"{resumed['world_size']} ranks with {resumed.get('strategy')}, now {world} "
                f"with {args.strategy}) load_s={load_s:.4f}")
            if args.ckpt_tier:
                say(f"resumed_source={resumed['source']}")
        loaded = params_sha256(full_params(model))
        if rank == 0:
            say(f"resumed_full_params_sha256={loaded}")
    elif rank == 0:
        say(f"no complete checkpoint in {args.ckpt_dir}: starting at step 0")

    save_times, last_saved = [], step if resumed else None

    def checkpoint() -> None:
        nonlocal last_saved
        if last_saved == step:
            return
        meta = dict(meta_base, start_loss=start_loss)
        save_times.append(save_to_tier(model, optimizer, step, meta) if args.ckpt_tier else
                          save_checkpoint(args, model, optimizer, step, meta))
        last_saved = step

    loss_sum, mean = torch.zeros((), device=device), float("nan")
    while step < args.steps:
        if step == args.fail_at_step and rank == args.fail_rank and restart == 0:
            say(f"rank={rank} failing on purpose at step {step} (--fail-at-step)")
            os._exit(3)
        rows = global_batch_indices(step, args.samples, args.global_batch, args.seed)
        batch = data[rows[rank * local_batch:(rank + 1) * local_batch]].to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        burn_cpu(args.burn_ms)
        optimizer.zero_grad(set_to_none=True)
        logits = wrapped(inputs)
        loss = F.cross_entropy(logits, targets.reshape(-1))
        loss.backward()  # FSDP reduce-scatters (DDP all-reduces) the averaged gradients here
        optimizer.step()
        step += 1
        if start_loss is None or step % args.log_every == 0 or step == args.steps:
            loss_sum.copy_(loss.detach())
            dist.all_reduce(loss_sum)  # the global batch's mean loss (equal slices per rank)
            mean = loss_sum.item() / world
            if start_loss is None:
                start_loss = mean
            if rank == 0 and (step % args.log_every == 0 or step == args.steps or step == 1):
                say(f"step={step} loss={mean:.6f}")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.ckpt_every and step % args.ckpt_every == 0:
            checkpoint()
        if preemption_agreed(device):
            checkpoint()
            if rank == 0:
                say(f"preempted (SIGUSR2): checkpoint at step {step}; exiting {PREEMPTED_EXIT} "
                    "to be requeued")
            finish_tier(args)
            del wrapped, model, optimizer
            dist.destroy_process_group()
            return PREEMPTED_EXIT
    checkpoint()
    if rank == 0:
        if math.isnan(mean):
            say(f"nothing to train: the checkpoint is at step {step} of --steps {args.steps}")
        else:
            say(f"final loss={mean:.6f} (start {start_loss:.6f}) steps={step}")
        if save_times:
            say(f"checkpoint times: saves={len(save_times)} save_s median="
                f"{statistics.median(save_times):.4f} max={max(save_times):.4f}"
                + (f" load_s={load_s:.4f}" if resumed else ""))

    full = full_params(model)
    if args.corrupt_rank == rank:
        first = sorted(full)[0]
        full[first] = full[first] + 1e-3  # test hook: only this rank's copy differs
    if args.dump_final and rank == 0:
        torch.save({k: v.detach().cpu() for k, v in full.items()}, args.dump_final)
    agree = check_replicas(full, rank, world)
    finish_tier(args)
    del wrapped, model, optimizer, full
    dist.barrier()
    dist.destroy_process_group()
    return 0 if agree else 1


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is saved and the group is destroyed: skip interpreter teardown, where Gloo's
    # C++ threads are sometimes destroyed in an order that aborts the process (see train.py).
    os._exit(status)
