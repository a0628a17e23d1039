"""Emulated ranks: what a node runs in place of torchrun and the job with `up --emulate N`.

No torch is imported and nothing trains, but everything ddplaunch reads of a run is the real
path: N rank processes per node (each its own pid, RANK and LOCAL_RANK in its environment, as
torchrun starts them) say their start and exit (payloads.py), step every ``--step-s`` seconds,
time each step with the real step timing (steptiming.py) sent to the node's agent, count it with
the real progress hooks (entry.py's ``ProgressHooks``: rank 0 says its optimizer steps, saves a
"checkpoint" every ``--ckpt-every`` steps and holds after one when asked), print one line each at
start and rank 0 one per step, behind torchrun's ``[host:rank]`` prefix. Steps are synchronous as
in DDP: every rank knows the injections, so a slowed rank computes longer and the others wait for
it (their step is as long as the slowest's), and in step across hosts: once its ranks are ready,
a node meets the others (node 0 listens on MASTER_ADDR:MASTER_PORT until every node connected, as
torchrun's rendezvous) and they agree on a start time — no rank steps before every rank of every
node is ready, as at DDP's first collective — then every rank ends step k when the schedule says (the same on every host:
the step time, times the largest slowdown injected at that step). Injections: ``--slow RANK:FACTOR@STEP`` (that rank
computes FACTOR times longer from STEP on), ``--freeze RANK@STEP`` (that rank stops itself,
SIGSTOP, and every rank waits at that step as in a collective), ``--exit RANK:CODE@STEP`` (that
rank's script ends with CODE; the others wait as they would for a dead peer). The node's process
behaves as torchrun: it ends when its ranks do, and when one fails it stops the others and prints
torchrun's failure report. Its node rank is GROUP_RANK in its environment (the plan sets it).
Standard library only; run as ``python emulator.py OPTIONS``.
"""

import argparse
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
#: A "checkpoint": the step rank 0 saved last, in the node's run directory (this file's).
CKPT_FILE = "emulated-ckpt"
#: Seconds the stopped ranks get before they are killed (as torchrun's shutdown timeout).
STOP_GRACE_S = 5.0
#: Seconds a node's ranks have to be ready, and the nodes to meet (torchrun's default rendezvous
#: timeout): 1,024 ranks starting on two cores took over a minute; a launch that fails to start is
#: the hang rule's to stop sooner (job.hang_timeout).
RDZV_TIMEOUT_S = 900.0
#: The descriptor a rank writes a byte to once it is ready to step (the node's pipe).
READY_ENV = "DDPLAUNCH_EMULATE_READY_FD"


def _entry() -> Any:
    """The worker entry beside this file (its `load_sibling` loads the others as the ranks' do)."""
    sys.path.insert(0, HERE)
    sys.dont_write_bytecode = True  # no __pycache__ left in the run dir
    import entry  # type: ignore[import-not-found]
    return entry


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="emulator.py")
    p.add_argument("--ranks", type=int, required=True, help="ranks per node")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=0, help="steps to take (0: until stopped)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR@STEP")
    p.add_argument("--freeze", action="append", default=[], metavar="RANK@STEP")
    p.add_argument("--exit", action="append", default=[], metavar="RANK:CODE@STEP")
    p.add_argument("--as-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def injections(args: argparse.Namespace) -> tuple[dict[int, tuple[float, int]], dict[int, int], dict[int, tuple[int, int]]]:
    """(rank -> (factor, from step), rank -> freeze step, rank -> (exit code, step))."""
    slow, freeze, leave = {}, {}, {}
    for item in args.slow:
        rank, rest = item.split(":")
        factor, step = rest.split("@")
        slow[int(rank)] = (float(factor), int(step))
    for item in args.freeze:
        rank, step = item.split("@")
        freeze[int(rank)] = int(step)
    for item in args.exit:
        rank, rest = item.split(":")
        code, step = rest.split("@")
        leave[int(rank)] = (int(code), int(step))
    return slow, freeze, leave


class _Prefixed:
    """stdout with torchrun's `[host:rank] ` before every line (whole lines, one write each)."""

    def __init__(self, prefix: str):
        self.prefix, self.pending = prefix, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        if lines:
            os.write(1, "".join(f"{self.prefix}{line}\n" for line in lines).encode())
        return len(text)

    def flush(self) -> None:
        pass


def rank_main(args: argparse.Namespace) -> None:
    """One emulated rank: start, step, report, as the injections say."""
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    host = os.environ.get("DDPLAUNCH_HOST", "localhost")
    sys.stdout = _Prefixed(os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "").replace("${rank}", str(rank)))
    entry = _entry()
    payloads = entry.load_sibling("payloads")
    entry.say_start()
    progress = entry.ProgressHooks()
    progress.timing = entry.load_sibling("steptiming").StepTiming()
    slow, freeze, leave = injections(args)
    step = resumed(progress) if os.environ.get("DDPLAUNCH_RECOVERY") else 0
    print(f"emulated rank {rank} of {world} on {host} (local rank {local}, pid {os.getpid()}), from step {step}")
    rng = random.Random(rank)
    optimizer = object()  # what the progress hooks count steps of
    save = progress.saving("torch.save", lambda obj, path: _write_ckpt(path, obj))
    end = _start_time()  # when every rank of every node is ready, as at DDP's first collective
    while args.steps == 0 or step < args.steps:
        step += 1
        if step in freeze.values():
            if freeze.get(rank) == step:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen: stopped, as a hung device leaves it
            while True:  # every rank waits at this step, as in a collective with a frozen peer
                time.sleep(3600)
        code_at = leave.get(rank)
        if code_at is not None and code_at[1] == step:
            progress.flush()
            payloads.say(payloads.RankExit(rank, code_at[0] & 0xFF))
            os._exit(code_at[0])
        if any(s == step for _, s in leave.values()):
            while True:  # a peer's script ended: this rank waits in the next collective
                time.sleep(3600)
        factors = [f for r, (f, since) in slow.items() if step >= since]
        mine = slow[rank][0] if rank in slow and step >= slow[rank][1] else 1.0
        step_s = args.step_s * max([1.0, *factors])  # the schedule's: every rank's step ends together
        compute = args.step_s * mine * (1 + 0.02 * rng.random())
        end += step_s
        progress.before_step(optimizer)  # holds here after a checkpoint, when asked (HOLD_FILE)
        time.sleep(max(0.0, end - time.time()))
        progress.timing._waited_for(max(0.0, step_s - compute))  # the others wait for the slowest
        progress.stepped(optimizer)
        if rank == 0:
            print(f"step={step} emulated loss={1.0 / step:.4f}")
            if args.ckpt_every and step % args.ckpt_every == 0:
                save(step, os.path.join(HERE, CKPT_FILE))
    progress.flush()
    progress.timing.flush()
    payloads.say(payloads.RankExit(rank, 0))
    os._exit(0)


def _start_time() -> float:
    """Say this rank is ready (a byte on the node's pipe), then wait for the start time the nodes
    agreed on (a line on stdin, once every rank of every node was ready)."""
    fd = os.environ.get(READY_ENV)
    if fd is None:
        return time.time()
    try:
        os.write(int(fd), b"r")
        os.close(int(fd))
    except OSError:  # the node stopped waiting (it is stopping): end as at a failed rendezvous
        sys.exit(1)
    line = sys.stdin.readline()
    try:
        return float(line)
    except ValueError:  # the node did not say: a rank of it, or the node, ended before the start
        sys.exit(1)


def resumed(progress: Any) -> int:
    """The step of the last "checkpoint", loaded through the progress hooks (rank 0 says it)."""
    load = progress.loaded("torch.load", _read_ckpt)
    return load(os.path.join(HERE, CKPT_FILE))


def _write_ckpt(path: str, step: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, path)


def _read_ckpt(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _ranks_ready(fd: int, procs: dict[int, "subprocess.Popen[bytes]"], stopping: list[float]) -> bool:
    """Wait until every rank of the node said it is ready (False: one ended first, or the node is
    stopping, or RDZV_TIMEOUT_S passed)."""
    deadline, ready = time.monotonic() + RDZV_TIMEOUT_S, 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    try:
        while ready < len(procs):
            if stopping or time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                return False
            if poller.poll(500):
                got = os.read(fd, 64)
                if not got:
                    return False
                ready += len(got)
        return True
    finally:
        os.close(fd)


def rendezvous(nnodes: int, node_rank: int, timeout: float = RDZV_TIMEOUT_S) -> float:
    """The nodes meet as torchrun's do: node 0 listens on MASTER_ADDR:MASTER_PORT until every other
    node connected, then tells them all when to start (a second from then). The start time."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    deadline = time.monotonic() + timeout
    if nnodes < 2:
        return time.time()
    if node_rank == 0:
        with socket.create_server(("", port), reuse_port=False, backlog=nnodes) as server:
            peers: list[socket.socket] = []
            while len(peers) < nnodes - 1:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    peers.append(server.accept()[0])
                except socket.timeout:
                    sys.exit(f"emulator: {len(peers) + 1} of {nnodes} nodes met within {timeout:.0f}s")
            start = time.time() + 1.0
            for peer in peers:
                with peer:
                    peer.sendall(f"{start}\n".encode())
            return start
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5) as conn:
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                return float(conn.makefile().readline())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                sys.exit(f"emulator: node 0 ({addr}:{port}) not met within {timeout:.0f}s")
            time.sleep(0.5)


def _spawn_ranks(args: argparse.Namespace, argv: list[str], node_rank: int, ready_w: int
                 ) -> dict[int, "subprocess.Popen[bytes]"]:
    """The node's ranks, as torchrun starts them (their coordinates in the environment); each says
    it is ready on `ready_w` and reads the start time on its stdin."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for local in range(args.ranks):
        rank = node_rank * args.ranks + local
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(args.ranks * args.nnodes),
                   LOCAL_WORLD_SIZE=str(args.ranks), GROUP_RANK=str(node_rank),
                   TORCHELASTIC_RUN_ID=os.environ.get("DDPLAUNCH_RUN_ID", "emulated"),
                   TORCHELASTIC_RESTART_COUNT="0", **{READY_ENV: str(ready_w)})
        procs[rank] = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), *argv, "--as-rank",
                                        str(rank)], env=env, stdin=subprocess.PIPE, pass_fds=(ready_w,))
    return procs


def node_main(args: argparse.Namespace, argv: list[str]) -> int:
    """The node's process, as torchrun: meet the other nodes, start the ranks, end with them; one
    that fails stops the others (SIGTERM) and its failure is reported as torchrun reports it."""
    node_rank = int(os.environ.get("GROUP_RANK", "0"))
    ready_r, ready_w = os.pipe()
    procs = _spawn_ranks(args, argv, node_rank, ready_w)
    os.close(ready_w)
    stopping: list[float] = []

    def stop(signum: int, frame: Any) -> None:
        stopping.append(time.monotonic())
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    # once its ranks are ready, the node meets the others and they start together; a node whose
    # ranks are not all ready says nothing: its ranks' stdin closes and they end (failed)
    start = b""
    if _ranks_ready(ready_r, procs, stopping):
        start = repr(rendezvous(args.nnodes, node_rank)).encode() + b"\n"
    for p in procs.values():
        try:
            assert p.stdin is not None
            p.stdin.write(start)
            p.stdin.close()
        except OSError:
            pass
    failed: Optional[tuple[int, int]] = None
    while any(p.poll() is None for p in procs.values()):
        for rank, p in procs.items():
            code = p.poll()
            if code not in (None, 0) and failed is None and not stopping:
                failed = (rank, code)
                stop(signal.SIGTERM, None)
        if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:  # a frozen rank never acts on SIGTERM
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    if failed is not None:
        rank, code = failed
        rule = "=" * 60
        print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"  # torchrun's report, as it prints it
              f"{rule}\nemulator.py FAILED\n{'-' * 60}\nFailures:\n  <NO_OTHER_FAILURES>\n{'-' * 60}\n"
              f"Root Cause (first observed failure):\n[0]:\n"
              f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S')}\n"
              f"  host      : {os.environ.get('DDPLAUNCH_HOST', 'localhost')}\n"
              f"  rank      : {rank} (local_rank: {rank - node_rank * args.ranks})\n"
              f"  exitcode  : {code} (pid: {procs[rank].pid})\n"
              f"  error_file: <N/A>\n  traceback : To enable traceback see: "
              f"https://pytorch.org/docs/stable/elastic/errors.html\n{rule}", flush=True)
        return 1
    return 143 if stopping else 0


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.as_rank is not None:
        rank_main(args)
    sys.exit(node_main(args, argv))


if __name__ == "__main__":
    main(sys.argv[1:])
