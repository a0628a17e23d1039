"""Goodput at 1,000 nodes x 8 GPUs, on paper: disk checkpoints against the memory tier.

Pure arithmetic, no cluster: prints the model's inputs and its table (docs/scaling.md, "Checkpoints
at 1,000 nodes: goodput on paper", explains each input and where it was measured).

  MTTF      Meta's measured whole-job MTTF (7.9 h at 1,024 GPUs, 1.8 h at 16,384), interpolated as a
            power law in the GPU count through both points (MTTF ~ N^-0.53); beside it the
            pessimistic reading, failures independent per GPU from the 1,024-GPU figure (MTTF ~ 1/N)
  interval  Young/Daly: sqrt(2 x stall x MTTF), the optimum for a given save stall
  goodput   1 - stall/interval - (interval/2 + recovery + load)/MTTF: each save stalls every rank
            `stall` once an interval; each failure redoes half an interval on average, then costs
            the relaunch (`recovery`) and reading the checkpoint back (`load`)

    .venv/bin/python bench/goodput_model.py [--gpus 8000] [--mem-stall 0.133] [--recovery 60]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

#: Meta's whole-job MTTF (hours) at two GPU counts (Kokolis et al., "Revisiting Reliability in
#: Large-Scale Machine Learning Research Clusters", 2024), as issue #52 quotes them.
MTTF_POINTS_H = ((1024, 7.9), (16384, 1.8))


def mttf_power_h(gpus: int) -> float:
    """Whole-job MTTF at `gpus` GPUs: the power law through Meta's two measured points."""
    (n1, m1), (n2, m2) = MTTF_POINTS_H
    slope = math.log(m2 / m1) / math.log(n2 / n1)
    return float(m1 * (gpus / n1) ** slope)


def mttf_per_gpu_h(gpus: int) -> float:
    """Whole-job MTTF at `gpus` GPUs if each GPU failed independently at the 1,024-GPU figure's rate."""
    n1, m1 = MTTF_POINTS_H[0]
    return m1 * n1 / gpus


@dataclass(frozen=True)
class Case:
    """One way of checkpointing: the save's stall on every rank, reading it back after a failure."""

    name: str
    stall_s: float
    load_s: float


@dataclass(frozen=True)
class Outcome:
    interval_s: float
    saving: float  # fraction of wall time stalled in saves
    redone: float  # fraction redone after failures (half an interval each)
    recovery: float  # fraction in relaunches and checkpoint reads

    @property
    def goodput(self) -> float:
        return 1.0 - self.saving - self.redone - self.recovery


def outcome(case: Case, mttf_s: float, recovery_s: float, interval_s: float | None = None) -> Outcome:
    """First-order goodput of `case` at the Young/Daly interval (or `interval_s`)."""
    interval = interval_s if interval_s is not None else math.sqrt(2 * case.stall_s * mttf_s)
    return Outcome(interval, case.stall_s / interval, interval / 2 / mttf_s, (recovery_s + case.load_s) / mttf_s)


def break_even_s(case: Case, mttf_s: float, goodput: float) -> float:
    """The longest relaunch (the checkpoint's load aside) at which `case` still reaches `goodput`."""
    got = outcome(case, mttf_s, 0.0)
    return (1.0 - goodput - got.saving - got.redone) * mttf_s - case.load_s


def _dur(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def table(gpus: int, cases: list[Case], recoveries: list[float]) -> str:
    out = ["| MTTF at %d GPUs | checkpoints | stall per save | load after a failure | recovery (relaunch) | "
           "interval (Young/Daly) | lost: saves | lost: redone | lost: recovery + load | "
           "`checkpoint` + `redone` | **goodput** |" % gpus, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, mttf_h in ((f"{mttf_power_h(gpus):.2f} h (power law)", mttf_power_h(gpus)),
                          (f"{mttf_per_gpu_h(gpus):.2f} h (per GPU, 1/N)", mttf_per_gpu_h(gpus))):
        for recovery in recoveries:
            for case in cases:
                got = outcome(case, mttf_h * 3600, recovery)
                out.append(f"| {label} | {case.name} | {case.stall_s:g} s | {case.load_s:g} s | {recovery:g} s | "
                           f"{_dur(got.interval_s)} | {100 * got.saving:.2f}% | {100 * got.redone:.2f}% | "
                           f"{100 * got.recovery:.2f}% | {100 * (got.saving + got.redone):.2f}% | "
                           f"**{100 * got.goodput:.1f}%** |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8000, help="1,000 nodes x 8")
    ap.add_argument("--disk-stall", default="60,120",
                    help="seconds a synchronous save to shared storage stalls every rank (the issue: a minute or "
                         "more; DLRover measured 2 min on 1,536 GPUs)")
    ap.add_argument("--mem-stall", default="0.133,1",
                    help="seconds ddplaunch.checkpoint.save blocks (bench/ckpt_tier.py: 256 MB a process, median "
                         "0.133 s; 1 s: a 2 GB shard at the same copy rate)")
    ap.add_argument("--mem-load", type=float, default=1.0,
                    help="seconds to read the checkpoint back from a host's or a buddy's RAM")
    ap.add_argument("--recovery", default="16,60",
                    help="seconds from a failure to the relaunched job's first step, the checkpoint read aside")
    args = ap.parse_args()
    disk = [float(s) for s in args.disk_stall.split(",")]
    # a disk run reads its checkpoint back from shared storage: taken as long as the save
    cases = [Case(f"disk, sync save {s:g} s", s, s) for s in disk] + \
        [Case(f"memory tier, save {s:g} s", s, args.mem_load) for s in map(float, args.mem_stall.split(","))]
    print(f"MTTF at {args.gpus} GPUs: {mttf_power_h(args.gpus):.2f} h (power law through "
          f"{MTTF_POINTS_H[0][1]} h at {MTTF_POINTS_H[0][0]} and {MTTF_POINTS_H[1][1]} h at {MTTF_POINTS_H[1][0]}), "
          f"{mttf_per_gpu_h(args.gpus):.2f} h (per GPU from the {MTTF_POINTS_H[0][0]}-GPU figure)\n")
    print(table(args.gpus, cases, [float(r) for r in args.recovery.split(",")]))
    print()
    for case in cases[len(disk):]:
        for label, mttf_h in (("power law", mttf_power_h(args.gpus)), ("per GPU", mttf_per_gpu_h(args.gpus))):
            most = break_even_s(case, mttf_h * 3600, 0.99)
            print(f"{case.name}, MTTF {mttf_h:.2f} h ({label}): goodput >= 99% "
                  + (f"while recovery <= {most:.0f} s" if most >= 0 else "never (saves and redone alone cost more)"))


if __name__ == "__main__":
    main()
