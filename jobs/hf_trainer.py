"""Hugging Face's `Trainer` as users run it: a tiny GPT-2 built from a config (nothing downloaded)
trained on random tokens, on CPU with Gloo, under torchrun. What reaches the screen is the
Trainer's own: its tqdm bar on rank 0, a dict of metrics every `--logging-steps` through the bar,
its warnings; ddplaunch's screen of a real Trainer is tested with it (tests/test_screen_sim.py).

With `--output-dir` it saves a checkpoint every `--save-steps` and, launched again, resumes from
the newest one (the Trainer's own `resume_from_checkpoint`), saying its path:

    torchrun --nproc-per-node 2 jobs/hf_trainer.py --max-steps 600 --logging-steps 50

Needs `transformers` and `accelerate` (the test extra: `pip install -e '.[test]'`).
"""

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

VOCAB, SEQ = 64, 16


class RandomTokens(torch.utils.data.Dataset):
    """`n` sequences of random tokens, the same on every rank (seeded): a language model's batch."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--logging-steps", type=int, default=50)
    ap.add_argument("--output-dir", default=None, help="checkpoints here, resumed from the newest")
    ap.add_argument("--save-steps", type=int, default=100)
    args = ap.parse_args()
    checkpoints = args.output_dir is not None
    output_dir = args.output_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_trainer_unsaved")
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=args.logging_steps, report_to=[], use_cpu=True,
        ddp_backend="gloo", dataloader_num_workers=0, seed=0, disable_tqdm=False,
        save_strategy="steps" if checkpoints else "no", save_steps=args.save_steps,
        save_only_model=False)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(4096))
    resume = get_last_checkpoint(output_dir) if checkpoints and os.path.isdir(output_dir) else None
    if resume and trainer.is_world_process_zero():
        print(f"resuming from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} steps, loss {trainer.state.log_history[-1].get('train_loss')}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
