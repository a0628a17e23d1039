"""`container:` on real podman: every rank of `ddplaunch up` inside the test image (a path only the
image has), on 3 sim hosts x 2 over SSH and on the Slurm sim x 2, health check first; Ctrl-C
leaves no container and no process; a missing image is named by the pre-flight before anything
starts; a container's small /dev/shm is named by `check`. The image is ddplaunch/sim/image.py's
(built once, cached); podman's settings for this VM reach the hosts' sessions as a site's system
config would (the sim's sshd: SetEnv CONTAINERS_CONF; Slurm steps: the launcher's environment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddplaunch.sim.image import IMAGE_MARKER, IMAGE_VENV, podman_env
from tests.doc_examples import check_doc_example
from tests.ssh_util import (ROOT, ddplaunch, launcher_env, popen_ddplaunch, read_until, run_processes, sim_spec,
                            started, supervisor_pid, wait_for)
from tests.backends.test_slurm import slurm_spec
from tests.timing import no_hang

pytestmark = pytest.mark.slow

PY = f"{IMAGE_VENV}/bin/python"
#: Each rank says whether it runs inside the image (its marker, its interpreter).
INSIDE_JOB = f"""\
import os, sys
inside = os.path.exists({IMAGE_MARKER!r}) and sys.executable.startswith({IMAGE_VENV!r})
os.write(1, f"INSIDE={{inside}} rank={{os.environ['RANK']}} py={{sys.executable}}\\n".encode())
"""
TICK_JOB = "import os, time\nwhile True:\n    os.write(1, b'tick\\n')\n    time.sleep(0.5)\n"


def containers_of(run_id: str) -> list[str]:
    """The run's podman containers, running or not (the sim hosts share this machine's storage)."""
    out = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=ddplaunch.run={run_id}"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, **podman_env()))
    return out.stdout.split()


def container_spec(cluster, tmp_path: Path, image: str, script: str, **overrides) -> Path:
    (tmp_path / "job.py").write_text(script)
    container = {"image": image, "runtime": "podman", **overrides.pop("container", {})}
    return sim_spec(cluster, tmp_path, python=PY, workdir=str(tmp_path), job={"script": "job.py"},
                    container=container, **overrides)


def test_every_rank_runs_inside_the_image_over_ssh(sim_cluster, image, tmp_path):
    spec = container_spec(sim_cluster, tmp_path, image, INSIDE_JOB, nproc_per_node=2, healthcheck={"sizes": ["64K"]})
    dry = ddplaunch(["up", str(spec), "--dry-run", "--run-id", "ctr-ssh"], tmp_path)
    assert "exec podman run --rm --name=ddp-ctr-ssh-job-n0 --label=ddplaunch.run=ctr-ssh" in dry.stdout, dry.stdout
    assert f" {image} {PY} -m torch.distributed.run" in dry.stdout
    out = ddplaunch(["up", str(spec), "--run-id", "ctr-ssh"], tmp_path, timeout=420)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "HEALTHCHECK OK world=6" in out.stdout
    inside = sorted(ln.split("] ", 1)[1] for ln in out.stdout.splitlines() if "INSIDE=" in ln)
    assert inside == [f"INSIDE=True rank={r} py={PY}" for r in sorted(range(6), key=str)], out.stdout
    assert containers_of("ctr-ssh") == []  # --rm: each left with its torchrun


def test_ctrl_c_leaves_no_container_and_no_process(sim_cluster, image, tmp_path):
    spec = container_spec(sim_cluster, tmp_path, image, TICK_JOB, nproc_per_node=2, healthcheck={"enabled": False})
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "ctr-int"], tmp_path)
    read_until(proc, "tick", timeout=240)
    assert len(containers_of("ctr-int")) == 3
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    no_hang(time.monotonic() - t0, 30, "Ctrl-C stops every container of the run")
    wait_for(lambda: containers_of("ctr-int") == [] and run_processes("ctr-int") == {}, timeout=20)


def test_a_missing_image_is_named_by_the_preflight_and_nothing_starts(sim_cluster, image, tmp_path):
    spec = container_spec(sim_cluster, tmp_path, image, INSIDE_JOB, healthcheck={"enabled": False},
                          container={"image": "localhost/no-such-image:1", "pull": "never"})
    out = ddplaunch(["up", str(spec), "--run-id", "ctr-missing"], tmp_path, timeout=180)
    assert out.returncode == 1, out.stdout
    assert "image: image localhost/no-such-image:1 is not on the host (container.pull: never) -> fix: podman pull" \
        in out.stdout, out.stdout
    assert "stopped by the pre-flight gate: no job was started" in out.stdout
    assert "INSIDE=" not in out.stdout and containers_of("ctr-missing") == []
    check_doc_example("missing-image", out.stdout, [h.name for h in sim_cluster.hosts],
                      [r"\S+ \(\S+\): image: ", r"\[ddplaunch\] pre-flight failed", r"stopped by the pre-flight"])


def test_check_names_a_small_dev_shm_inside_the_container(sim_cluster, image, tmp_path):
    spec = container_spec(sim_cluster, tmp_path, image, INSIDE_JOB, n_hosts=2, nproc_per_node=1,
                          healthcheck={"sizes": ["4K"]}, container={"options": ["--shm-size=16m"]})
    out = ddplaunch(["check", str(spec)], tmp_path, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]  # with Gloo a warning, not a failure
    warned = [ln for ln in text.splitlines() if ": shm: warning: /dev/shm is 16 MB inside the container" in ln]
    assert len(warned) == 2, text
    check_doc_example("small-shm", text, [h.name for h in sim_cluster.hosts], [r"\S+: shm: warning"])


def test_every_rank_runs_inside_the_image_on_slurm(slurm_cluster, image, tmp_path):
    (tmp_path / "job.py").write_text(INSIDE_JOB)
    spec = slurm_spec(slurm_cluster, tmp_path, script=str(tmp_path / "job.py"))
    data = yaml.safe_load(spec.read_text())
    data.update(python=PY, workdir=str(tmp_path), nproc_per_node=2, healthcheck={"sizes": ["64K"]},
                container={"image": image, "runtime": "podman"})
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    env = dict(launcher_env(tmp_path), **podman_env())  # srun --export=ALL: every step gets it
    args = ["up", str(spec), "--run-id", "ctr-slurm"]
    started.note(args)
    out = subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True, timeout=420,
                         cwd=ROOT, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "HEALTHCHECK OK world=4" in text
    assert sum(f"INSIDE=True rank={r} py={PY}" in text for r in range(4)) == 4, text
    assert containers_of("ctr-slurm") == []


def test_down_removes_the_containers_of_a_run_whose_launcher_is_frozen(sim_cluster, image, tmp_path):
    spec = container_spec(sim_cluster, tmp_path, image, TICK_JOB, n_hosts=2, nproc_per_node=1,
                          healthcheck={"enabled": False})
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "ctr-down"], tmp_path)
    read_until(proc, "tick", timeout=240)
    frozen = supervisor_pid(tmp_path, "ctr-down")
    os.kill(frozen, signal.SIGSTOP)  # the run's supervisor: its connections stay open, nothing hangs up
    try:
        # the podman clients die (as with a lost session): their containers run on without them
        run_dir = Path.home() / ".ddplaunch" / "runs" / "ctr-down"
        for pid_file in run_dir.glob("node*.pid"):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert len(containers_of("ctr-down")) == 2
        down = ddplaunch(["down", "ctr-down"], tmp_path, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        # the sim hosts share one podman storage: the first host's reaper removes both
        assert "removed 2 container(s)" in down.stdout, down.stdout
        assert containers_of("ctr-down") == [] and run_processes("ctr-down") == {}
        assert f"supervisor (pid {frozen}): frozen" in down.stdout
    finally:
        if os.path.exists(f"/proc/{frozen}"):
            os.kill(frozen, signal.SIGCONT)
        proc.wait(timeout=60)
