"""Recovery on the Slurm sim: a node lost (crashed), frozen or cut off the training network
mid-training is replaced by the spare node the allocation holds (a count of spares: one node more,
its first), every other node keeping its node rank; a job's own failure is restarted on every node
together (job.max_restarts); the job's final weights are bitwise those of an undisturbed run. The
SSH side of the same is tests/run/test_recovery.py and tests/run/test_resilience.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from ddplaunch.sim.faults import sim_fault
from tests.ssh_util import ROOT, ddplaunch, wait_for
from tests.run.test_recovery import SHA_RE, _crash_during, _disturbed, _freeze, _timely, _train

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _spec(cluster, tmp_path: Path, name: str, **job) -> Path:
    """The training job on 2 nodes of the Slurm sim, a count of 1 spare (the allocation's first
    node), budget 1; `job` adds keys to its job section."""
    data = yaml.safe_load(cluster.slurm.spec_path.read_text())
    data.update(_train(tmp_path, name, "--step-sleep", "0.3"), workdir=str(ROOT))
    data["job"].update(job)
    data["slurm"].update(nodes=2, output_dir=str(tmp_path / "slurm-out"))
    data["recovery"] = {"max_host_failures": 1, "spares": 1}
    spec = tmp_path / name / "cluster.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def undisturbed_sha(tmp_path: Path) -> str:
    """The final weights of the same training (world size 2), undisturbed, on this machine."""
    data = {"name": "det-ref", "backend": "local", "workdir": str(ROOT), **_train(tmp_path, "det-ref")}
    data["nproc_per_node"] = 2
    spec = tmp_path / "det-ref" / "c.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    ref = ddplaunch(["up", str(spec), "--run-id", "det-ref"], tmp_path, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr
    (sha,) = SHA_RE.findall(ref.stdout)
    return sha


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    return undisturbed_sha(tmp_path_factory.mktemp("ref"))


def test_slurm_spare_node_held_by_the_allocation_replaces_a_crashed_node(slurm_cluster, tmp_path, reference):
    """A count of spares: the allocation holds one node more, its first; the crashed node 1 is
    replaced by it at node rank 1, node 0 stays node 0."""
    spec = _spec(slurm_cluster, tmp_path, "slurm")
    nodes = [h.name for h in slurm_cluster.hosts]
    # the allocation holds all three nodes; its first (the batch script's) is the spare
    out, record, t_crash = _crash_during(spec, tmp_path, "rec-slurm", slurm_cluster, nodes[2])
    try:
        assert record.state == "ok", out[-4000:]
        recovery = _timely(record, t_crash)
        assert recovery.lost == [nodes[2]] and recovery.replaced == {nodes[2]: nodes[0]}
        assert re.search(rf"{nodes[2]} \(node 1\) lost \(no heartbeat for \d+s and \S+:6818 gave no answer", out)
        # the survivor keeps node rank 0 and the master, though the spare comes first in the
        # allocation's (the step's) node order: seen from rank 0 itself
        after = out.split("recovery 1 of")[1]
        assert f"stage job: master {nodes[1]}:" in after, after[:2000]
        assert f"[{nodes[1]}:0] train: world_size=2" in after and f"host={nodes[1]} restart=0" in after, after[:3000]
        assert SHA_RE.findall(out) == [reference]  # bitwise equal to an undisturbed run
    finally:
        from ddplaunch.sim.slurm import wait_nodes_idle

        wait_nodes_idle(slurm_cluster.slurm, nodes, timeout=120)


def test_slurm_job_failure_is_restarted_on_every_node_together(slurm_cluster, tmp_path, reference):
    """job.max_restarts on Slurm: rank 1 exits at step 10 in the first launch only; the whole job
    is launched again (one new srun step on the same nodes, the spare left waiting), resumes from
    its step-8 checkpoint and ends with the weights of an undisturbed run."""
    spec = _spec(slurm_cluster, tmp_path, "slurm-restart", max_restarts=1)
    data = yaml.safe_load(spec.read_text())
    data["job"]["args"] += ["--fail-at-step", "10", "--fail-rank", "1"]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    nodes = [h.name for h in slurm_cluster.hosts]
    try:
        out = ddplaunch(["up", str(spec), "--run-id", "rec-slurm-restart"], tmp_path, timeout=400).stdout
        assert f"restart 1 of at most 1 (job.max_restarts): the job failed (rank 1 on {nodes[2]} exit code 3)" \
            in out, out[-4000:]
        after = out.split("restart 1 of at most 1")[1]
        assert f"relaunching on {nodes[1]}, {nodes[2]}" in after and "resumed from" in after, after[:3000]
        assert re.search(r"\[\S+:0\] resumed from \S+ckpt_step8\.pt at step 8", after), after[:3000]
        assert SHA_RE.findall(out) == [reference] and out.rstrip().endswith("ok (exit 0)"), out[-3000:]
    finally:
        from ddplaunch.sim.slurm import wait_nodes_idle

        wait_nodes_idle(slurm_cluster.slurm, nodes, timeout=120)


def test_slurm_node_whose_ranks_froze_is_named_and_replaced_by_the_spare(slurm_cluster, tmp_path, reference):
    """On the Slurm sim: every process of the job on node 1 stopped (SIGSTOP; slurmd answers):
    the hang watchdog reads the ranks' process states through an srun step, that node counts as
    lost, the allocation's spare takes its node rank and the job ends ok."""
    spec = _spec(slurm_cluster, tmp_path, "slurm-frozen", hang_timeout=10)
    nodes = [h.name for h in slurm_cluster.hosts]
    run_id = "rec-slurm-frozen"
    frozen: list[int] = []
    try:
        out, code = _disturbed(spec, tmp_path, run_id, "step=6 ", lambda: frozen.extend(_freeze(run_id, nodes[2])))
        assert code == 0, out[-4000:]
        assert re.search(rf"\[ddplaunch\] {nodes[2]}: its ranks are frozen \(process state T: pid \d+\) while the "
                         "host answers", out), out[-4000:]
        assert re.search(rf"recovered from 1 host failure:\n  {nodes[2]} lost \(its ranks are frozen .*\) → "
                         rf"replaced by {nodes[0]}", out), out[-3000:]
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in frozen), timeout=60) is True
        assert SHA_RE.findall(out) == [reference]
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        from ddplaunch.sim.slurm import wait_nodes_idle

        wait_nodes_idle(slurm_cluster.slurm, nodes, timeout=120)


def test_slurm_node_whose_training_link_broke_is_named_and_replaced_by_the_spare(slurm_cluster, tmp_path, reference):
    """On the Slurm sim: node 1's traffic to and from the other nodes dropped but for sshd's and
    slurmd's (`sim fault --cut-training`): it answers and heartbeats, its rank runs, both ranks wait
    in a collective. The hang watchdog's link test (srun steps, the spare node a witness) finds that
    node cut off, the spare takes its node rank, node 0 keeps its own, the job ends bitwise equal."""
    spec = _spec(slurm_cluster, tmp_path, "slurm-cut", hang_timeout=10)
    nodes = [h.name for h in slurm_cluster.hosts]
    try:
        out, code = _disturbed(spec, tmp_path, "rec-slurm-cut", "step=6 ",
                               lambda: sim_fault(slurm_cluster, nodes[2], cut_training=True))
    finally:
        sim_fault(slurm_cluster, nodes[2], clear=True)
        from ddplaunch.sim.slurm import wait_nodes_idle

        wait_nodes_idle(slurm_cluster.slurm, nodes, timeout=120)
    assert code == 0, out[-4000:]
    # two nodes alone cannot tell which one is cut: the spare node, a witness, can
    assert re.search(rf"\[ddplaunch\] {nodes[2]}: its training link is broken: no TCP connection to or from "
                     rf"{nodes[1]}, {nodes[0]} on port \d+", out), out[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {nodes[2]} lost \(its training link is broken.*\) → "
                     rf"replaced by {nodes[0]}", out), out[-3000:]
    after = out.split("recovery 1 of")[1]
    assert f"[{nodes[1]}:0] train: world_size=2" in after, after[:3000]  # node 0 kept its rank and the master
    assert SHA_RE.findall(out) == [reference]
