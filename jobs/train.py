"""A real, small DDP training run: deterministic, checkpointed, resumable, self-checking.

A plain torchrun script (needs only torch): an MLP learns a fixed synthetic function,
rank 0 writes atomic checkpoints, a restarted run resumes bitwise-identically, and the
run ends by proving every replica holds the same weights (exit 1 if they differ).

Checkpoints hold only tensors and plain Python values, so resuming loads them with
``torch.load(..., weights_only=True)``, which cannot run code: a file that needs more (a
planted pickle, a checkpoint of an older format) is refused with one line and exit 2, never
loaded unsafely. So is a checkpoint directory or file that another user could have written.
"""

import argparse
import glob
import hashlib
import os
import pickle
import random
import re
import signal
import socket
import stat
import sys
import time
import zipfile
from datetime import timedelta

# find_unused_parameters=True (see main) makes DDP's C++ reducer warn once per rank that no parameter
# was unused -- which is the point here. That warning comes from the autograd thread, past Python's
# warnings filters, so it is quieted at its source: C++ warnings of this process, unless asked for.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# Bitwise-reproducible math from run to run: MKL (torch's CPU BLAS) otherwise picks code paths by
# the memory alignment of each buffer, so the same step can round differently in two processes
# (seen: one run in ten differing at step 1). Set before torch loads MKL.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

IN_DIM, HIDDEN, OUT_DIM = 16, 64, 4
DATA_SEED = 1234  # the task itself never changes; --seed varies init and data order
CKPT_RE = re.compile(r"ckpt_step(\d+)\.pt$")
#: Exit status after a preemption warning: checkpoint written, run again to resume (EX_TEMPFAIL).
PREEMPTED_EXIT = 75
#: Exit status when the newest checkpoint is refused (unsafe to load, or not this job's format).
REFUSED_EXIT = 2
#: Layout of the checkpoint dict. 2: nothing but tensors and plain values (loads with weights_only).
CKPT_FORMAT = 2
CKPT_KEYS = ("format", "model", "optimizer", "step", "epoch", "start_loss", "rng", "world_size", "config")
_preempt = {"signalled": False}


def say(line: str) -> None:
    """Writes one whole flushed line; local ranks share a stdout pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def burn(ms: float) -> None:
    """Spend `ms` milliseconds of this thread's CPU time (wall time stretches on a slow CPU)."""
    start = time.thread_time()
    while (time.thread_time() - start) * 1e3 < ms:
        pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=1024, help="synthetic data set size")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="cap on steps per epoch")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-name", default=os.environ.get("DDPLAUNCH_RUN_NAME", "default"))
    p.add_argument("--ckpt-dir", default=None,
                   help="default: $DDPLAUNCH_CHECKPOINT_DIR (the spec's checkpoint.path), $DDPLAUNCH_CKPT_DIR, "
                        "else checkpoints/<run name>")
    p.add_argument("--ckpt-every", type=int, default=10, help="steps; 0 = only at epoch ends")
    p.add_argument("--ckpt-api", action="store_true",
                   help="save and resume with ddplaunch.checkpoint (its memory tier) instead of torch.save; "
                        "durable dir: $DDPLAUNCH_CHECKPOINT_DURABLE (the spec's checkpoint.durable), else the "
                        "checkpoint dir")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    # Test hooks.
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="with --fail-rank: exit 3 there, in the first launch only (a transient failure)")
    p.add_argument("--raise-at-step", type=int, default=None,
                   help="with --fail-rank: raise ValueError there, in every launch (a failure that repeats)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--pause-every", type=int, default=0,
                   help="steps; every rank pauses --pause-s there, silent (an evaluation between steps)")
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--dist-timeout", type=float, default=float(os.environ.get("DDPLAUNCH_DIST_TIMEOUT", "300")),
                   help="seconds a collective may wait for a peer (init_process_group's timeout)")
    p.add_argument("--burn-ms", type=float, default=0.0,
                   help="CPU milliseconds to spend per step (a heavier model's compute: slowed by a slow CPU)")
    p.add_argument("--corrupt-rank", type=int, default=None, help="perturb this rank's weights")
    args = p.parse_args(argv)
    args.ckpt_dir = args.ckpt_dir or os.environ.get("DDPLAUNCH_CHECKPOINT_DIR") or \
        os.environ.get("DDPLAUNCH_CKPT_DIR") or \
        os.path.join("checkpoints", args.run_name)
    return args


def make_data(samples: int):
    """A learnable target: a fixed random linear map followed by tanh, same on every rank."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(samples, IN_DIM, generator=gen)
    w = torch.randn(IN_DIM, OUT_DIM, generator=gen) / IN_DIM ** 0.5
    return x, torch.tanh(2.0 * (x @ w))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                         nn.Tanh(), nn.Linear(HIDDEN, OUT_DIM))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


class CheckpointRefused(Exception):
    """A checkpoint (or checkpoint directory) this job will not resume from; the message is one line."""


def rng_state() -> dict:
    """Every RNG's state as tensors and plain values, which weights_only loading accepts.

    numpy's own state tuple holds an ndarray and Python's is a tuple of 625 ints: the first
    would need numpy globals to unpickle, so both are taken apart (all words fit in int64).
    """
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, words, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "python": {"version": int(version), "words": torch.tensor(words, dtype=torch.int64),
                       "gauss_next": gauss_next},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    """Restores what `rng_state` captured, exactly."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["key"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss_next"]))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def plain_config(args: argparse.Namespace) -> dict:
    """The command line as str/int/float/bool/None values (anything else as its str)."""
    return {k: v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
            for k, v in vars(args).items()}


def make_checkpoint(args, model: nn.Module, optimizer, step: int, steps_per_epoch: int,
                    start_loss: float, world: int) -> dict:
    """The checkpoint dict: tensors, dicts, lists and plain values only (see CKPT_FORMAT)."""
    return {"format": CKPT_FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "step": step, "epoch": step // steps_per_epoch, "start_loss": start_loss, "rng": rng_state(),
            "world_size": world, "config": plain_config(args)}


def find_latest(ckpt_dir: str):
    """Returns the newest complete checkpoint path, or None.

    Only complete files ever carry the final name (they arrive by os.replace), so the
    highest step number is the latest; the ``latest`` file is for humans and tools.
    """
    found = [(int(m.group(1)), path) for path in glob.glob(os.path.join(ckpt_dir, "ckpt_step*.pt"))
             if (m := CKPT_RE.search(path))]
    return max(found)[1] if found else None


def replace_atomically(path: str, write) -> None:
    """Writes via ``write(fileobj)`` to a temp file (0600: only this user), fsyncs, renames over ``path``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        write(out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def save_checkpoint(args, state: dict) -> None:
    """Rank 0 only: atomic checkpoint file, then the ``latest`` pointer, then pruning.

    A new checkpoint directory is made 0700: resuming refuses one that others can write.
    """
    os.makedirs(args.ckpt_dir, mode=0o700, exist_ok=True)
    name = f"ckpt_step{state['step']}.pt"
    replace_atomically(os.path.join(args.ckpt_dir, name), lambda out: torch.save(state, out))
    replace_atomically(os.path.join(args.ckpt_dir, "latest"), lambda out: out.write(name.encode() + b"\n"))
    dir_fd = os.open(args.ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the renames themselves durable
    finally:
        os.close(dir_fd)
    steps = sorted(int(m.group(1)) for p in os.listdir(args.ckpt_dir) if (m := CKPT_RE.search(p)))
    for old in steps[:-args.keep] if args.keep > 0 else []:
        os.remove(os.path.join(args.ckpt_dir, f"ckpt_step{old}.pt"))


def refuse_if_others_can_write(path: str) -> None:
    """Raises CheckpointRefused unless only this user (or root) can have written ``path``.

    weights_only stops code, not tampering: whoever can write the directory can plant a
    checkpoint with weights of their choosing, and the newest one wins.
    """
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise CheckpointRefused(f"refusing {path}: it belongs to uid {st.st_uid}, not to this job's user "
                                f"(uid {me}) or root; resume only from a checkpoint directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointRefused(f"refusing {path}: others can write it (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}), so anyone among them could plant a "
                                f"checkpoint; check its contents, then `chmod go-w {path}`, or use a "
                                f"--ckpt-dir only you can write")


def unpickling_reason(exc: BaseException) -> str:
    """The telling part of torch's long weights_only error: the global it would have imported."""
    text = str(exc)
    found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL (\S+)", text)
    if found:
        return f"it needs the global {found.group(1)}"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return f"{type(exc).__name__}: {first[:160]}"


def read_checkpoint(path: str) -> dict:
    """Loads one checkpoint file with weights_only=True; CheckpointRefused (one line) if it cannot.

    Never falls back to unsafe loading: a file that needs anything beyond tensors and plain
    values either was planted or predates CKPT_FORMAT 2, and either way must not be unpickled.
    """
    refuse_if_others_can_write(path)
    what_to_do = (f"nothing from it was loaded. If this job did not write it, move it out of "
                  f"{os.path.dirname(path) or '.'} and find out who could; a checkpoint of an older "
                  f"train.py (before format {CKPT_FORMAT}) cannot be resumed safely: move it away "
                  f"to start over")
    if not zipfile.is_zipfile(path):  # torch.save's format; a bare pickle is never handed to torch.load
        raise CheckpointRefused(f"refusing {path}: not a torch.save archive (a bare pickle, or damaged); "
                                + what_to_do)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointRefused(f"refusing {path}: torch.load(weights_only=True) rejects it "
                                f"({unpickling_reason(exc)}): unpickling it could run code; "
                                + what_to_do) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointRefused(f"refusing {path}: it does not load ({unpickling_reason(exc)}); "
                                + what_to_do) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT or \
            any(key not in ckpt for key in CKPT_KEYS):
        got = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointRefused(f"refusing {path}: not a format-{CKPT_FORMAT} checkpoint of this train.py "
                                f"(format {got!r}, or keys missing); " + what_to_do)
    return ckpt


def newest_checkpoint(ckpt_dir: str):
    """(path, checkpoint) of the newest checkpoint, None if there is none; CheckpointRefused if the
    directory or that file is not safe to resume from. An older checkpoint is never tried instead:
    quietly going back in time would hide a planted file."""
    if not os.path.exists(ckpt_dir):
        return None
    refuse_if_others_can_write(ckpt_dir)
    path = find_latest(ckpt_dir)
    return (path, read_checkpoint(path)) if path else None


def load_checkpoint(args, rank: int):
    """Rank 0 reads the newest checkpoint and broadcasts it, so hosts need no shared disk.

    Returns None or (path, checkpoint) on every rank, or raises CheckpointRefused on every rank.
    (broadcast_object_list pickles between this job's own ranks: what it carries came out of
    weights_only loading, so it holds nothing but tensors and plain values.)
    """
    box = [None]
    if rank == 0:
        try:
            box[0] = newest_checkpoint(args.ckpt_dir)
        except CheckpointRefused as exc:
            box[0] = str(exc)  # every rank must learn of the refusal, or the others would hang
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise CheckpointRefused(box[0])
    return box[0]


def checkpoint_api(args):
    """`ddplaunch.checkpoint` (imported only with --ckpt-api), configured: the launcher's durable dir,
    else the checkpoint dir; the durable dir keeps --keep complete steps, as the torch.save path does."""
    from ddplaunch import checkpoint

    checkpoint.configure(durable=os.environ.get("DDPLAUNCH_CHECKPOINT_DURABLE") or args.ckpt_dir,
                         durable_keep=args.keep if args.keep > 0 else None)
    return checkpoint


def api_load(tier):
    """--ckpt-api: the newest complete checkpoint wherever the tier holds it (a host's RAM, a buddy's
    copy, the durable dir), the same on every rank (every rank calls it): None, or (the path it was
    read from, the checkpoint, where that is in words); CheckpointRefused on every rank if it is not
    this train.py's. The tier checks every copy against its checksums: nothing unpickled is a file
    someone else planted unless they could write this user's RAM or durable dir."""
    got = tier.load()
    if got is None:
        return None
    ckpt, source = got.state, got.source
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT or any(key not in ckpt for key in CKPT_KEYS):
        raise CheckpointRefused(f"refusing step {got.step} in {source.path}: not a format-{CKPT_FORMAT} "
                                "checkpoint of this train.py; nothing from it was loaded")
    if source.where.value == "memory":
        where = f"{source.host}'s memory" + (f", saved by {source.origin}" if source.origin not in (None, source.host)
                                             else "")
    else:
        where = "the durable dir"
    return str(source.path), ckpt, where


def params_sha256(model: nn.Module) -> str:
    """Hashes every parameter's bytes, on CPU, in the module's fixed order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def check_replicas(model: nn.Module, rank: int, world: int) -> bool:
    """Gathers every rank's parameter hash; rank 0 reports. Same verdict on all ranks."""
    hashes = [None] * world
    dist.all_gather_object(hashes, params_sha256(model))
    if len(set(hashes)) == 1:
        if rank == 0:
            say(f"replicas identical: {hashes[0][:16]} on {world} ranks")
            say(f"final_weights_sha256={hashes[0]}")
        return True
    if rank == 0:
        groups = {}
        for r, h in enumerate(hashes):
            groups.setdefault(h, []).append(r)
        detail = "; ".join(f"ranks {ranks} have {h[:16]}" for h, ranks in
                           sorted(groups.items(), key=lambda item: -len(item[1])))
        say(f"replicas DIFFER: {len(groups)} distinct weight hashes: {detail}")
    return False


def preemption_agreed() -> bool:
    """True on every rank once any rank got SIGUSR2 (one tiny all_reduce per step keeps the
    ranks in the same collectives: each stops at the same step)."""
    flag = torch.tensor([1.0 if _preempt["signalled"] else 0.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def init_distributed(backend: str, timeout: timedelta, device: torch.device) -> None:
    """init_process_group from the torchrun env, safe across torchrun restarts; on CUDA the group
    is bound to the rank's device (NCCL's barrier otherwise warns that it guesses the device).

    torchrun keeps one agent TCPStore for the whole job, and keys are not namespaced
    per restart: a restarted worker can read its dead predecessor's entries and fail
    ("Connection refused" from gloo) or hang. A per-restart key prefix avoids that.
    """
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


def main(argv=None) -> int:
    # Slurm's warning ahead of the time limit (`--signal`, forwarded by torchrun's
    # --signals-to-handle): checkpoint at the next step every rank agrees on, then exit.
    signal.signal(signal.SIGUSR2, lambda signum, frame: _preempt.update(signalled=True))
    args = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.dist_timeout)
    init_distributed(backend, timeout, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # the first launch: neither torchrun nor ddplaunch (a recovery, a restart) started it again
    first_launch = restart == 0 and os.environ.get("DDPLAUNCH_RECOVERY", "0") == "0"
    if rank == 0:
        say(f"train: world_size={world} backend={backend} host={socket.gethostname()} "
            f"restart={restart} ckpt_dir={args.ckpt_dir}")

    seed_everything(args.seed)  # same seed on every rank: identical initial weights
    x_all, y_all = make_data(args.samples)
    sampler = DistributedSampler(range(args.samples), num_replicas=world, rank=rank,
                                 shuffle=True, seed=args.seed)
    steps_per_epoch = len(sampler) // args.batch_size  # equal on every rank, as DDP needs
    if args.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, args.steps_per_epoch)
    if steps_per_epoch < 1:
        raise SystemExit(f"train: --samples {args.samples} gives no full batch of "
                         f"{args.batch_size} per rank on {world} ranks; lower --batch-size")
    total_steps = steps_per_epoch * args.epochs

    model = make_model().to(device)
    loss_fn = nn.MSELoss()
    with torch.no_grad():
        start_loss = loss_fn(model(x_all.to(device)), y_all.to(device)).item()
    step = 0
    tier = checkpoint_api(args) if args.ckpt_api else None
    try:
        resumed = api_load(tier) if tier is not None else load_checkpoint(args, rank)
    except CheckpointRefused as exc:
        if rank == 0:
            sys.stderr.write(f"train: {exc}\n")
            sys.stderr.flush()
        dist.destroy_process_group()
        return REFUSED_EXIT
    if resumed:
        path, ckpt, where = resumed if tier is not None else (*resumed, "")
        model.load_state_dict(ckpt["model"])
        step, start_loss = ckpt["step"], ckpt["start_loss"]
        if ckpt["world_size"] != world and rank == 0:
            say(f"warning: checkpoint was written by {ckpt['world_size']} ranks, now {world}: "
                "the data order differs from an uninterrupted run")
        if rank == 0:
            say(f"resumed from {path} at step {step}" + (f" ({where})" if where else ""))
    # find_unused_parameters=True also stops DDP from rebuilding its gradient buckets after the
    # first step of every start; a rebuild changes the summation order of the all_reduce, and a
    # resumed run (which rebuilds again) would then differ from an uninterrupted one in the last
    # bits once there are more than 2 ranks. This model is tiny: the extra graph walk is free.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              find_unused_parameters=True)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    if resumed:
        optimizer.load_state_dict(resumed[1]["optimizer"])
        set_rng_state(resumed[1]["rng"])

    def checkpoint() -> None:
        if rank == 0:
            state = make_checkpoint(args, model, optimizer, step, steps_per_epoch, start_loss, world)
            if tier is not None:
                tier.save(state, step)  # returns once the tensors are in this host's RAM
            else:
                save_checkpoint(args, state)
        dist.barrier()  # nobody runs ahead of a checkpoint that may be needed to resume

    while step < total_steps:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        order = list(sampler)
        # Skipping the batches already done this epoch keeps a resumed run's batch sequence
        # identical to an uninterrupted one.
        for batch_no in range(done_in_epoch, steps_per_epoch):
            if step == args.fail_at_step and rank == args.fail_rank and first_launch:
                say(f"rank={rank} failing on purpose at step {step} (--fail-at-step)")
                os._exit(3)
            if step == args.raise_at_step and rank == args.fail_rank:
                raise ValueError(f"injected failure at step {step} (--raise-at-step)")
            idx = torch.tensor(order[batch_no * args.batch_size:(batch_no + 1) * args.batch_size])
            xb, yb = x_all[idx].to(device), y_all[idx].to(device)
            burn(args.burn_ms)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(xb), yb)
            loss.backward()  # DDP all_reduces (averages) gradients here
            optimizer.step()
            step += 1
            if step % args.log_every == 0 or step == total_steps:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                if rank == 0:
                    say(f"step={step} epoch={epoch} loss={mean.item() / world:.6f}")
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.pause_every and step % args.pause_every == 0 and step < total_steps:
                time.sleep(args.pause_s)  # silent, stepping nowhere: an evaluation's pause
            if (args.ckpt_every and step % args.ckpt_every == 0) or batch_no == steps_per_epoch - 1:
                checkpoint()
            if preemption_agreed():
                checkpoint()
                if tier is not None:
                    tier.close()  # os._exit skips the tier's own drain at exit: durable before the exit
                if rank == 0:
                    say(f"preempted (SIGUSR2): checkpoint at step {step}; exiting {PREEMPTED_EXIT} to be requeued")
                del ddp, optimizer
                dist.destroy_process_group()
                return PREEMPTED_EXIT

    with torch.no_grad():
        final_loss = loss_fn(model(x_all.to(device)), y_all.to(device)).item()
    if rank == 0:
        say(f"final loss={final_loss:.4f} (start {start_loss:.4f}) steps={step}")
    if args.corrupt_rank == rank:
        with torch.no_grad():  # test hook: no collective, so only this replica drifts
            next(model.parameters()).add_(1e-3)
    identical = check_replicas(model, rank, world)
    # Drop DDP (its reducer holds the process group) before destroying the group: the
    # other order sometimes aborts at exit ("terminate called without an active exception").
    del ddp, optimizer
    if tier is not None:
        tier.close()  # os._exit skips the tier's own drain at exit: the last save durable (and said) first
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is saved and the group is destroyed: skip interpreter teardown, where gloo's and
    # DDP's C++ threads are sometimes destroyed in an order that aborts the process ("terminate
    # called without an active exception", ~1 run in 20 on 6 ranks) after a clean run.
    os._exit(status)
