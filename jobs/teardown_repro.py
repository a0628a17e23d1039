"""An ordinary DDP script, written like the public tutorials, that sometimes aborts at exit.

init_process_group, a small DDP model, a few SGD steps, destroy_process_group, return: no
os._exit, nothing unusual. Under bare torchrun with torch 2.13 and Gloo (3 ranks on one host),
a measurable fraction of runs lose a rank AFTER the script has finished: "terminate called
without an active exception" and SIGABRT (exit -6) during interpreter finalization, and
torchrun reports the whole run failed. ``bench/teardown.py`` counts how often; through
``ddplaunch/hostside/entry.py`` (os._exit once the script has returned) it does not happen.

What makes it frequent here: the DDP model is still alive when destroy_process_group() runs
(the tutorials' ``cleanup()`` at the end of the training function), so the Gloo group and its
threads live on into interpreter teardown; all ranks reach that teardown at about the same
moment (a small model, no uneven work at the end), and peers closing their connections wake
Gloo's threads while the interpreter is being torn down.
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
