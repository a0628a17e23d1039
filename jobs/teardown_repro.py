"""An ordinary DDP script, written like the public tutorials, that sometimes aborts at exit.

init_process_group, a small DDP model, a few SGD steps, destroy_process_group, return: no
os._exit, nothing unusual. With torch 2.13 and Gloo a rank sometimes dies AFTER the script has
finished: "terminate called without an active exception", SIGABRT (exit -6) during interpreter
teardown, and torchrun reports the whole run failed. ``bench/teardown.py`` counts how often, bare
torchrun against ``ddplaunch/hostside/entry.py`` (os._exit once the script has returned).

What is known (2026-11-29, 3 ranks, 2 shared cores): the DDP model still holds the Gloo group
when destroy_process_group() runs (the tutorials' ``cleanup()``), so the group and its threads
(gloo_tcp_loop, 2x pt_gloo_runloop) are still running when the interpreter tears down -- they
are alive even after ``del ddp; gc.collect()``. Variants of this script (20 steps, DDP alive at
destroy, or no destroy at all) aborted in 4 of 18 runs while other torch jobs ran on the machine;
this script then aborted in 0 of about 40 bare runs (quiet or loaded machine, staggered exits,
two runs at once), so the trigger is a timing window not yet pinned down. A frequent reproducer
is still open.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(64, 64)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def setup():
    dist.init_process_group(os.environ.get("DDPLAUNCH_BACKEND") or "gloo")


def cleanup():
    dist.destroy_process_group()


def demo_basic(steps: int):
    setup()
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(32, 64))
        labels = torch.randn(32, 8)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    print(f"rank {rank} finished {steps} steps", flush=True)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    demo_basic(parser.parse_args().steps)
