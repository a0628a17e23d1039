"""Checkpoint save and load time: FSDP2 sharded DCP vs DDP's full checkpoint, per model size and
world size, on localhost (Gloo, CPU).

    .venv/bin/python bench/checkpoint.py [--worlds 2 4] [--repeats 3] [--sizes 64x2 256x4 512x6]

- FSDP: jobs/fsdp_train.py's own save_checkpoint (every rank writes its shard with
  torch.distributed.checkpoint into step_N.tmp/, barrier, rename, ``latest``) and load_latest
  (every rank reads what overlaps its shard).
- DDP: what jobs/train.py does: rank 0 torch.saves the full model and optimizer state to a
  temporary file, fsyncs and renames it; to load, rank 0 reads it and broadcasts it, and every
  rank loads it.

Both hold the same model (jobs/fsdp_train.TinyLM) after one Adam step. Times are rank 0's, from
a barrier before to a barrier after (so they include the slowest rank). Runs are interleaved
(repeat 1 of every world size, then repeat 2, ...; FSDP first on odd repeats, DDP first on even
ones) and the table shows the median of the repeats. Run it on an otherwise idle machine:
every rank is a process on this machine's cores and writes to its disk.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "tests"))


def worker(args) -> None:
    """One torchrun worker: for every size, time both checkpoint kinds once."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fsdp_train as job

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    results = []
    for size in args.sizes:
        dim, layers = map(int, size.split("x"))
        models = {kind: job.build(kind, dim, layers, 4, 0, device) for kind in ("fsdp", "ddp")}
        for model, wrapped, optimizer in models.values():  # one step: Adam state exists
            batch = job.make_data(64)[:8]
            loss = F.cross_entropy(wrapped(batch[:, :-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        n_params = sum(p.numel() for p in models["ddp"][0].parameters())
        order = ("fsdp", "ddp") if args.repeat % 2 else ("ddp", "fsdp")
        row = {"size": size, "params": n_params, "world": dist.get_world_size(), "repeat": args.repeat}
        for kind in order:
            model, wrapped, optimizer = models[kind]
            ckpt_dir = os.path.join(args.dir, f"{size}-{kind}")
            if kind == "fsdp":
                ns = argparse.Namespace(ckpt_dir=ckpt_dir, keep=1)
                row["fsdp_save_s"] = job.save_checkpoint(ns, model, optimizer, 1, {"bench": True})
                row["fsdp_mb"] = dir_mb(os.path.join(ckpt_dir, "step_1"))
                meta, row["fsdp_load_s"] = job.load_latest(ns, model, optimizer)
                assert meta and meta["step"] == 1
            else:
                row["ddp_save_s"], row["ddp_mb"] = ddp_save(model, optimizer, ckpt_dir)
                row["ddp_load_s"] = ddp_load(model, optimizer, ckpt_dir)
        results.append(row)
        del models
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def dir_mb(path: str) -> float:
    return sum(p.stat().st_size for p in Path(path).iterdir()) / 2 ** 20


def ddp_save(model, optimizer, ckpt_dir: str):
    """jobs/train.py's checkpoint: rank 0 writes the full state, atomically."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    path, size = os.path.join(ckpt_dir, "ckpt.pt"), 0.0
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as out:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        size = os.path.getsize(path) / 2 ** 20
    dist.barrier()
    return time.perf_counter() - start, size


def ddp_load(model, optimizer, ckpt_dir: str) -> float:
    """jobs/train.py's resume: rank 0 reads (weights only: no pickled code runs), broadcasts; every rank loads."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    box = [None]
    if dist.get_rank() == 0:
        box[0] = torch.load(os.path.join(ckpt_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    dist.broadcast_object_list(box, src=0)
    model.load_state_dict(box[0]["model"])
    optimizer.load_state_dict(box[0]["optimizer"])
    dist.barrier()
    return time.perf_counter() - start


def driver(args) -> int:
    from torchrun_util import run_torchrun
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for repeat in range(1, args.repeats + 1):
            for world in args.worlds:
                out = os.path.join(tmp, f"r{repeat}-w{world}.json")
                run_dir = os.path.join(tmp, f"r{repeat}-w{world}")
                run = run_torchrun(__file__, "--worker", "--repeat", repeat, "--dir", run_dir,
                                   "--out", out, "--sizes", *args.sizes, nproc=world,
                                   timeout=args.timeout)
                if run.returncode != 0:
                    print(run.stdout, file=sys.stderr)
                    print(f"bench: worker run (world {world}, repeat {repeat}) failed", file=sys.stderr)
                    return 1
                with open(out) as f:
                    rows += json.load(f)
                subprocess.run(["rm", "-rf", run_dir], check=True)
                print(f"# repeat {repeat} world {world} done", file=sys.stderr, flush=True)
    keys = ("fsdp_save_s", "ddp_save_s", "fsdp_load_s", "ddp_load_s")
    print(f"checkpoint save/load seconds, median of {args.repeats} interleaved runs "
          f"(localhost, Gloo, {os.cpu_count()} CPUs)")
    print("| model (dim x layers) | params | ranks | FSDP DCP save | DDP full save | "
          "FSDP DCP load | DDP full load | on disk DCP / full (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        for world in args.worlds:
            group = [r for r in rows if r["size"] == size and r["world"] == world]
            med = {k: statistics.median(r[k] for r in group) for k in keys}
            print(f"| {size} | {group[0]['params'] / 1e6:.2f} M | {world} | "
                  + " | ".join(f"{med[k]:.3f}" for k in keys)
                  + f" | {group[0]['fsdp_mb']:.1f} / {group[0]['ddp_mb']:.1f} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=["64x2", "256x4", "512x6"],
                   help="model sizes as DIMxLAYERS")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per torchrun")
    # Worker side (set by the driver).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        sys.stdout.flush()
        os._exit(0)  # skip teardown, as the jobs do (Gloo threads)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
