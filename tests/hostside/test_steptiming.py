"""hostside/steptiming.py under torchrun, with no change to the job: a DDP job, an FSDP2 job and
a job of plain all_reduce calls, each with one rank that computes longer per step. Every rank's
step lasts as long as the slow one's; the timing each rank sends says that its peer waited at the
collectives while it did not, and the launcher's straggler watch names it from those lines alone."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from ddplaunch.diagnose.stragglers import IN_A_ROW, WARMUP, WINDOW, StragglerJudge
from tests.events_util import Agents
from ddplaunch.hostside.payloads import Timing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchrun_util import ROOT, run_torchrun  # noqa: E402

ENTRY = ROOT / "ddplaunch" / "hostside" / "entry.py"
TIMING_RE = re.compile(r"^DDPLAUNCH_TIMING_JSON (\{.*\})$", re.M)
#: Enough steps for the watch to judge: its warm-up, then IN_A_ROW windows.
STEPS = WARMUP + WINDOW * (IN_A_ROW + 1)
#: The slow rank's extra compute per step (the other's is a few ms). Its own wait is noise — the
#: peer descheduled on 2 busy cores: 17 ms once, in a CI run beside other load — so the extra is
#: well above it: the test judges by half of it.
SLOW_S = 0.06

JOB = """\
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
kind = {kind!r}
if kind == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif kind == "fsdp2":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0]); fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({steps}):
    opt.zero_grad()
    loss = model(torch.randn(16, 64)).square().mean()
    if rank == 1:
        time.sleep({slow})  # this rank computes longer
    loss.backward()
    if kind == "allreduce":
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "allreduce"])
def test_the_rank_that_computes_longer_waits_least_and_is_named(tmp_path, kind):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB.format(kind=kind, steps=STEPS, slow=SLOW_S)))
    run = run_torchrun(ENTRY, "--no-healthcheck", "--", job, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:]
    steps: dict[int, dict[int, tuple[float, float]]] = {0: {}, 1: {}}
    # a few seconds of steps: how long a slowdown must last before it is named is the judge's own
    # (tests/diagnose/test_stragglers.py); here, that the lines alone name the rank
    watch, named = Agents(StragglerJudge(["host0", "host1"], min_slow_s=0.0)), []
    for payload in map(json.loads, TIMING_RE.findall(run.stdout)):
        steps[payload["rank"]].update({s: (t, w) for s, t, w in payload["steps"]})
        found = watch.feed(f"host{payload['rank']}", Timing(payload["rank"], payload["steps"]))
        named += [found] if found is not None else []
    # every step of every rank timed (the first has no start: it is not)
    assert sorted(steps[0]) == sorted(steps[1]) == list(range(2, STEPS + 1)), steps
    late = range(WARMUP, STEPS + 1)
    wait = {r: sorted(steps[r][s][1] for s in late) for r in (0, 1)}
    median = {r: wait[r][len(wait[r]) // 2] for r in (0, 1)}
    # the fast rank waits for the slow one's extra compute at the collectives; the slow one hardly waits
    assert median[0] > SLOW_S / 2 > median[1], median
    assert [(s.host, s.ranks) for s in named] == [("host1", [1])], named


class _Event:
    """A CUDA event as steptiming reads it: done or not, and its time on the GPU (ms)."""

    def __init__(self, at_ms: float, done: bool = True):
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, later: "_Event") -> float:
        return later.at_ms - self.at_ms


def test_on_cuda_a_steps_wait_is_the_gpus_and_is_sent_once_its_events_completed(monkeypatch):
    """NCCL's collectives return to the host at once: the wait is read from CUDA events (ready ->
    the last collective done), and a step whose events the GPU has not reached yet waits, in order."""
    from ddplaunch.hostside import steptiming

    timing = steptiming.StepTiming()
    late = _Event(40.0, done=False)
    timing._pending = [[1, 0.1, 0.002, (_Event(0.0), [_Event(25.0), _Event(30.0)])],
                       [2, 0.1, 0.0, (_Event(100.0), [late])], [3, 0.1, 0.0]]
    sent: list[str] = []
    monkeypatch.setattr(steptiming.os, "write", lambda fd, data: sent.append(data.decode()) or len(data))
    timing.flush()
    late.done, late.at_ms = True, 190.0
    timing.flush()
    steps = [json.loads(line.split(" ", 1)[1])["steps"] for line in sent]
    assert steps == [[[1, 0.1, 0.032]], [[2, 0.1, 0.09], [3, 0.1, 0.0]]]
