"""Cluster health check: a plain torchrun script that needs only torch on the hosts.

Run it like any job (``python -m torch.distributed.run ... healthcheck.py``). It checks
rendezvous, a monitored barrier, all_reduce/broadcast correctness and all_reduce
bandwidth, then rank 0 prints a table, a verdict line and one machine-readable
``DDPLAUNCH_HEALTHCHECK_JSON`` line. Exit status: 0 healthy, 1 on any failure.
"""

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FAULT_ENV = "DDPLAUNCH_HC_FAULT_RANK"  # test hook: this rank corrupts its all_reduce result
STALL_ENV = "DDPLAUNCH_HC_STALL_RANK"  # test hook: this rank misses the barrier
CHECK_NUMEL = 4096  # small integers in float32 stay exact through a SUM
GATE_MIN_BYTES = 1 << 20  # smaller messages measure latency, not bandwidth
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class CheckFailed(Exception):
    """A collective step raised on this rank.

    Attributes:
        check: the step that failed ("barrier", "collectives", ...).
        culprits: ranks known to be at fault (from monitored_barrier), else empty.
    """

    def __init__(self, check: str, message: str, culprits=()):
        super().__init__(message)
        self.check = check
        self.culprits = list(culprits)


def emit(line: str) -> None:
    """Writes whole lines with one flushed write, as two ranks share one stdout pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_size(text: str) -> int:
    """Parses ``4K``/``1M``/``2G``/``512`` into bytes (binary multiples, like nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)I?B?\s*", text.upper())
    size = int(match.group(1)) * _SUFFIX[match.group(2)] if match else 0
    if size < 4:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 64K, 1M, 8M (>= 4 bytes)")
    return size


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--sizes", default="4K,64K,1M,8M", help="comma list of byte sizes (K/M/G)")
    parser.add_argument("--iters", type=int, default=5, help="timed all_reduces per size (+2 warm-up)")
    parser.add_argument("--timeout", type=float, default=60.0, help="init and collective timeout, s")
    parser.add_argument("--min-busbw-gbps", type=float, default=None, help="fail below this busbw")
    parser.add_argument("--json", default=None, help="rank 0 writes the JSON result here")
    args = parser.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if not args.sizes or args.iters < 1:
        parser.error("need at least one size and --iters >= 1")
    if args.min_busbw_gbps is not None and max(args.sizes) < GATE_MIN_BYTES:
        parser.error("--min-busbw-gbps needs a size of at least 1M in --sizes")
    return args


def local_facts(backend: str, device: torch.device) -> dict:
    """Returns what this rank knows about itself, for the facts table."""
    ip = "?"
    try:  # a "connected" UDP socket picks the route to the master; no packet is sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            master = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "1")))
            sock.connect(master)
            ip = sock.getsockname()[0]
    except OSError:
        pass
    name = "cpu" if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})"
    return {"rank": dist.get_rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "host": socket.gethostname(), "ip": ip, "torch": torch.__version__,
            "backend": backend, "device": name, "pid": os.getpid()}


def barrier(backend: str, timeout: timedelta) -> None:
    """Monitored barrier on gloo (names missing ranks); plain barrier on nccl.

    On nccl a missing rank is caught by the NCCL watchdog at the process-group timeout,
    which aborts the process (non-zero exit) instead of hanging.

    Raises:
        CheckFailed: the barrier failed; ``culprits`` lists the ranks rank 0 waited for.
    """
    try:
        if backend == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception as exc:  # the message is the diagnosis; keep it
        found = re.search(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
        if not found:  # non-zero ranks only see a broken connection or a timeout
            raise CheckFailed("barrier", f"barrier failed: {exc}") from exc
        culprits = [int(r) for r in found.group(1).replace(",", " ").split()]
        raise CheckFailed("barrier", "did not reach the monitored barrier within "
                                     f"{timeout.total_seconds():g}s", culprits) from exc


def check_collectives(device: torch.device) -> list:
    """Verifies all_reduce(SUM) and broadcast results exactly; returns this rank's failures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pattern = torch.arange(CHECK_NUMEL, dtype=torch.float32, device=device)
    # rank+1 everywhere plus a position pattern, so a swapped or dropped chunk shows.
    tensor = pattern + (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if os.environ.get(FAULT_ENV, "").strip() == str(rank):
        tensor.mul_(4)  # test hook: only this rank sees a wrong result
    failures = []
    expected = pattern * world + world * (world + 1) / 2
    bad = (tensor != expected).nonzero()
    if bad.numel():
        i = int(bad[0])
        failures.append(("all_reduce", f"all_reduce result wrong: got {tensor[i].item()} "
                                       f"expected {expected[i].item()} at index {i}"))
    sent = pattern * 3 + 7 if rank == 0 else torch.zeros_like(pattern)
    dist.broadcast(sent, src=0)
    bad = (sent != pattern * 3 + 7).nonzero()
    if bad.numel():
        i = int(bad[0])
        failures.append(("broadcast", f"broadcast from rank 0 wrong: got {sent[i].item()} "
                                      f"expected {(i * 3 + 7):.1f} at index {i}"))
    return failures


def measure_bandwidth(sizes: list, iters: int, device: torch.device) -> list:
    """Times all_reduce per size; the slowest rank's time counts, like nccl-tests."""
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        count = size // 4
        tensor = torch.ones(count, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        per_op = elapsed.item() / iters
        nbytes = count * 4
        algbw = nbytes / per_op / 1e9
        rows.append({"bytes": nbytes, "count": count, "iters": iters, "time_us": per_op * 1e6,
                     "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world})
    return rows


def render_table(result: dict) -> str:
    """Formats the facts and bandwidth tables for humans (rank 0 prints it once)."""
    lines = [f"{'rank':>4}  {'host':<20} {'ip':<15} {'device':<28} torch"]
    for f in result["ranks"]:
        lines.append(f"{f['rank']:>4}  {f['host']:<20} {f['ip']:<15} {f['device']:<28} {f['torch']}")
    if result["bandwidth"]:
        lines.append(f"{'bytes':>12} {'count':>10} {'iters':>5} {'time_us':>10} "
                     f"{'algbw_GBps':>10} {'busbw_GBps':>10}")
        for r in result["bandwidth"]:
            lines.append(f"{r['bytes']:>12} {r['count']:>10} {r['iters']:>5} {r['time_us']:>10.1f} "
                         f"{r['algbw_gbps']:>10.3f} {r['busbw_gbps']:>10.3f}")
    return "\n".join(lines)


def describe(failure: dict) -> str:
    """Formats one failure as ``rank R (host H): message`` (no prefix when no rank is to blame)."""
    where = "" if failure["rank"] is None else f"rank {failure['rank']} (host {failure['host']}): "
    return where + failure["message"]


def write_json_atomically(path: str, result: dict) -> None:
    """Writes via a temp file in the same directory and os.replace, so readers never see half."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".healthcheck.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(result, out, indent=2, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def report(result: dict, json_path) -> None:
    """Rank 0 only: table, verdict line, JSON line and the optional JSON file."""
    emit(render_table(result))
    if result["ok"]:
        emit(f"HEALTHCHECK OK world={result['world_size']} backend={result['backend']}")
    else:
        emit("HEALTHCHECK FAIL: " + "; ".join(describe(f) for f in result["failures"]))
    emit("DDPLAUNCH_HEALTHCHECK_JSON " + json.dumps(result, separators=(",", ":"), sort_keys=True))
    if json_path:
        write_json_atomically(json_path, result)


def run_checks(args, backend: str, device: torch.device, result: dict) -> None:
    """Runs every step, filling ``result``; every rank takes the same collectives."""
    timeout = timedelta(seconds=args.timeout)
    try:
        facts = [None] * dist.get_world_size()
        dist.all_gather_object(facts, local_facts(backend, device))
    except Exception as exc:
        raise CheckFailed("facts", f"all_gather_object of rank facts failed: {exc}") from exc
    result["ranks"] = facts
    if os.environ.get(STALL_ENV, "").strip() == str(dist.get_rank()):
        time.sleep(2 * args.timeout)  # test hook: arrive after the barrier gave up
    barrier(backend, timeout)
    try:
        mine = check_collectives(device)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    except Exception as exc:
        raise CheckFailed("collectives", f"correctness collectives raised: {exc}") from exc
    for rank, failures in enumerate(everyone):
        for check, message in failures:
            result["failures"].append({"rank": rank, "host": facts[rank]["host"],
                                       "check": check, "message": message})
    if result["failures"]:  # every rank saw the same gathered list, so all skip together
        return
    try:
        result["bandwidth"] = measure_bandwidth(args.sizes, args.iters, device)
    except Exception as exc:
        raise CheckFailed("bandwidth", f"bandwidth sweep raised: {exc}") from exc
    largest = max(result["bandwidth"], key=lambda row: row["bytes"])
    gate = args.min_busbw_gbps
    if gate is not None and largest["busbw_gbps"] < gate:
        result["failures"].append({"rank": None, "host": None, "check": "bandwidth", "message":
                                   f"busbw {largest['busbw_gbps']:.3f} GB/s at {largest['bytes']} bytes "
                                   f"is below --min-busbw-gbps {gate}"})


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    host = socket.gethostname()
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        emit(f"HEALTHCHECK FAIL: rank {rank} (host {host}): --backend nccl needs CUDA, "
             "but torch.cuda.is_available() is False; use --backend gloo")
        return 1
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    except Exception as exc:
        emit(f"HEALTHCHECK FAIL: rank {rank} (host {host}): init_process_group failed: {exc}")
        return 1
    result = {"ok": False, "world_size": dist.get_world_size(), "backend": backend, "ranks": [],
              "failures": [], "bandwidth": [], "min_busbw_gbps": args.min_busbw_gbps, "elapsed_s": 0.0}
    try:
        run_checks(args, backend, device, result)
    except CheckFailed as exc:
        # A collective raised (timeout, dead peer): peers raise too, so nobody waits on us.
        hosts = {f["rank"]: f["host"] for f in result["ranks"]}
        hosts.setdefault(rank, host)
        for culprit in exc.culprits or [rank]:
            result["failures"].append({"rank": culprit, "host": hosts.get(culprit, "?"),
                                       "check": exc.check, "message": str(exc)})
        result["elapsed_s"] = time.perf_counter() - started
        if rank == 0:
            report(result, args.json)
        else:
            emit("HEALTHCHECK FAIL: " + describe(result["failures"][-1]))
        return 1  # no destroy_process_group: it can block on a broken group
    result["ok"] = not result["failures"]
    result["elapsed_s"] = time.perf_counter() - started
    if rank == 0:
        report(result, args.json)
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
