"""No false hang in a healthy run that pauses: a 10-minute training run on 3 SSH sim hosts and a
spare (recovery on, `job.hang_timeout` at its default), every rank silent for `--pause-s` (20 s: an
evaluation between steps) every `--pause-every-s` (2 minutes of training). The hang watch suspects
a silence at the job's pace (10 of its steps, 4 s at least) and runs a link test; one that finds
every link fine ends nothing, and the next waits twice as long. Says: how the run ended, its wall
time, the pauses, the suspicions (each one link test, each said in the run's log) and anything a
pause ended or named (a hang, a lost host, a straggler).

Builds one `ddplaunch sim` cluster of 4 hosts (prefix dps, 10.213.62.0/24); jobs/train.py steps
every ~0.35 s (40 ms of CPU and a 0.3 s sleep). Needs root; tears its sim down at the end.
Usage: .venv/bin/python bench/pauses.py [--minutes 10] [--pause-every-s 120] [--pause-s 20]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.record.events import read_events  # noqa: E402
from ddplaunch.record.view import RunView  # noqa: E402

PREFIX, SUBNET = "dps", "10.213.62.0/24"
#: Seconds a step of the job below takes on the sim (measured by bench/goodput.py's runs).
STEP_S = 0.35
SUSPECTED_RE = re.compile(r"^\[ddplaunch\] the job silent (\d+)s \((\d+) of its steps\): a link test found no host",
                          re.M)
HANG_RE = re.compile(r"\bhang\b")


def spec_for(cluster, work: Path, args: argparse.Namespace) -> tuple[Path, int, int]:
    """The spec, its steps and the steps between two pauses."""
    import yaml

    pauses = int(args.minutes * 60 // args.pause_every_s) - 1
    steps = int((args.minutes * 60 - pauses * args.pause_s) / STEP_S)
    every = int(args.pause_every_s / STEP_S)
    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"]
    train = ["--epochs", "1", "--samples", str(steps * 8 * 3), "--batch-size", "8", "--ckpt-every", "50",
             "--log-every", "10", "--seed", "3", "--step-sleep", "0.3", "--burn-ms", "40",
             "--pause-every", str(every), "--pause-s", str(args.pause_s)]
    data.update(hosts=hosts[:3], nproc_per_node=1, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                env={"DDPLAUNCH_CKPT_DIR": str(work / "ckpt")}, job={"script": "jobs/train.py", "args": train},
                recovery={"max_host_failures": 1, "spares": hosts[3:]})
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, steps, every


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--pause-every-s", type=float, default=120.0)
    ap.add_argument("--pause-s", type=float, default=20.0)
    args = ap.parse_args()
    from ddplaunch.sim import SimConfig, sim_down, sim_up

    cluster = sim_up(SimConfig(n_hosts=4, prefix=PREFIX, subnet=SUBNET, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-pauses-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", DDPLAUNCH_HOME=str(work / "state"))
    try:
        spec, steps, every = spec_for(cluster, work, args)
        started = time.time()
        up = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", "pauses"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=args.minutes * 60 * 3)
        wall = time.time() - started
        view = RunView.of(read_events(work / "state" / "runs" / "pauses"))
        logged = (work / "state" / "runs" / "pauses" / "output.log").read_text()
    finally:
        sim_down(cluster.state_dir)
    suspected = SUSPECTED_RE.findall(logged)
    print(up.stdout[-1500:])
    print("| run | wall | steps | pauses | suspicions (link tests, all fine) | hang | hosts lost | stragglers | exit |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    print(f"| {view.state} | {wall / 60:.1f} min | {steps} | {(steps - 1) // every} x {args.pause_s:g} s | "
          f"{len(suspected)} (after {', '.join(s + ' s' for s, _ in suspected) or '-'}) | "
          f"{'yes' if HANG_RE.search(up.stdout) else 'no'} | {sum(len(r.lost) for r in view.recoveries)} | "
          f"{len(view.stragglers)} | {up.returncode} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
