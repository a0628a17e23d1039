"""The classic DDP bug on purpose: ranks that disagree about which collective comes next.

``--mode hang``: rank 0 calls all_reduce while the others wait in barrier, so nobody
completes (until DDPLAUNCH_DIST_TIMEOUT, default 1800 s). ``--mode error``: rank 0
all_reduces a tensor of another shape and dtype, which the backend (or
TORCH_DISTRIBUTED_DEBUG=DETAIL's consistency check) reports as an error.
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """Writes one whole flushed line; local ranks share a stdout pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["hang", "error"], default="hang")
    parser.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    args = parser.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # A long default so the hang is a real hang, as users meet it.
    timeout = timedelta(seconds=float(os.environ.get("DDPLAUNCH_DIST_TIMEOUT", "1800")))
    dist.init_process_group(backend, timeout=timeout)
    rank = dist.get_rank()
    say(f"rank={rank} host={socket.gethostname()} mode={args.mode}: entering the mismatched collective")

    if args.mode == "hang":
        if rank == 0:
            dist.all_reduce(torch.ones(4, device=device))  # BUG (on purpose): only rank 0 all_reduces
        else:
            dist.barrier()  # BUG (on purpose): the other ranks wait in a different collective
    else:
        if rank == 0:
            wrong = torch.ones(8, dtype=torch.float64, device=device)
            dist.all_reduce(wrong)  # BUG (on purpose): shape (8,) float64 on rank 0 ...
        else:
            right = torch.ones(4, dtype=torch.float32, device=device)
            dist.all_reduce(right)  # ... vs shape (4,) float32 everywhere else

    say(f"rank={rank} passed the mismatched collective (this should not happen)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
