"""Real progress bars through `ddplaunch up` on real (simulated) hosts: rank 0 of a DDP job on 3
hosts draws a tqdm bar and writes a metrics dict every N steps through it — jobs/tqdm_train.py, a
plain loop that prints as Hugging Face's Trainer does, and jobs/hf_trainer.py, the Trainer itself
(a tiny GPT-2 from a config, 600 steps). The screen holds the job's own lines and a few states of
the bar — no ddplaunch marker, no empty or padding-only line, no line with two rank prefixes, no
ANSI or control character — and `ddplaunch logs` every line the job printed; over SSH and on Slurm."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ddplaunch.output.screen import screen_text
from tests.ssh_util import ROOT, ddplaunch, sim_spec

pytestmark = [pytest.mark.root, pytest.mark.slow]
STEPS, LOG_EVERY = 200, 20
JOB = {"script": "jobs/tqdm_train.py", "args": ["--steps", str(STEPS), "--log-every", str(LOG_EVERY)]}
HF_STEPS, HF_LOG_EVERY = 600, 1
HF_JOB = {"script": "jobs/hf_trainer.py",
          "args": ["--max-steps", str(HF_STEPS), "--logging-steps", str(HF_LOG_EVERY)]}


def test_a_tqdm_bar_and_its_logged_lines_read_as_they_would_on_one_host(sim_cluster, tmp_path):
    hosts = [h.name for h in sim_cluster.hosts][:3]
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=3, workdir=str(ROOT), nproc_per_node=1,
                    healthcheck={"enabled": False}, job=JOB)
    _readable(tmp_path, spec, hosts, "screen-tqdm")


#: One thread a rank: each sim host sees all of this machine's cores (ddplaunch gives a rank
#: cores / processes threads: 2) while 3 hosts share them; 3 ranks x 2 threads train 10x slower.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_hugging_faces_trainer_reads_as_it_would_on_one_host(sim_cluster, tmp_path):
    """The real Trainer (transformers, a test extra) on 3 SSH sim hosts, 600 steps, a dict of
    metrics every step: its bar a few states among them, at most ~2 screen lines a logged step,
    every line in `logs`, the same screen through `attach`."""
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=3, workdir=str(ROOT), nproc_per_node=1,
                    healthcheck={"enabled": False}, job=HF_JOB, env=ONE_THREAD)
    _trainer_readable(tmp_path, spec, [h.name for h in sim_cluster.hosts][:3], "screen-trainer")


def test_hugging_faces_trainer_on_slurm(slurm_cluster, tmp_path):
    _trainer_readable(tmp_path, _slurm_spec(slurm_cluster, tmp_path, HF_JOB, env=ONE_THREAD),
                      [h.name for h in slurm_cluster.hosts][:3], "screen-trainer-slurm")


def _trainer_readable(tmp_path: Path, spec: Path, hosts: list[str], run_id: str) -> None:
    """`up` the Trainer job and check its screen, its log and `attach` to it."""
    out, jobs = _up(tmp_path, spec, hosts, run_id)
    logged = [line for line in jobs if "'loss':" in line]
    assert [float(re.search(r"'epoch': '([\d.]+)'", line).group(1)) for line in logged] == \
        sorted(float(re.search(r"'epoch': '([\d.]+)'", line).group(1)) for line in logged)
    assert len(logged) == HF_STEPS // HF_LOG_EVERY, out.stdout[-3000:]
    bars = [line for line in jobs if re.search(r"\d+%\|", line)]
    assert bars and f"{HF_STEPS}/{HF_STEPS}" in bars[-1], bars
    # the job's other lines: the end's metrics, "done", a warning per rank from transformers
    assert len(jobs) <= 2 * len(logged) + 2 + 3 * 3, "\n".join(jobs)
    assert any(f"done: {HF_STEPS} steps" in line for line in jobs), "\n".join(jobs)
    logs = ddplaunch(["logs", run_id], tmp_path, timeout=60).stdout
    assert logs.count("'loss':") == len(logged) and "'train_runtime':" in logs
    assert logs.count("%|") > len(bars)  # every redraw of the bar
    # attach: the same screen (of a long one its first and newest lines, and how many it left out)
    attached = ddplaunch(["attach", run_id], tmp_path, timeout=60)
    again = _job_lines(attached.stdout, hosts)
    assert attached.returncode == 0 and again[:5] == jobs[:5] and again[-20:] == jobs[-20:], attached.stdout[-3000:]
    assert again == jobs or "lines not shown here" in attached.stdout


def test_the_same_on_slurm(slurm_cluster, tmp_path):
    _readable(tmp_path, _slurm_spec(slurm_cluster, tmp_path, JOB), [h.name for h in slurm_cluster.hosts][:3],
              "screen-tqdm-slurm")


def _slurm_spec(slurm_cluster, tmp_path: Path, job: dict, **keys) -> Path:
    data = yaml.safe_load(slurm_cluster.slurm.spec_path.read_text())
    data.pop("hosts", None)
    data.update(workdir=str(ROOT), nproc_per_node=1, healthcheck={"enabled": False}, job=job, **keys)
    data["slurm"].update(nodes=3, output_dir=str(tmp_path / "slurm-out"))
    spec = tmp_path / "slurm.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def _up(tmp_path: Path, spec: Path, hosts: list[str], run_id: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`up` a job that ends ok: its output, and the job's lines on its screen (checked)."""
    out = ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return out, _job_lines(out.stdout, hosts)


def _job_lines(stdout: str, hosts: list[str]) -> list[str]:
    """The job's lines on the screen, each checked: no marker, nothing empty, one prefix, no
    control character."""
    screen = stdout.splitlines()
    jobs = [line for line in screen if re.match(rf"\[(x\d+ ranks: )?({'|'.join(hosts)})", line)]
    assert not [line for line in screen if "DDPLAUNCH" in line], stdout[-3000:]
    assert not [line for line in jobs if not re.sub(r"^\[[^\]]*\] ?", "", line).strip()]  # nothing empty
    assert not [line for line in jobs if len(re.findall(rf"\[({'|'.join(hosts)}):\d+\]", line)) > 1]
    assert all(screen_text(line) == line for line in screen)  # no ANSI or control character
    return jobs


def _readable(tmp_path: Path, spec: Path, hosts: list[str], run_id: str) -> None:
    """`up` the tqdm job and check its screen and its log (the module's text)."""
    out, jobs = _up(tmp_path, spec, hosts, run_id)
    logged = [line for line in jobs if "'loss'" in line]
    assert [int(re.search(r"'step': (\d+)", line).group(1)) for line in logged] == \
        list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), out.stdout[-3000:]
    bars = [line for line in jobs if re.search(r"\d+%\|", line)]
    assert bars and f"{STEPS}/{STEPS}" in bars[-1] and len(bars) <= 2 + STEPS // LOG_EVERY, bars
    # every line the job printed is in the log, the bar's every redraw included
    logs = ddplaunch(["logs", run_id], tmp_path, timeout=60).stdout
    assert all(f"'step': {s}}}" in logs for s in range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert logs.count("%|") > len(bars) and "rank 2: done" in logs
