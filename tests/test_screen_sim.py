"""A real progress bar through `ddplaunch up` on real (simulated) hosts: rank 0 of a DDP job on 3
hosts draws a tqdm bar and writes a metrics dict every 20 steps through it, as Hugging Face's
Trainer does (jobs/tqdm_train.py). The screen holds the job's own lines and a few states of the
bar — no ddplaunch marker, no empty or padding-only line, no line with two rank prefixes, no
ANSI or control character — and `ddplaunch logs` every line the job printed; over SSH and on Slurm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ddplaunch.output.screen import screen_text
from tests.ssh_util import ROOT, ddplaunch, sim_spec

pytestmark = [pytest.mark.root, pytest.mark.slow]
STEPS, LOG_EVERY = 200, 20
JOB = {"script": "jobs/tqdm_train.py", "args": ["--steps", str(STEPS), "--log-every", str(LOG_EVERY)]}


def test_a_tqdm_bar_and_its_logged_lines_read_as_they_would_on_one_host(sim_cluster, tmp_path):
    hosts = [h.name for h in sim_cluster.hosts][:3]
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=3, workdir=str(ROOT), nproc_per_node=1,
                    healthcheck={"enabled": False}, job=JOB)
    _readable(tmp_path, spec, hosts, "screen-tqdm")


def test_the_same_on_slurm(slurm_cluster, tmp_path):
    data = yaml.safe_load(slurm_cluster.slurm.spec_path.read_text())
    data.pop("hosts", None)
    data.update(workdir=str(ROOT), nproc_per_node=1, healthcheck={"enabled": False}, job=JOB)
    data["slurm"].update(nodes=3, output_dir=str(tmp_path / "slurm-out"))
    spec = tmp_path / "slurm.yaml"
    spec.write_text(yaml.safe_dump(data))
    _readable(tmp_path, spec, [h.name for h in slurm_cluster.hosts][:3], "screen-tqdm-slurm")


def _readable(tmp_path: Path, spec: Path, hosts: list[str], run_id: str) -> None:
    """`up` the tqdm job and check its screen and its log (the module's text)."""
    out = ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    screen = out.stdout.splitlines()
    jobs = [line for line in screen if re.match(rf"\[(x\d+ ranks: )?({'|'.join(hosts)})", line)]
    assert not [line for line in screen if "DDPLAUNCH" in line], out.stdout[-3000:]
    assert not [line for line in jobs if not re.sub(r"^\[[^\]]*\] ?", "", line).strip()]  # nothing empty
    assert not [line for line in jobs if len(re.findall(rf"\[({'|'.join(hosts)}):\d+\]", line)) > 1]
    assert all(screen_text(line) == line for line in screen)  # no ANSI or control character
    logged = [line for line in jobs if "'loss'" in line]
    assert [int(re.search(r"'step': (\d+)", line).group(1)) for line in logged] == \
        list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), out.stdout[-3000:]
    bars = [line for line in jobs if re.search(r"\d+%\|", line)]
    assert bars and f"{STEPS}/{STEPS}" in bars[-1] and len(bars) <= 2 + STEPS // LOG_EVERY, bars
    # every line the job printed is in the log, the bar's every redraw included
    logs = ddplaunch(["logs", run_id], tmp_path, timeout=60).stdout
    assert all(f"'step': {s}}}" in logs for s in range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert logs.count("%|") > len(bars) and "rank 2: done" in logs
