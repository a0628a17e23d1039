"""An independent all_reduce timing loop (written apart from ddplaunch/healthcheck.py) to check
the health check's busbw against: plain torch.distributed, one timed loop per size.
Usage (under torchrun): allreduce_loop.py --sizes 16777216,67108864 --iters 10
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=str(64 << 20))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for size in map(int, args.sizes.split(",")):
        x = torch.ones(size // 4)
        for _ in range(2):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        took = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        busbw = size / took.item() * 2 * (world - 1) / world / 1e9
        if dist.get_rank() == 0:
            sys.stdout.write(f"LOOP bytes={size} busbw_gbps={busbw:.4f}\n")
            sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
