"""Cluster health check: a plain torchrun script that needs only torch on the hosts.

Run it like any job (``python -m torch.distributed.run ... healthcheck.py``), or call
``run(argv)`` in a worker before its own script (``entry.py``). It checks rendezvous, a
monitored barrier, exact collective results and bandwidth (``--collectives``), optionally
busbw between host pairs (``--pairwise``), then rank 0 prints a table, a verdict line and one
machine-readable ``DDPLAUNCH_HEALTHCHECK_JSON`` line. Exit status: 0 healthy, 1 on any failure.
The collectives are collectives.py, the pair algorithm pairs.py: staged beside this file and
loaded from here under names no job's own modules can shadow.

It uses a process group of its own on the key prefix ``ddplaunch/healthcheck/<restart>`` of
torchrun's store and destroys it at the end, so the process is clean for the job's own
``init_process_group()``.
"""

import argparse
import importlib.util
import json
import os
import re
import socket
import sys
import tempfile
import time
from datetime import timedelta
from types import ModuleType
from typing import Any, Iterable, NoReturn

import torch
import torch.distributed as dist

STALL_ENV = "DDPLAUNCH_HC_STALL_RANK"  # test hook: this rank misses the barrier
SLOW_ENV = "DDPLAUNCH_HC_SLOW_HOST"  # test hook: this host's pair transfers are slowed down
HOST_ENV = "DDPLAUNCH_HOST"  # the host label the launcher knows the host by
STORE_PREFIX = "ddplaunch/healthcheck"
GATE_MIN_BYTES = 1 << 20  # smaller messages measure latency, not bandwidth
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def load_sibling(name: str) -> ModuleType:
    """The module ``name``.py beside this file, as ``ddplaunch_hostside_<name>`` (once)."""
    full = f"ddplaunch_hostside_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules[full]


_collectives = load_sibling("collectives")
_pairs = load_sibling("pairs")
COLLECTIVES = _collectives.COLLECTIVES


class CheckFailed(Exception):
    """A collective step raised on this rank.

    Attributes:
        check: the step that failed ("barrier", "collectives", ...).
        culprits: ranks known to be at fault (from monitored_barrier), else empty.
    """

    def __init__(self, check: str, message: str, culprits: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.check = check
        self.culprits = list(culprits)


class _ArgumentError(Exception):
    """argparse wanted to exit; ``run`` turns it into a return value."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:  # no SystemExit from inside a library call
        if message:
            sys.stderr.write(message)
        raise _ArgumentError(status)


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


def format_size(nbytes: int) -> str:
    """``8388608`` -> ``8 MiB``; sizes that are no whole KiB/MiB/GiB stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} bytes"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the options; errors name the cluster.yaml keys they come from.

    Raises:
        _ArgumentError: bad options (usage printed) or --help.
    """
    parser = _Parser(prog="healthcheck.py", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--sizes", default="4K,8M", help="comma list of byte sizes (K/M/G)")
    parser.add_argument("--iters", type=int, default=3, help="timed collectives per size (+1 warm-up)")
    parser.add_argument("--timeout", type=float, default=60.0, help="init and collective timeout, s")
    parser.add_argument("--min-busbw-gbps", type=float, default=None, help="fail below this busbw")
    parser.add_argument("--collectives", default="all_reduce",
                        help="comma list of " + ", ".join(COLLECTIVES) + " (checked and timed)")
    parser.add_argument("--pairwise", action="store_true",
                        help="also time disjoint host pairs (one rank per host) and name slow hosts")
    parser.add_argument("--pair-size", default="16M", help="all_reduce size of a pair probe")
    parser.add_argument("--pair-parallelism", type=int, default=0,
                        help="pairs measured at the same time (0: all)")
    parser.add_argument("--min-busbw-fraction", type=float, default=0.5,
                        help="a pair below this fraction of the healthy median is slow")
    parser.add_argument("--json", default=None, help="rank 0 writes the JSON result here")
    args = parser.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.pair_size = parse_size(args.pair_size)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    unknown = [c for c in args.collectives if c not in COLLECTIVES]
    if unknown or not args.collectives:
        parser.error(f"healthcheck.collectives: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(COLLECTIVES)}")
    args.collectives = list(dict.fromkeys(args.collectives))
    if not args.sizes or args.iters < 1:
        parser.error("healthcheck.sizes needs at least one size and healthcheck.iterations >= 1")
    if args.min_busbw_gbps is not None and max(args.sizes) < GATE_MIN_BYTES:
        parser.error("healthcheck.min_busbw_gbps needs a size of at least 1M in healthcheck.sizes")
    if args.pair_parallelism < 0 or not 0 < args.min_busbw_fraction <= 1:
        parser.error("healthcheck.pair_parallelism must be >= 0 and "
                     "healthcheck.min_busbw_fraction in (0, 1]")
    return args


def host_label() -> str:
    """The name the launcher knows this host by (DDPLAUNCH_HOST), else the hostname."""
    return os.environ.get(HOST_ENV, "").strip() or socket.gethostname()


def local_facts(backend: str, device: torch.device) -> dict[str, Any]:
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
            "host": socket.gethostname(), "label": host_label(), "ip": ip, "torch": torch.__version__,
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
                                     f"{timeout.total_seconds():g}s (healthcheck.timeout)", culprits) from exc


# ---------------------------------------------------------------- pair gate

def host_leaders(facts: list[dict[str, Any]]) -> dict[str, int]:
    """Each host's first rank (LOCAL_RANK 0), by the host's label: the rank that speaks for it."""
    leaders: dict[str, int] = {}
    for f in facts:
        if f["local_rank"] == 0:
            leaders.setdefault(f["label"], f["rank"])
    return leaders


def pair_gate(args: argparse.Namespace, device: torch.device, facts: list[dict[str, Any]]) -> dict[str, Any]:
    """Disjoint host pairs, then suspects re-paired with known-good hosts (pairs.py).

    One rank per host (LOCAL_RANK 0). Every rank takes part in creating every subgroup and
    returns the same verdict, in the shape of ``localize.Localization.to_dict()``.
    """
    leaders = host_leaders(facts)
    slow = os.environ.get(SLOW_ENV, "").strip() == host_label()

    def measure(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        waves = _pairs.schedule(pairs, args.pair_parallelism)
        return _collectives.run_round(pairs, leaders, waves, args.pair_size, device, slow)

    loc = dict(_pairs.judge(list(leaders), measure, args.min_busbw_fraction), singles=[])
    verdict = [loc]
    dist.broadcast_object_list(verdict, src=0)  # rank 0's verdict is everyone's
    return verdict[0]


# ---------------------------------------------------------------- report

def render_table(result: dict[str, Any]) -> str:
    """Formats the facts, bandwidth and pair tables for humans (rank 0 prints it once)."""
    lines = [f"{'rank':>4}  {'host':<20} {'ip':<15} {'device':<28} torch"]
    for f in result["ranks"]:
        lines.append(f"{f['rank']:>4}  {f['host']:<20} {f['ip']:<15} {f['device']:<28} {f['torch']}")
    if result["bandwidth"] or result.get("unsupported"):
        lines.append(f"{'collective':<15}{'bytes':>12} {'count':>10} {'iters':>5} {'time_us':>10} "
                     f"{'algbw_GBps':>10} {'busbw_GBps':>10}")
        for r in result["bandwidth"]:
            lines.append(f"{r.get('collective', 'all_reduce'):<15}{r['bytes']:>12} {r['count']:>10} "
                         f"{r['iters']:>5} {r['time_us']:>10.1f} "
                         f"{r['algbw_gbps']:>10.3f} {r['busbw_gbps']:>10.3f}")
        for name, why in (result.get("unsupported") or {}).items():
            lines.append(f"{name:<15}{'unsupported':>12}  by {result['backend']} in torch "
                         f"{torch.__version__}: {why}")
    loc = result.get("pairs")
    if loc and (loc["pairs"] or loc["repairs"]):
        med = loc["median_busbw_gbps"]
        lines.append("host pairs (one rank per host, all_reduce):")
        for kind, probes in (("pair", loc["pairs"]), ("re-pair", loc["repairs"])):
            for p in probes:
                bw = "failed" if p["busbw_gbps"] is None else f"{p['busbw_gbps']:.3f} GB/s"
                ratio = f" ({p['busbw_gbps'] / med:.2f} x median)" if med and p["busbw_gbps"] is not None else ""
                lines.append(f"  {kind:<7} {' + '.join(p['hosts']):<28} {bw}{ratio}"
                             f"{'' if p['ok'] else '  <- slow/failed'}")
        lines.append("  bad hosts: " + (", ".join(loc["bad_hosts"]) if loc["bad_hosts"] else "none"))
    elif loc is not None:
        lines.append("host pairs: fewer than 2 hosts, nothing to pair")
    return "\n".join(lines)


def describe(failure: dict[str, Any]) -> str:
    """Formats one failure as ``rank R (host H): message`` (no prefix when no rank is to blame)."""
    where = "" if failure["rank"] is None else f"rank {failure['rank']} (host {failure['host']}): "
    return where + failure["message"]


def write_json_atomically(path: str, result: dict[str, Any]) -> None:
    """Writes via a temp file in the same directory and os.replace, so readers never see half."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".healthcheck.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(result, out, indent=2, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def report(result: dict[str, Any], json_path: str | None) -> None:
    """Rank 0 only: table, verdict line, JSON line and the optional JSON file."""
    emit(render_table(result))
    if result["ok"]:
        emit(f"HEALTHCHECK OK world={result['world_size']} backend={result['backend']}")
    else:
        emit("HEALTHCHECK FAIL: " + "; ".join(describe(f) for f in result["failures"]))
    emit("DDPLAUNCH_HEALTHCHECK_JSON " + json.dumps(result, separators=(",", ":"), sort_keys=True))
    if json_path:
        write_json_atomically(json_path, result)


def run_checks(args: argparse.Namespace, backend: str, device: torch.device, result: dict[str, Any]) -> None:
    """Runs every step, filling ``result``; every rank takes the same collectives."""
    timeout = timedelta(seconds=args.timeout)
    try:
        facts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(facts, local_facts(backend, device))
    except Exception as exc:
        raise CheckFailed("facts", f"all_gather_object of rank facts failed: {exc}") from exc
    result["ranks"] = facts
    if os.environ.get(STALL_ENV, "").strip() == str(dist.get_rank()):
        time.sleep(2 * args.timeout)  # test hook: arrive after the barrier gave up
    barrier(backend, timeout)
    _check_results(args, device, facts, result)
    if result["failures"]:  # every rank saw the same gathered list, so all skip together
        return
    _check_bandwidth(args, device, result)
    if args.pairwise:
        try:
            result["pairs"] = pair_gate(args, device, facts)
        except Exception as exc:
            raise CheckFailed("pair", f"pair probes raised: {exc}") from exc
        leaders = host_leaders(facts)
        for host in result["pairs"]["bad_hosts"]:
            result["failures"].append({"rank": leaders[host], "host": host, "check": "pair", "message":
                                       f"host {host} is bad: {result['pairs']['reasons'][host]}"})


def _check_results(args: argparse.Namespace, device: torch.device, facts: list[dict[str, Any]],
                   result: dict[str, Any]) -> None:
    """Every collective's exact result on every rank; each wrong one a failure naming its rank."""
    try:
        mine = _collectives.check_collectives(device, args.collectives)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    except Exception as exc:
        raise CheckFailed("collectives", f"correctness collectives raised: {exc}") from exc
    for rank, (failures, unsupported) in enumerate(everyone):
        for name, why in unsupported.items():
            result["unsupported"].setdefault(name, why)
        for check, message in failures:
            result["failures"].append({"rank": rank, "host": facts[rank]["host"],
                                       "check": check, "message": message})


def _check_bandwidth(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    """Every supported collective timed at every size; the gate reads the largest."""
    measured = [c for c in args.collectives if c not in result["unsupported"]]
    try:
        result["bandwidth"] = _collectives.measure_bandwidth(args.sizes, args.iters, device, measured)
    except Exception as exc:
        raise CheckFailed("bandwidth", f"bandwidth sweep raised: {exc}") from exc
    gate = args.min_busbw_gbps
    for collective in measured:
        rows = [row for row in result["bandwidth"] if row["collective"] == collective]
        largest = max(rows, key=lambda row: row["bytes"])
        if gate is not None and largest["busbw_gbps"] < gate:
            result["failures"].append({"rank": None, "host": None, "check": "bandwidth", "message":
                                       f"{collective} busbw {largest['busbw_gbps']:.3f} GB/s at "
                                       f"{format_size(largest['bytes'])} is below "
                                       f"healthcheck.min_busbw_gbps {gate:g}"})


_KEEP: list[Any] = []


def _init_group(backend: str, timeout: timedelta, rank: int, world: int, device: torch.device) -> None:
    """Our own default group on a key prefix of the launcher's store, bound to this rank's GPU
    on NCCL (``device_id``: collectives and barriers use it, not whatever device is current).

    Under torchrun the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True) and every
    worker is a client; started directly (the torchrun env contract set by hand), rank 0 hosts
    it. The restart count is part of the prefix, so a restarted worker group never reads the
    keys of an earlier attempt.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=not agent_store and rank == 0,
                          timeout=timeout, wait_for_workers=False)
    if not agent_store:
        # Started directly: rank 0's store stays up for the job that follows in this process (as
        # torchrun's agent store would), and the job's own init_process_group() becomes a client
        # of it; tearing it down and binding the port again raced with the other ranks.
        _KEEP.append(store)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    prefix = f"{STORE_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)


def run(argv: list[str]) -> int:
    """Parses ``argv``, runs the health check in this process and returns its exit status.

    Never exits the process: the caller (``entry.py``) goes on to the job's own script, which
    finds no process group left behind. 0 healthy, 1 failed, 2 bad options.
    """
    try:
        args = parse_args(argv)
    except _ArgumentError as exc:
        return exc.status
    started = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    host = socket.gethostname()
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        emit(f"HEALTHCHECK FAIL: rank {rank} (host {host}): dist_backend nccl needs CUDA, "
             "but torch.cuda.is_available() is False; set dist_backend: gloo")
        return 1
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        emit(f"HEALTHCHECK FAIL: rank {rank} (host {host}): a process group already exists in this "
             "process; the health check runs before the job's init_process_group()")
        return 1
    try:
        _init_group(backend, timedelta(seconds=args.timeout), rank, world, device)
    except Exception as exc:
        emit(f"HEALTHCHECK FAIL: rank {rank} (host {host}): init_process_group failed: {exc}")
        return 1
    result = {"ok": False, "world_size": dist.get_world_size(), "backend": backend, "ranks": [],
              "failures": [], "bandwidth": [], "min_busbw_gbps": args.min_busbw_gbps,
              "collectives": args.collectives, "unsupported": {}, "elapsed_s": 0.0}
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
    # Started as its own program (`check`, `healthcheck.launch: separate`): the verdict is printed
    # and written, so leave without the interpreter's teardown of torch (over a second per rank on
    # a loaded host, and Gloo's occasional abort at exit), as entry.py does after a job.
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
