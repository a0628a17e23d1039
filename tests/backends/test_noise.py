"""Hosts whose login shell prints (rc files: conda, modules, banners, a racing `pyenv rehash`):
every answer ddplaunch parses is told apart from that noise, and the noise fails nothing."""

from __future__ import annotations

import json
import os
import signal

import yaml

from ddplaunch.sim import RC_NOISE_STDERR, RC_NOISE_STDOUT
from tests.ssh_util import ROOT, ddplaunch, popen_ddplaunch, read_until, run_processes, supervisor_pid, wait_for


def _spec(cluster, tmp_path, **overrides):
    data = yaml.safe_load(cluster.spec_path.read_text())
    data.update(workdir=str(ROOT), nproc_per_node=1, **overrides)
    path = tmp_path / "noisy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_and_down_survive_shell_noise(noisy_sim_cluster, tmp_path):
    from ddplaunch.sim.testing import ssh_run

    _, out = ssh_run(noisy_sim_cluster, noisy_sim_cluster.hosts[0].name, "echo hi")
    assert RC_NOISE_STDOUT in out and "hi" in out  # the bed really is noisy
    proc = ddplaunch(["check", str(_spec(noisy_sim_cluster, tmp_path, healthcheck={"sizes": ["64K"]})),
                      "--json"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["preflight"]["ok"] and summary["healthcheck"]["ok"]

    spec = _spec(noisy_sim_cluster, tmp_path, healthcheck={"enabled": False},
                 env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "ckpt")},
                 job={"script": "jobs/train.py", "args": ["--epochs", "50", "--step-sleep", "0.2"]})
    launcher = popen_ddplaunch(["up", str(spec), "--run-id", "noisy-down"], tmp_path)
    try:
        read_until(launcher, "step=", timeout=180)
        frozen = supervisor_pid(tmp_path, "noisy-down")
        os.kill(frozen, signal.SIGSTOP)  # the run's supervisor frozen: its connections stay open
        down = ddplaunch(["down", "noisy-down"], tmp_path, timeout=90)
        assert down.returncode == 0, down.stderr
        *hosts, last = down.stdout.splitlines()
        assert len(hosts) == 2 and all(": ended pids " in ln and RC_NOISE_STDERR not in ln for ln in hosts), hosts
        assert last == f"supervisor (pid {frozen}): frozen (stopped by a signal), killed once its " \
                       "hosts were cleaned"
        wait_for(lambda: run_processes("noisy-down") == {}, timeout=15)
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
