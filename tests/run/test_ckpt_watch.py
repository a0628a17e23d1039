"""`checkpoint.watch` on real (simulated) hosts: unmodified Lightning and HF Trainer jobs
(jobs/lightning_train.py, jobs/hf_trainer.py, writing into `{checkpoint_dir}`) whose checkpoint
dir is memory-backed.
The host that writes the checkpoints (rank 0's) crashes after a save (`sim fault --crash`: its
processes killed, its RAM emptied); the relaunch on the spare puts the newest checkpoint back into
every host's dir from the buddy's RAM before the job starts, and the job's own resume goes on
from that step. The durable dir holds the job's
own files; nothing of the run is left in RAM at the end."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddplaunch.hostside.ckpt import jobfiles, layout
from ddplaunch.sim.faults import sim_fault
from tests.ssh_util import ROOT, popen_ddplaunch, run_processes, run_view, wait_for
from tests.timing import no_hang

pytestmark = [pytest.mark.root, pytest.mark.slow]
EVERY = 100
#: Hang guards, as test_recovery.py's.
DETECT_S, RESUME_S = 30.0, 120.0
#: The unmodified jobs: their arguments (`{checkpoint_dir}` is the node's dir in RAM), how many
#: steps, what they resume with, the file of the durable dir that holds their last step.
JOBS = {
    "lightning": dict(script="jobs/lightning_train.py", steps=700,
                      args=["--ckpt-dir", "{checkpoint_dir}", "--save-every", str(EVERY), "--step-sleep", "0.01"],
                      resume_args=["--ckpt-path", "{checkpoint_dir}/last.ckpt"]),
    "hf": dict(script="jobs/hf_trainer.py", steps=500,
               args=["--output-dir", "{checkpoint_dir}", "--save-steps", str(EVERY), "--logging-steps", "100"],
               resume_args=[]),  # the Trainer finds its newest checkpoint-N itself (get_last_checkpoint)
}


def _spec(cluster, tmp_path: Path, job: dict) -> Path:
    data = yaml.safe_load(cluster.spec_path.read_text())
    data.update(hosts=[data["hosts"][i] for i in (0, 1, 2)], workdir=str(ROOT), nproc_per_node=1,
                healthcheck={"sizes": ["64K"], "iterations": 1}, env={"OMP_NUM_THREADS": "1"},
                recovery={"max_host_failures": 1, "spares": [data["hosts"][3]]},
                checkpoint={"path": "unused-on-disk", "durable": str(tmp_path / "durable"), "tier": "memory",
                            "replicas": 1, "watch": True},
                job={"script": job["script"], "args": ["--max-steps", str(job["steps"]), *job["args"]],
                     "resume_args": job["resume_args"]})
    (tmp_path / "durable").mkdir()
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _ram_of(run_id: str) -> Path:
    return layout.ram_base(Path("/dev/shm")) / run_id


def _last_step(durable: Path, name: str) -> int:
    if name == "lightning":
        return torch.load(durable / "last.ckpt", weights_only=False)["global_step"]
    newest = max(durable.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((newest / "trainer_state.json").read_text())["global_step"]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_writers_crash_resumes_an_unmodified_job_from_its_buddys_ram(sim_cluster, tmp_path, name):
    """Lightning's Trainer (last.ckpt, resumed by `--ckpt-path`) and HF's Trainer (checkpoint-N,
    found by its own get_last_checkpoint), rank 0's host (the writer) crashed after its second save."""
    job, hosts = JOBS[name], [h.name for h in sim_cluster.hosts]
    spec, run_id = _spec(sim_cluster, tmp_path, job), f"ckw-{name}"
    durable = tmp_path / "durable"
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        # the writer's second save in its buddy's RAM (node 1's host: the ring's next)
        replica = layout.replica_part_dir(Path("/dev/shm"), run_id, hosts[1], hosts[0], jobfiles.FILES_PART)
        saved = wait_for(lambda: any(s >= 2 * EVERY for s in layout.sealed_steps(replica)) or proc.poll() is not None,
                         timeout=300)
        assert saved is True and proc.poll() is None, "".join(lines)[-3000:]
        crashed = time.time()
        sim_fault(sim_cluster, hosts[0], crash=True)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        sim_fault(sim_cluster, hosts[0], clear=True)
    reader.join(timeout=30)
    out = "".join(lines)
    record = run_view(tmp_path, run_id)
    assert proc.returncode == 0 and record.state == "ok", out[-4000:]
    (recovery,) = record.recoveries
    assert recovery.lost == [hosts[0]] and recovery.replaced == {hosts[0]: hosts[3]}, recovery
    assert recovery.first_step_at is not None
    no_hang(recovery.detected_at - crashed, DETECT_S, "the crashed host is named from its heartbeat")
    no_hang(recovery.first_step_at - crashed, RESUME_S, "training resumes on the spare")
    # put back before the job started: the newest save the lost writer made, from node 1's RAM
    loaded = recovery.checkpoint
    assert loaded is not None and (loaded.source, loaded.host, loaded.origin) == ("memory", hosts[1], hosts[0]), recovery
    assert loaded.step >= 2 * EVERY and loaded.step % EVERY == 0, loaded
    assert recovery.resumed_from == loaded.step
    assert re.search(rf"step {loaded.step} put back into the job's dir from {hosts[1]}'s memory "
                     rf"\(written by {hosts[0]}\)", out), out[-4000:]
    assert re.search(rf"resumed after \d+s at step {loaded.step} from {hosts[1]}'s memory \({hosts[0]} lost\)", out), \
        out[-3000:]
    assert f"done: {job['steps']} steps" in out, out[-3000:]
    # the job's own files in the durable dir, its last save among them, and said durable
    assert _last_step(durable, name) == job["steps"]
    assert f"checkpoint step {job['steps']} durable" in out, out[-3000:]
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)
    assert not _ram_of(run_id).exists() or not any(os.scandir(_ram_of(run_id))), list(_ram_of(run_id).rglob("*"))[:10]
