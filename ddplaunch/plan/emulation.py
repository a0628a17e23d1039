"""`up --emulate`: emulated ranks in place of torchrun and the job, as the command line asks for
them (`Emulation`, checked here) and as the emulator's arguments (hostside/emulator.py). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddplaunch.errors import PlanError

#: An injection of `up --emulate`: RANK:FACTOR@STEP, RANK@STEP, RANK:CODE@STEP.
INJECTIONS = {"slow": re.compile(r"\d+:\d+(\.\d+)?@\d+"), "freeze": re.compile(r"\d+@\d+"),
              "exit": re.compile(r"\d+:\d+@\d+")}


@dataclass(frozen=True)
class Emulation:
    """`up --emulate N`: N emulated ranks per host (hostside/emulator.py) in place of torchrun and
    the job — the real host-side path (agent, heartbeats, the entry's reports), no torch — each
    stepping every `step_s` seconds, rank 0 saving a "checkpoint" every `ckpt_every` steps, with
    injections (`slow`: RANK:FACTOR@STEP, `freeze`: RANK@STEP, `exit`: RANK:CODE@STEP)."""

    ranks_per_host: int
    step_s: float = 1.0
    steps: int = 0
    ckpt_every: int = 50
    slow: tuple[str, ...] = ()
    freeze: tuple[str, ...] = ()
    exit: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.ranks_per_host < 1 or self.step_s <= 0 or self.steps < 0 or self.ckpt_every < 0:
            raise PlanError("--emulate wants a positive number of ranks per host, --emulate-step-s > 0, "
                            "--emulate-steps and --emulate-ckpt-every >= 0")
        for kind, pattern in INJECTIONS.items():
            for item in getattr(self, kind):
                if not pattern.fullmatch(item):
                    form = {"slow": "RANK:FACTOR@STEP", "freeze": "RANK@STEP", "exit": "RANK:CODE@STEP"}[kind]
                    raise PlanError(f"--emulate-{kind} {item!r}: write it {form} (e.g. "
                                    f"{ {'slow': '3:2.5@100', 'freeze': '3@100', 'exit': '3:1@100'}[kind]})")

    def args(self, nnodes: int) -> list[str]:
        """The emulator's arguments for `nnodes` nodes (PlanError: an injection names no rank of them)."""
        world = self.ranks_per_host * nnodes
        for kind in INJECTIONS:
            for item in getattr(self, kind):
                if int(item.split(":")[0].split("@")[0]) >= world:
                    raise PlanError(f"--emulate-{kind} {item!r}: the run has ranks 0-{world - 1} "
                                    f"({nnodes} host{'s' if nnodes != 1 else ''} x {self.ranks_per_host})")
        out = ["--ranks", str(self.ranks_per_host), "--nnodes", str(nnodes), "--step-s", f"{self.step_s:g}",
               "--steps", str(self.steps), "--ckpt-every", str(self.ckpt_every)]
        for kind in INJECTIONS:
            for item in getattr(self, kind):
                out += [f"--{kind}", item]
        return out
