"""`ddplaunch down` of a Slurm run killed outright frees what it left in its nodes' RAM (the
checkpoint memory tier), on the sim's Slurm cluster: its supervisor and every process of it
SIGKILLed, its allocation still running; `down` runs the reaper as a step on the allocation's
nodes (each part's newest sealed version persisted to the durable dir first), then cancels the
allocation: 0 bytes of the run are left in /dev/shm."""

from __future__ import annotations

import pytest
import yaml

from tests.backends.test_slurm import in_queue, slurm_spec
from tests.run.test_ckpt_cleanup_sim import RAM, _durable_has, _kill_everything, _newest_sealed, _sealed_parts
from tests.simfixture import slurm_cluster  # noqa: F401  (session fixture)
from tests.ssh_util import ddplaunch, popen_ddplaunch, poll, read_until, wait_for
from ddplaunch.backends.slurm.client import SlurmJob

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_down_of_a_killed_slurm_run_frees_its_nodes_ram_before_it_cancels_the_allocation(slurm_cluster, tmp_path):
    run_id = "ckc-slurm"
    spec = slurm_spec(slurm_cluster, tmp_path, "jobs/train.py", nodes=2)
    data = yaml.safe_load(spec.read_text())
    data.update(checkpoint={"path": str(tmp_path / "ckpt"), "tier": "memory", "replicas": 1},
                healthcheck={"enabled": False}, nproc_per_node=1)
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    up = popen_ddplaunch(["up", str(spec), "--run-id", run_id, "--", "--epochs", "1", "--samples", "20000",
                          "--batch-size", "8", "--ckpt-every", "2", "--log-every", "1", "--step-sleep", "0.3",
                          "--ckpt-api"], tmp_path)
    said = read_until(up, "step=4 ", timeout=240)
    assert poll(lambda: len(_sealed_parts(run_id)) == 2, timeout=60), said[-20:]
    job = SlurmJob.load(tmp_path / "state" / "runs" / run_id)
    assert job is not None and job.owned
    _kill_everything(tmp_path, run_id, up)
    sealed = _newest_sealed(run_id)
    assert len(sealed) == 1 and len(_sealed_parts(run_id)) == 2  # nothing freed it
    assert in_queue(slurm_cluster, job.job_id)  # nobody cancelled the allocation either
    down = ddplaunch(["down", run_id], tmp_path, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (RAM / run_id).exists(), (down.stdout, sorted(str(p) for p in (RAM / run_id).rglob("*")))
    assert _durable_has(tmp_path / "ckpt", sealed), down.stdout
    assert f"job {job.job_id}: was RUNNING, cancelled" in down.stdout, down.stdout
    assert wait_for(lambda: not in_queue(slurm_cluster, job.job_id), timeout=60, interval=0.3) is True
