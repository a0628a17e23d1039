"""Stragglers named while training runs, on real (simulated) hosts, with no change to the job:
4 hosts x 1 rank train a DDP or an FSDP2 job whose steps spend CPU (`--burn-ms`); once training runs, one
host's processes are limited to a slice of one CPU (`sim fault --slow`, cgroups). Every rank's
step time is the same (DDP waits for the slowest), yet the slowed host is named — host, rank,
slowdown, since which step — from the ranks' own timing (compute share = step time - wait at
the gradient all-reduce), once on screen, in the event log, the record and the summary; the
healthy steps before it name nobody."""

from __future__ import annotations

import copy
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from ddplaunch.record.events import StepWindow, StragglerNamed, read_events
from ddplaunch.record.view import RunView
from ddplaunch.sim.faults import sim_fault
from tests.ssh_util import ROOT, popen_ddplaunch, read_until
from tests.timing import no_hang

pytestmark = [pytest.mark.root, pytest.mark.slow]
#: A hang guard (3x the promised 30 s; the figure itself is bench/stragglers.py's): a slowed
#: host named from the ranks' timing, not never.
NAMED_S = 90.0


#: The jobs, each step spending 40 ms of CPU: DDP (jobs/train.py) and FSDP2 (jobs/fsdp_train.py).
JOBS = {"ddp": {"script": "jobs/train.py",
                "args": ["--epochs", "1", "--samples", "16384", "--batch-size", "8", "--ckpt-every", "0",
                         "--log-every", "10", "--burn-ms", "40", "--seed", "3"]},
        "fsdp2": {"script": "jobs/fsdp_train.py",
                  "args": ["--steps", "2000", "--global-batch", "16", "--samples", "4096", "--ckpt-every", "0",
                           "--log-every", "10", "--burn-ms", "40", "--seed", "3"]}}


def _job(kind: str, ranks: int) -> dict:
    """JOBS[kind] for `ranks` ranks (FSDP2's global batch divided evenly among them: 4 each)."""
    job = copy.deepcopy(JOBS[kind])
    if kind == "fsdp2":
        job["args"][job["args"].index("--global-batch") + 1] = str(4 * ranks)
    return job


def _spec(cluster, tmp_path: Path, kind: str = "ddp") -> Path:
    data = yaml.safe_load(cluster.spec_path.read_text())
    data.update(workdir=str(ROOT), nproc_per_node=1, healthcheck={"sizes": ["64K"], "iterations": 1},
                env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")}, job=_job(kind, len(cluster.hosts)))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# Each job kind is named on each backend once: FSDP2 here and DDP in the SSH eviction below
# (which names the straggler first), DDP on Slurm here and FSDP2 in the Slurm eviction (CI time).
@pytest.mark.parametrize("kind", ["fsdp2"])
def test_a_host_slowed_mid_training_is_named_with_its_rank_and_slowdown(sim_cluster, tmp_path, kind):
    _slowed_host_is_named(sim_cluster, _spec(sim_cluster, tmp_path, kind), tmp_path, f"strag-slow-{kind}")


@pytest.mark.parametrize("kind", ["ddp"])
def test_a_slurm_node_slowed_mid_training_is_named(slurm_cluster, tmp_path, kind):
    """The same on the Slurm sim: the job's srun step on 3 nodes, one node's CPU limited."""
    data = yaml.safe_load(slurm_cluster.slurm.spec_path.read_text())
    data.update(workdir=str(ROOT), nproc_per_node=1, healthcheck={"sizes": ["64K"], "iterations": 1},
                env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")}, job=_job(kind, len(slurm_cluster.hosts)))
    data["slurm"].update(nodes=len(slurm_cluster.hosts), output_dir=str(tmp_path / "slurm-out"))
    spec = tmp_path / "slurm.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        _slowed_host_is_named(slurm_cluster, spec, tmp_path, f"strag-slurm-{kind}")
    finally:
        from ddplaunch.sim.slurm import wait_nodes_idle

        wait_nodes_idle(slurm_cluster.slurm, [h.name for h in slurm_cluster.hosts], timeout=120)


def _slowed_host_is_named(cluster, spec: Path, tmp_path: Path, run_id: str) -> None:
    """Node 2's host slowed to 15 % of one CPU once training passed step 60: named (host, rank,
    slowdown) on screen, in the event log, the record and the summary, and no other host."""
    hosts = [h.name for h in cluster.hosts]
    slow = hosts[2]
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    try:
        # judged healthy in its first two windows (steps 21-60); a healthy run naming nobody for
        # minutes is bench/stragglers.py's (a window or two more here proves no more: nobody is
        # named before MIN_SLOW_S of slow steps)
        head = read_until(proc, "step=60 ", timeout=300)
        assert not [line for line in head if "straggler" in line], "".join(head)[-3000:]
        sim_fault(cluster, slow, slow=15)
        slowed_at = time.monotonic()
        named = read_until(proc, "[ddplaunch] straggler:", timeout=120)
        took = time.monotonic() - slowed_at
        sim_fault(cluster, slow, clear=True)
        proc.send_signal(2)  # the point is made: Ctrl-C ends the run
        rest, _ = proc.communicate(timeout=120)
    finally:
        sim_fault(cluster, slow, clear=True)
        if proc.poll() is None:
            proc.kill()
    out = "".join(head + named) + rest
    print(f"slowed -> named {took:.1f}s")
    no_hang(took, NAMED_S, "a host slowed mid-training is named from its ranks' timing while the job runs")
    line = named[-1]
    assert f"[ddplaunch] straggler: {slow} (rank 2) computes" in line, out[-3000:]
    assert [h for h in hosts if f"straggler: {h} " in out] == [slow], out[-3000:]
    run_dir = tmp_path / "state" / "runs" / run_id
    events = read_events(run_dir)
    (found,) = [e.straggler for e in events if isinstance(e, StragglerNamed)]
    assert found.host == slow and found.ranks == [2] and found.slowdown > 0, found
    # the evidence: it computes longer, the others wait for it
    assert found.compute_s > found.peers_compute_s and found.peers_wait_s > 0
    windows = [e for e in events if isinstance(e, StepWindow)]  # every host's part, judged window by window
    assert windows and all(set(e.hosts) == set(hosts) for e in windows), windows
    assert [s.host for s in RunView.of(events).stragglers] == [slow]
    assert f"straggler: {slow} (rank 2) computes" in rest  # the summary says it too


def test_an_evicted_straggler_is_swapped_for_the_spare_at_the_next_checkpoint(sim_cluster, tmp_path):
    """recovery.evict_stragglers with a spare: the slowed host is named, rank 0 holds before its
    first step after the next checkpoint, the launch stops there and the spare takes the slow
    host's node rank; training resumes from that very checkpoint (no completed step redone) and,
    without the slow host, steps as fast as before it was slowed."""
    hosts = [h.name for h in sim_cluster.hosts]
    data = yaml.safe_load(_spec(sim_cluster, tmp_path).read_text())
    data["hosts"], data["recovery"] = data["hosts"][:3], {"max_host_failures": 1, "spares": [data["hosts"][3]],
                                                          "evict_stragglers": True}
    _evicted(sim_cluster, data, tmp_path, "strag-evict", slow=hosts[1], rank=1, spare=hosts[3])


@pytest.mark.parametrize("kind", sorted(JOBS))
def test_an_evicted_slurm_straggler_is_swapped_for_the_spare_node_at_the_next_checkpoint(slurm_cluster, tmp_path,
                                                                                        kind):
    """The same on the Slurm sim: 2 nodes and a count of 1 spare (the allocation's first node);
    node 1 slowed, evicted at the next checkpoint, the spare node takes its node rank. FSDP2 too:
    its checkpoint is a DCP save, which rank 0 holds after just as after a torch.save."""
    nodes = [h.name for h in slurm_cluster.hosts]
    data = yaml.safe_load(slurm_cluster.slurm.spec_path.read_text())
    data.update(workdir=str(ROOT), nproc_per_node=1, healthcheck={"sizes": ["64K"], "iterations": 1},
                env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")}, job=_job(kind, 2),
                recovery={"max_host_failures": 1, "spares": 1, "evict_stragglers": True})
    data["slurm"].update(nodes=2, output_dir=str(tmp_path / "slurm-out"))
    try:
        _evicted(slurm_cluster, data, tmp_path, f"strag-evict-slurm-{kind}", slow=nodes[2], rank=1, spare=nodes[0])
    finally:
        from ddplaunch.sim.slurm import wait_nodes_idle

        wait_nodes_idle(slurm_cluster.slurm, nodes, timeout=120)


def _evicted(cluster, data: dict, tmp_path: Path, run_id: str, slow: str, rank: int, spare: str) -> None:
    """Run `data` (a job of JOBS, a checkpoint every 25 steps, ~250 steps), slow `slow` once step 40
    was printed: it is named, evicted at the next checkpoint and replaced by `spare`; training
    resumes at that checkpoint's step and steps faster than while slowed."""
    data = copy.deepcopy(data)
    args = data["job"]["args"]
    args[args.index("--ckpt-every") + 1] = "25"
    if "--steps" in args:  # FSDP2's job counts steps
        args[args.index("--steps") + 1] = "250"
    else:  # the DDP job: one epoch of 6000 samples
        args[args.index("--samples") + 1] = "6000"
    spec = tmp_path / "evict.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    try:
        head = read_until(proc, "step=40 ", timeout=240)
        sim_fault(cluster, slow, slow=15)
        rest, _ = proc.communicate(timeout=400)
    finally:
        sim_fault(cluster, slow, clear=True)
        if proc.poll() is None:
            proc.kill()
    out = "".join(head) + rest
    assert proc.returncode == 0, out[-4000:]
    assert f"[ddplaunch] straggler: {slow} (rank {rank}) computes" in out, out[-4000:]
    assert f"[ddplaunch] evicting {slow} at the job's next checkpoint" in out
    held = re.search(r'DDPLAUNCH_HELD_JSON \{"rank": 0, "steps": (\d+)', (tmp_path / "state" / "runs" / run_id /
                                                                          "output.log").read_text())
    assert held is not None, out[-3000:]
    step = int(held.group(1))
    assert step % 25 == 0, step  # held right after a checkpoint
    assert re.search(rf"recovered from 1 host failure:\n  {slow} lost \(evicted as a straggler at the checkpoint "
                     rf"after step {step}: .*\) → replaced by {spare}", out), out[-3000:]
    assert f"[ddplaunch] training resumed at step {step} " in out, out[-3000:]  # nothing redone
    events = read_events(tmp_path / "state" / "runs" / run_id)
    relaunch = max(i for i, e in enumerate(events) if type(e).__name__ == "RecoveryStarted")
    before = _step_times(events[:relaunch], lambda e: e.last <= 40)
    slowed = _step_times(events[:relaunch], lambda e: e.first > 60)
    after = _step_times(events[relaunch:], lambda e: True)
    pace = statistics.median(before) / statistics.median(after)  # steps per second after / before
    print(f"median step time: {statistics.median(before) * 1e3:.0f} ms before the slowdown, "
          f"{statistics.median(slowed) * 1e3:.0f} ms slowed, {statistics.median(after) * 1e3:.0f} ms after the eviction "
          f"(steps per second {pace:.0%} of before)")
    # the behaviour: faster once the slow host is gone; the pace against before the slowdown is a
    # figure (printed; docs/benchmarks.md), not asserted: CI's other stream shares the 2 cores
    # unevenly between the two phases (65 % once in CI, 95 % quiet, in the same session)
    assert statistics.median(after) < 0.7 * statistics.median(slowed), (slowed, after)


def _step_times(events: list, which: Callable[[StepWindow], bool]) -> list[float]:
    """The hosts' median step times (seconds) over the windows of steps `which` picks."""
    return [part[2] for e in events if isinstance(e, StepWindow) and which(e) for part in e.hosts.values()]
