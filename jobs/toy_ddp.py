"""Two-process teaching example: one all_reduce is the whole of data parallelism.

Each rank holds weight w=1.0 and computes a local gradient (2.0 on even ranks, 6.0 on
odd ones); all_reduce(SUM) / world size gives every rank the mean 4.0, and one SGD step
with lr 0.1 leaves every replica at 0.6. A plain torchrun script: needs only torch.
"""

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

LR = 0.1


def say(line: str) -> None:
    """Writes one whole flushed line; local ranks share a stdout pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    backend = os.environ.get("DDPLAUNCH_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=float(os.environ.get("DDPLAUNCH_DIST_TIMEOUT", "300")))
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()

    weight = torch.tensor([1.0], device=device)
    grad = torch.tensor([2.0 if rank % 2 == 0 else 6.0], device=device)
    say(f"rank={rank} host={socket.gethostname()} world_size={world} local_grad={grad.item():.1f}")
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum of all gradients
    grad /= world
    weight -= LR * grad
    say(f"rank={rank} mean_grad={grad.item():.1f} updated_weight={weight.item():.1f}")

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
