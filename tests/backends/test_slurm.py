"""Integration tests of the Slurm backend on a real (simulated) Slurm cluster of 3 nodes.

Needs root, munge and the Slurm daemons (`slurm_cluster` skips with the reason otherwise). Jobs
are followed by polling with deadlines; a run's processes are found by its DDPLAUNCH_RUN_ID tag
(every sim node shares this machine's PID namespace). A failing rank that ends the allocation and
Ctrl-C that cancels the job are the fault matrix's (tests/run/test_fault_matrix.py, `[slurm]`).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ddplaunch.backends.slurm.client import SlurmJob
from tests.simfixture import slurm_cluster  # noqa: F401  (session fixture)
from tests.ssh_util import ROOT, ddplaunch, popen_ddplaunch, read_until, run_processes, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]


def slurm_spec(cluster, tmp_path: Path, script: str = "jobs/toy_ddp.py", **slurm: object) -> Path:
    data = yaml.safe_load(cluster.slurm.spec_path.read_text())
    data.pop("hosts", None)  # Slurm picks slurm.nodes nodes
    data["workdir"] = str(ROOT)
    data["job"] = {"script": script}
    data["slurm"].update({"output_dir": str(tmp_path / "slurm-out"), **slurm})
    path = tmp_path / "cluster-slurm.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def slurm_env(cluster) -> dict[str, str]:
    return cluster.slurm.env(dict(os.environ))


def job_of(tmp_path: Path, run_id: str) -> str:
    job = SlurmJob.load(tmp_path / "state" / "runs" / run_id)  # a detached run's: its record's
    assert job is not None
    return job.job_id


def queue_state(cluster, job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                         timeout=30, env=slurm_env(cluster))
    return out.stdout.strip()


def in_queue(cluster, job_id: str) -> bool:
    return bool(queue_state(cluster, job_id))


def test_up_two_nodes_two_procs(slurm_cluster, tmp_path):
    spec = slurm_spec(slurm_cluster, tmp_path)
    out = ddplaunch(["up", str(spec), "--run-id", "sl-ok"], tmp_path, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    # one launch: the health check ran in the job's workers, then the job
    assert "HEALTHCHECK OK world=4" in text and "stage job: ok on all 2 node(s)" in text
    hosts = [h.name for h in slurm_cluster.hosts]
    # which node ran which ranks: ranks 0,1 on the first node, 2,3 on the second
    for rank in range(4):
        node = hosts[rank // 2]
        assert f"[{node}:{rank}] rank={rank} mean_grad=4.0 updated_weight=0.6" in text, text
    assert "DDPLAUNCH_NODE" not in text and "DDPLAUNCH_HEALTHCHECK_JSON" not in text
    assert (tmp_path / "state" / "runs" / "sl-ok" / "healthcheck.json").is_file()
    status = ddplaunch(["status", "sl-ok"], tmp_path)
    assert f"slurm job {job_of(tmp_path, 'sl-ok')} (submitted by this run): COMPLETED" in status.stdout, status.stdout


def test_a_node_remembered_bad_is_excluded_from_the_allocation(slurm_cluster, tmp_path):
    """Slurm picks the nodes (slurm.nodes: 2 of 3): the node an earlier run recorded bad is passed
    as --exclude, and the job runs on the other two."""
    from ddplaunch.record.hosthealth import remember

    hosts = [h.name for h in slurm_cluster.hosts]
    remember(tmp_path / "state" / "host-health.json", {hosts[0]: "lost (its ranks are frozen)"}, "earlier", "slurm")
    out = ddplaunch(["up", str(slurm_spec(slurm_cluster, tmp_path)), "--run-id", "sl-excl"], tmp_path, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert re.search(rf"excluded from the allocation {hosts[0]}: lost \(its ranks are frozen\) \(run earlier, ", text)
    ran = set(re.findall(r"^\[(\S+):\d+\] rank=\d+ mean_grad", text, re.M))
    assert ran == {hosts[1], hosts[2]}, text


def test_plain_sbatch_without_ddplaunch(slurm_cluster, tmp_path):
    env = dict(slurm_env(slurm_cluster), PYTHON=str(ROOT / ".venv/bin/python"), NPROC_PER_NODE="2",
               SOCKET_IFNAME=slurm_cluster.ifname)
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/ddp-%j.out",
                          "slurm/ddp.sbatch", "jobs/toy_ddp.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    wait_for(lambda: not in_queue(slurm_cluster, job), timeout=240, interval=0.3)
    text = (tmp_path / f"ddp-{job}.out").read_text()
    assert "HEALTHCHECK OK world=4" in text, text
    assert text.count("updated_weight=0.6") == 4, text
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30,
                          env=slurm_env(slurm_cluster)).stdout
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info


def test_a_killed_up_leaves_the_run_going_and_the_allocation_ends_with_it(slurm_cluster, tmp_path):
    """`up` SIGKILLed mid-training: the run's supervisor goes on, `attach` shows it to its end
    (exit 0), and the allocation leaves the queue when the run ends (it no longer idles to its
    time limit)."""
    spec = slurm_spec(slurm_cluster, tmp_path, "jobs/train.py")
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "sl-killed", "--skip-healthcheck", "--",
                            "--epochs", "1", "--step-sleep", "0.3", "--ckpt-dir", str(tmp_path / "ckpt")], tmp_path)
    read_until(proc, "step=", timeout=180)
    proc.kill()
    proc.wait(timeout=30)
    job = job_of(tmp_path, "sl-killed")
    assert queue_state(slurm_cluster, job) == "RUNNING"
    attached = ddplaunch(["attach", "sl-killed"], tmp_path, timeout=300)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr
    assert "replicas identical" in attached.stdout and attached.stdout.rstrip().endswith("run sl-killed: ok (exit 0)")
    # the supervisor cancels the allocation as it ends the run (30 s: a hang guard, measured ~1 s)
    assert wait_for(lambda: not in_queue(slurm_cluster, job), timeout=30, interval=0.3) is True
    assert wait_for(lambda: not run_processes("sl-killed"), timeout=15) is True


def release_requeued(cluster, job: str) -> None:
    """Slurm holds a requeued job back (BeginTime) for a while; let it start almost at once.

    Not in the same second as the requeue: slurmd revokes the old instance's credential with
    one-second granularity, and a relaunch inside that second is killed ("Job credential
    revoked"). `now+2` lets the scheduler keep that distance.
    """
    wait_for(lambda: queue_state(cluster, job) == "PENDING", timeout=60, interval=0.3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], capture_output=True,
                   timeout=30, env=slurm_env(cluster))


def start_requeueable_training(cluster, tmp_path: Path, run_id: str, ckpt_every: int):
    """`ddplaunch up` of a slow jobs/train.py with `slurm.requeue: true`; (process, checkpoint dir)."""
    spec = slurm_spec(cluster, tmp_path, "jobs/train.py", requeue=True)
    ckpt = tmp_path / "ckpt"
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id, "--skip-healthcheck", "--",
                            "--epochs", "2", "--steps-per-epoch", "40", "--step-sleep", "0.15",
                            "--ckpt-every", str(ckpt_every), "--ckpt-dir", str(ckpt)], tmp_path)
    return proc, ckpt


def test_requeued_job_resumes_from_checkpoint(slurm_cluster, tmp_path):
    proc, ckpt = start_requeueable_training(slurm_cluster, tmp_path, "sl-rq", ckpt_every=5)
    try:
        read_until(proc, "loss=", timeout=180)
        wait_for(lambda: (ckpt / "latest").is_file(), timeout=60)
        job = job_of(tmp_path, "sl-rq")
        rq = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30,
                            env=slurm_env(slurm_cluster))
        assert rq.returncode == 0, rq.stderr
        release_requeued(slurm_cluster, job)
        rest, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "requeued (restart 1)" in rest, rest
    assert "resumed from " in rest, rest
    assert "replicas identical" in rest


def test_time_limit_warning_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """The USR2 Slurm sends ahead of the time limit (simulated with `scancel --batch --signal`):
    the batch shell passes it to every rank, train.py checkpoints and exits, the job requeues
    itself and the next run resumes from that checkpoint to the end."""
    proc, ckpt = start_requeueable_training(slurm_cluster, tmp_path, "sl-pre", ckpt_every=0)
    try:
        read_until(proc, "loss=", timeout=180)
        job = job_of(tmp_path, "sl-pre")
        warn = subprocess.run(["scancel", "--batch", "--signal=USR2", job], capture_output=True, text=True,
                              timeout=30, env=slurm_env(slurm_cluster))
        assert warn.returncode == 0, warn.stderr
        lines = read_until(proc, "preempted (SIGUSR2): checkpoint at step", timeout=60)
        step = re.search(r"checkpoint at step (\d+)", lines[-1]).group(1)
        release_requeued(slurm_cluster, job)
        rest, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "DDPLAUNCH_PREEMPTED requeueing job" in "".join(lines) + rest or "requeued (restart 1)" in rest
    assert f"resumed from {ckpt}/ckpt_step{step}.pt at step {step}" in rest, rest
    assert "replicas identical" in rest
