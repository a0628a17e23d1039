"""A DDP loop that prints as Hugging Face's Trainer does: rank 0 draws a tqdm progress bar (redrawn
in place with `\\r`, never ended by a newline until it closes) and writes a dict of metrics every
`--log-every` steps through the bar (`tqdm.write`: the bar is cleared, the line printed, the bar
drawn again); every rank prints one line at its start and its end. What ddplaunch's screen makes
of a real progress bar is tested with it (tests/test_screen_sim.py).

    torchrun --nproc-per-node 2 jobs/tqdm_train.py --steps 200 --log-every 20
"""

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    args = ap.parse_args()
    timeout = timedelta(seconds=float(os.environ.get("DDPLAUNCH_DIST_TIMEOUT", "300")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print(f"rank {rank}: training {args.steps} steps", flush=True)
    bar = tqdm(total=args.steps, disable=rank != 0, mininterval=0.05)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
        bar.update(1)
        if rank == 0 and step % args.log_every == 0:
            bar.write(str({"loss": round(loss.item(), 4), "step": step}))
    bar.close()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
