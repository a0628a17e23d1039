"""Lightning's `Trainer` as users run it: a small regression model (a `LightningModule`) trained
with DDP on CPU and Gloo under torchrun, its progress bar and logged loss on rank 0,
`ModelCheckpoint` saving `last.ckpt` (and the newest step's checkpoint) every `--save-every`
steps. Launched again with `--ckpt-path DIR/last.ckpt` (ddplaunch's `job.resume_args`) it resumes
from there, as `Trainer.fit(ckpt_path=...)` does; a missing file is a clear error, not a new run.

Lightning handles SIGTERM itself (it stops after the step in progress), and rank 0 does more than
the others (the bar, the logger, the checkpoint writes): ddplaunch's recovery and straggler judge
are tested with it (tests/run/test_recovery.py).

    torchrun --nproc-per-node 2 jobs/lightning_train.py --max-steps 200 --ckpt-dir /tmp/ckpt

Needs `lightning` (the test extra: `pip install -e '.[test]'`).
"""

import argparse
import os
import sys
import time

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

FEATURES = 32


class Regression(LightningModule):
    def __init__(self, step_sleep: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        if self.step_sleep:
            time.sleep(self.step_sleep)  # the pace of a real step, without its CPU
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def data(samples: int, batch_size: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint's directory (last.ckpt)")
    ap.add_argument("--ckpt-path", default=None, help="resume from this checkpoint (Trainer.fit's ckpt_path)")
    ap.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    args = ap.parse_args()
    if args.ckpt_path and not os.path.isfile(args.ckpt_path):
        print(f"lightning_train.py: --ckpt-path {args.ckpt_path}: no such checkpoint", file=sys.stderr)
        return 2
    seed_everything(0, verbose=False)
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_last=True,
                                         save_top_k=1, monitor="step", mode="max"))
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), num_nodes=nodes,
                      strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.max_steps,
                      callbacks=callbacks, logger=False, enable_checkpointing=bool(args.ckpt_dir),
                      enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(Regression(args.step_sleep), train_dataloaders=data(4096, args.batch_size), ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps, loss {float(trainer.callback_metrics['loss']):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
