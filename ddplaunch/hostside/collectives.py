"""The health check's collectives: exact results and timed bandwidth (torch only, runs on the hosts).

Each collective's result is checked exactly on every rank (small integers in float32 stay exact
through a SUM), then timed per size with busbw as nccl-tests defines it; host pairs are timed
in waves of disjoint pairs (the pair algorithm itself is pairs.py). Test hooks: a rank that
corrupts its results, a host whose pair transfers are slowed down.
"""

import os
import re
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

FAULT_ENV = "DDPLAUNCH_HC_FAULT_RANK"  # test hook: this rank corrupts its collective results
SLOW_DELAY_S = 0.25  # a slow host (test hook) waits this long before each pair all_reduce
CHECK_NUMEL = 4096  # small integers in float32 stay exact through a SUM
CHECK_MOD = 1021  # position pattern modulus: sums stay below 2**24 for thousands of ranks
PAIR_ITERS = 3  # timed all_reduces per pair (+1 warm-up)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_UNSUPPORTED_RE = re.compile(r"not supported|unsupported|does not support|not implemented", re.I)


def _first_mismatch(name: str, got: torch.Tensor, expected: torch.Tensor) -> tuple[str, str] | None:
    """One failure tuple for the first wrong element, or None when ``got`` is exact."""
    bad = (got != expected).nonzero()
    if not bad.numel():
        return None
    i = int(bad[0])
    return (name, f"{name} result wrong: got {got[i].item()} expected {expected[i].item()} at index {i}")


def _faulty(rank: int) -> bool:
    return os.environ.get(FAULT_ENV, "").strip() == str(rank)


def _check_all_reduce(device: torch.device, rank: int, world: int) -> tuple[str, str] | None:
    pattern = torch.arange(CHECK_NUMEL, dtype=torch.float32, device=device)
    # rank+1 everywhere plus a position pattern, so a swapped or dropped chunk shows.
    tensor = pattern + (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if _faulty(rank):
        tensor.mul_(4)  # test hook: only this rank sees a wrong result
    return _first_mismatch("all_reduce", tensor, pattern * world + world * (world + 1) / 2)


def _check_all_gather(device: torch.device, rank: int, world: int) -> tuple[str, str] | None:
    chunk = max(1, CHECK_NUMEL // world)
    pattern = torch.arange(world * chunk, dtype=torch.float32, device=device) % CHECK_MOD
    out = torch.full((world * chunk,), -1.0, device=device)
    _all_gather(out, pattern[rank * chunk:(rank + 1) * chunk].clone())
    if _faulty(rank):
        out.mul_(4).add_(1)
    return _first_mismatch("all_gather", out, pattern)


def _check_reduce_scatter(device: torch.device, rank: int, world: int) -> tuple[str, str] | None:
    chunk = max(1, CHECK_NUMEL // world)
    pattern = torch.arange(world * chunk, dtype=torch.float32, device=device) % CHECK_MOD
    out = torch.full((chunk,), -1.0, device=device)
    _reduce_scatter(out, pattern + (rank + 1), op=dist.ReduceOp.SUM)
    if _faulty(rank):
        out.mul_(4).add_(1)
    mine = pattern[rank * chunk:(rank + 1) * chunk]
    return _first_mismatch("reduce_scatter", out, mine * world + world * (world + 1) / 2)


_CHECKS = {"all_reduce": _check_all_reduce, "all_gather": _check_all_gather,
           "reduce_scatter": _check_reduce_scatter}


def check_collectives(device: torch.device,
                      collectives: Iterable[str] = ("all_reduce",)) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Verifies each collective's result (and broadcast) exactly on this rank.

    Returns:
        (failures, unsupported): failures as (check, message) tuples; unsupported maps a
        collective this backend lacks to the error it raised.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    failures, unsupported = [], {}
    for name in collectives:
        try:
            wrong = _CHECKS[name](device, rank, world)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            if not _UNSUPPORTED_RE.search(str(exc)):
                raise
            unsupported[name] = str(exc).strip().splitlines()[0][:300]
            continue
        if wrong:
            failures.append(wrong)
    pattern = torch.arange(CHECK_NUMEL, dtype=torch.float32, device=device)
    sent = pattern * 3 + 7 if rank == 0 else torch.zeros_like(pattern)
    dist.broadcast(sent, src=0)
    if _faulty(rank) and rank != 0:
        sent = sent * 2  # the test hook: a receiver whose copy arrives corrupted
    bad = (sent != pattern * 3 + 7).nonzero()
    if bad.numel():
        i = int(bad[0])
        failures.append(("broadcast", f"broadcast from rank 0 wrong: got {sent[i].item()} "
                                      f"expected {(i * 3 + 7):.1f} at index {i}"))
    return failures, unsupported


def bus_factor(collective: str, world: int) -> float:
    """busbw / algbw as nccl-tests defines it."""
    if collective == "all_reduce":
        return 2 * (world - 1) / world
    return (world - 1) / world  # all_gather, reduce_scatter


def _timed_op(collective: str, size: int, world: int, device: torch.device) -> tuple[int, Callable[[], Any]]:
    """Returns (count, op): ``count`` float32 elements in nccl-tests' sense of the size.

    nccl-tests' size is the whole buffer: all_reduce's tensor, all_gather's output (each rank
    sends size/n), reduce_scatter's input (each rank keeps size/n).
    """
    if collective == "all_reduce":
        count = size // 4
        tensor = torch.ones(count, dtype=torch.float32, device=device)
        return count, lambda: dist.all_reduce(tensor)
    count = max(world, (size // 4) // world * world)
    full = torch.ones(count, dtype=torch.float32, device=device)
    part = torch.ones(count // world, dtype=torch.float32, device=device)
    if collective == "all_gather":
        return count, lambda: _all_gather(full, part)
    return count, lambda: _reduce_scatter(part, full)


def measure_bandwidth(sizes: list[int], iters: int, device: torch.device,
                      collectives: Iterable[str] = ("all_reduce",)) -> list[dict[str, Any]]:
    """Times each collective per size; the slowest rank's time counts, like nccl-tests."""
    world = dist.get_world_size()
    rows = []
    for collective in collectives:
        for size in sizes:
            count, op = _timed_op(collective, size, world, device)
            op()  # warm-up: the pair connections' buffers and the op's own allocations
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                op()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            per_op = elapsed.item() / iters
            nbytes = count * 4
            algbw = nbytes / per_op / 1e9
            rows.append({"collective": collective, "bytes": nbytes, "count": count, "iters": iters,
                         "time_us": per_op * 1e6, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * bus_factor(collective, world)})
    return rows


def _measure_pair(group: Any, size: int, device: torch.device, slow: bool) -> tuple[float | None, str]:
    """One pair probe on this rank: (busbw_gbps or None, detail)."""
    try:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor, group=group)  # warm-up: connections, buffers
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(PAIR_ITERS):
            if slow:
                time.sleep(SLOW_DELAY_S)  # test hook: this host transfers slowly
            dist.all_reduce(tensor, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        algbw = (size // 4) * 4 / (elapsed.item() / PAIR_ITERS) / 1e9
        return algbw * bus_factor("all_reduce", 2), ""
    except Exception as exc:  # the partner sees its own error; the probe is failed either way
        return None, f"all_reduce failed: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__}"


def run_round(pairs: list[tuple[str, str]], leaders: dict[str, int], waves: list[list[int]], size: int,
              device: torch.device, slow: bool) -> list[dict[str, Any]]:
    """Measures every pair (host labels) in `waves` (lists of disjoint pair indices); every rank
    returns the same probe list."""
    me = dist.get_rank()
    backend = dist.get_backend()
    groups = [dist.new_group([leaders[a], leaders[b]], backend=backend) for a, b in pairs]
    mine = {}
    for wave in waves:
        for i in wave:
            if me in (leaders[pairs[i][0]], leaders[pairs[i][1]]):
                mine[i] = _measure_pair(groups[i], size, device, slow)
        dist.barrier()  # waves never overlap
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    probes = []
    for i, (a, b) in enumerate(pairs):
        seen = [everyone[leaders[h]].get(i, (None, "no result")) for h in (a, b)]
        failed = [detail for bw, detail in seen if bw is None]
        busbw = None if failed else min(bw for bw, _ in seen)
        probes.append({"hosts": [a, b], "ok": not failed, "busbw_gbps": busbw,
                       "detail": failed[0] if failed else ""})
    return probes
