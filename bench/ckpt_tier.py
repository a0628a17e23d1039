"""How long a checkpoint save blocks the training loop: `ddplaunch.checkpoint.save` (tensors copied
into a reused /dev/shm buffer; checksum and durable write in the background) against the careful
disk save (torch.save to a temporary file, fsync, rename, directory fsync) into the same durable
directory, for one process's state of `--mb` MB (default 256), interleaved, median of `--saves`.

    .venv/bin/python bench/ckpt_tier.py [--mb 256] [--saves 8] [--dir /var/tmp]

Rows: the time each call blocks; for the tier also the time from the save's start until `wait()`
returns (its copy durable: checksummed, written, fsynced, renamed). Each round runs the tier save
then its wait, and the careful save, in alternating order, so no background write overlaps the
other method's save. One unrecorded save of each warms up first (the tier's buffer is allocated once
and reused, as in a job that saves every N steps). Also shown: torch.save into /dev/shm with a
rename, what an unmodified script pays on a memory-backed checkpoint dir, and the floor of any
save that must copy the bytes before it returns: the same bytes written into a reused /dev/shm file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddplaunch import checkpoint  # noqa: E402


def make_state(mb: int) -> dict[str, Any]:
    """A model's and an Adam optimizer's state: weights, exp_avg and exp_avg_sq, 1/3 each."""
    per = mb * (1 << 20) // 3 // 4 // 8  # eight float32 tensors per third
    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per) for i in range(8)}
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(per), "exp_avg_sq": torch.rand(per)}
                       for i in range(8)}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(8))}]}
    return {"model": model, "optim": optim, "step": 10, "note": "bench"}


def careful_save(state: dict[str, Any], directory: Path, step: int) -> None:
    """torch.save to a temporary file, fsync it, rename it into place, fsync the directory."""
    tmp, final = directory / f".ckpt-{step}.pt.tmp", directory / "ckpt.pt"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shm_save(state: dict[str, Any], directory: Path, step: int) -> None:
    """torch.save into /dev/shm and a rename: an unmodified script on a memory-backed dir."""
    tmp = directory / f".ckpt-{step}.pt.tmp"
    torch.save(state, tmp)
    os.rename(tmp, directory / "ckpt.pt")


def bare_copy(state: dict[str, Any], directory: Path, step: int) -> None:
    """The floor: every tensor's bytes written into one reused /dev/shm file, nothing else."""
    tensors = [t for part in (state["model"], *state["optim"]["state"].values()) for t in part.values()]
    fd = os.open(directory / "floor", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        at = 0
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")
            while view:
                done = os.pwrite(fd, view, at)
                view, at = view[done:], at + done
    finally:
        os.close(fd)


def timed(fn: Callable[..., None], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def tier_round(state: dict[str, Any], step: int) -> tuple[float, float]:
    start = time.perf_counter()
    checkpoint.save(state, step)
    blocked = time.perf_counter() - start
    checkpoint.wait(timeout=600)
    return blocked, time.perf_counter() - start


def run(mb: int, saves: int, base: Path) -> dict[str, list[float]]:
    state = make_state(mb)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=base))
    shm = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm"))
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    (work / "careful").mkdir()
    checkpoint.configure(work / "tier", run_id=run_id, host="bench", durable_keep=2)
    rows: dict[str, list[float]] = {"tier": [], "durable": [], "careful": [], "shm": [], "floor": []}
    try:
        tier_round(state, 0)
        careful_save(state, work / "careful", 0)
        shm_save(state, shm, 0)
        bare_copy(state, shm, 0)
        for i in range(1, saves + 1):
            order = ["tier", "careful", "shm", "floor"] if i % 2 else ["floor", "careful", "shm", "tier"]
            for what in order:
                if what == "tier":
                    blocked, durable = tier_round(state, i)
                    rows["tier"].append(blocked)
                    rows["durable"].append(durable)
                elif what == "careful":
                    rows["careful"].append(timed(careful_save, state, work / "careful", i))
                else:
                    rows[what].append(timed(shm_save if what == "shm" else bare_copy, state, shm, i))
    finally:
        checkpoint.free(run_id)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the durable dirs go (a disk)")
    args = parser.parse_args()
    rows = run(args.mb, args.saves, args.dir)
    careful = statistics.median(rows["careful"])
    names = {"tier": "`checkpoint.save` blocks", "careful": "torch.save + fsync + rename + dir fsync",
             "shm": "torch.save into /dev/shm + rename", "durable": "`checkpoint.save` until durable (`wait()`)",
             "floor": "the floor: the same bytes written into a reused /dev/shm file"}
    print(f"{args.mb} MB of state, {args.saves} saves each, interleaved (median, min, max in s)\n")
    print("| save | median s | min s | max s | vs careful save |")
    print("|---|---:|---:|---:|---:|")
    for key in ("tier", "floor", "careful", "shm", "durable"):
        vals = rows[key]
        print(f"| {names[key]} | {statistics.median(vals):.3f} | {min(vals):.3f} | {max(vals):.3f} | "
              f"{statistics.median(vals) / careful * 100:.0f} % |")


if __name__ == "__main__":
    main()
