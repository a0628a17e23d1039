"""The screen of a Hugging Face Trainer run whose host crashes, from a real run: `ddplaunch up` in tmux.

Builds a 4-host sim cluster (prefix ddh, 10.213.63.0/24: 3 hosts and a spare), runs
jobs/hf_trainer.py on it (1 rank per host, a checkpoint every 200 steps in a shared directory, the
Trainer's own resume from the newest) in a tmux pane of 150 x 45, crashes host 2 once the
checkpoint of step 400 is written, lets recovery put the spare in its place and the run end, and
writes the pane (its scrollback included) to docs/trainer-crash.txt. Needs root, tmux and the test
extra (`pip install -e '.[test]'`: transformers, accelerate).
Usage: .venv/bin/python scripts/doc_trainer_crash.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.sim import SimConfig, sim_down, sim_up  # noqa: E402
from ddplaunch.sim.faults import sim_fault  # noqa: E402
from ddplaunch.sim.proc import wait_until  # noqa: E402

RUN_ID = "trainer-crash-demo"
SESSION = "ddpl-trainer"


def wait(pred, timeout: float, what: str) -> None:
    if not wait_until(pred, timeout, interval=0.5):
        raise SystemExit(f"timed out waiting for {what}")


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ddpl-docshots-"))
    ckpt = tmp / "ckpt"
    cluster = sim_up(SimConfig(n_hosts=4, prefix="ddh", subnet="10.213.63.0/24", state_dir=tmp / "sim",
                               workdir=ROOT, nproc_per_node=1))
    done = tmp / "exit-code"
    try:
        data = yaml.safe_load(cluster.spec_path.read_text())
        hosts = data["hosts"]
        data.update(hosts=hosts[:3], workdir=str(ROOT), nproc_per_node=1, env={"OMP_NUM_THREADS": "1"},
                    recovery={"max_host_failures": 1, "spares": [hosts[3]]},
                    job={"script": "jobs/hf_trainer.py",
                         "args": ["--max-steps", "1200", "--logging-steps", "100", "--save-steps", "200",
                                  "--output-dir", str(ckpt)]})
        spec = tmp / "cluster.yaml"
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        up = (f"cd {shlex.quote(str(ROOT))} && DDPLAUNCH_HOME={shlex.quote(str(tmp / 'state'))} "
              f"{shlex.quote(sys.executable)} -m ddplaunch up {shlex.quote(str(spec))} --run-id {RUN_ID}; "
              f"echo $? > {shlex.quote(str(done))}; sleep 600")
        subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "150", "-y", "45", up], check=True)
        subprocess.run(["tmux", "set-option", "-t", SESSION, "history-limit", "5000"], check=True)
        wait(lambda: (ckpt / "checkpoint-400" / "trainer_state.json").exists(), 600, "the checkpoint of step 400")
        sim_fault(cluster, cluster.hosts[1].name, crash=True)
        wait(done.exists, 600, "the run's end")
        shot = subprocess.run(["tmux", "capture-pane", "-p", "-S", "-", "-t", SESSION], capture_output=True,
                              text=True, check=True).stdout
        (ROOT / "docs" / "trainer-crash.txt").write_text(shot.rstrip() + "\n")
        print(f"run ended with exit code {done.read_text().strip()}; wrote docs/trainer-crash.txt")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], check=False)
        sim_fault(cluster, cluster.hosts[1].name, clear=True)
        sim_down(tmp / "sim")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
