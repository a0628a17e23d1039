"""Submit -> first training step on Slurm: ddplaunch vs a hand-written sbatch of the same job.

Each variant runs jobs/train.py (2 nodes x 2 procs, one logged step) `--reps` times, alternating;
the time is from the submit command's start to the first `step=1` line in the job's output.
Without `--spec` a sim Slurm cluster (prefix dlb, 10.213.11.0/24) is brought up and down.

    .venv/bin/python bench/slurm_latency.py [--spec cluster-slurm.yaml] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ARGS = ["--epochs", "1", "--steps-per-epoch", "2", "--log-every", "1", "--ckpt-every", "0"]
HAND_SBATCH = """#!/bin/bash
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
{partition}
MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun bash -c "{python} -m torch.distributed.run --nnodes=$SLURM_NNODES --node-rank=\\$SLURM_NODEID \\
  --nproc-per-node={nproc} --master-addr=$MASTER --master-port=$((20000 + SLURM_JOB_ID % 6000 * 2 + 1)) \\
  jobs/train.py {args}"
"""


def wait_line(path: Path, needle: str, t0: float, timeout: float = 300) -> float:
    while time.perf_counter() - t0 < timeout:
        if path.exists() and needle in path.read_text(errors="replace"):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise TimeoutError(f"{needle!r} not in {path} after {timeout}s")


def wait_gone(env: dict, job: str) -> None:
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env,
                         timeout=30).stdout.strip():
        time.sleep(0.2)


def run_ddplaunch(spec: Path, work: Path, env: dict, healthcheck: bool, ckpt: Path) -> float:
    log = work / f"ddp-{time.monotonic_ns()}.log"
    args = [sys.executable, "-m", "ddplaunch", "up", str(spec)] + ([] if healthcheck else ["--skip-healthcheck"])
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(args + ["--", *TRAIN_ARGS, "--ckpt-dir", str(ckpt)], stdout=f,
                                stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        took = wait_line(log, "step=1 ", t0)
        proc.wait(timeout=300)
    return took


def run_hand(data: dict, work: Path, env: dict, ckpt: Path) -> float:
    out = work / f"hand-{time.monotonic_ns()}.out"
    script = work / "hand.sbatch"
    s = data["slurm"]
    script.write_text(HAND_SBATCH.format(
        nodes=s["nodes"], out=out, python=data["python"], nproc=data["nproc_per_node"],
        partition=f"#SBATCH --partition={s['partition']}" if s.get("partition") else "",
        args=" ".join(TRAIN_ARGS + ["--ckpt-dir", str(ckpt)])))
    t0 = time.perf_counter()
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=30, check=True).stdout.strip()
    took = wait_line(out, "step=1 ", t0)
    wait_gone(env, job)
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, help="a backend: slurm cluster spec [default: a fresh sim]")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    sim = None
    if args.spec is None:
        sim = ["--prefix", "dlb"]
        subprocess.run([sys.executable, "-m", "ddplaunch", "sim", "up", "--slurm", "--hosts", "3", *sim,
                        "--subnet", "10.213.11.0/24", "--workdir", str(ROOT)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        args.spec = Path("/tmp/ddplaunch-sim-dlb/cluster-slurm.yaml")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            data = yaml.safe_load(args.spec.read_text())
            data["workdir"] = str(ROOT)
            data["job"] = {"script": "jobs/train.py"}
            data.setdefault("slurm", {})["output_dir"] = str(work / "out")
            spec = work / "spec.yaml"
            spec.write_text(yaml.safe_dump(data))
            env = dict(os.environ, DDPLAUNCH_HOME=str(work / "state"), PYTHONUNBUFFERED="1")
            if data["slurm"].get("conf"):
                env["SLURM_CONF"] = data["slurm"]["conf"]
            times: dict[str, list[float]] = {"hand-written sbatch": [], "ddplaunch --skip-healthcheck": [],
                                             "ddplaunch (health check first)": []}
            for rep in range(args.reps):
                times["hand-written sbatch"].append(run_hand(data, work, env, work / f"c{rep}a"))
                times["ddplaunch --skip-healthcheck"].append(run_ddplaunch(spec, work, env, False, work / f"c{rep}b"))
                times["ddplaunch (health check first)"].append(run_ddplaunch(spec, work, env, True, work / f"c{rep}c"))
    finally:
        if sim:
            subprocess.run([sys.executable, "-m", "ddplaunch", "sim", "down", *sim], cwd=ROOT,
                           stdout=subprocess.DEVNULL)
    nodes, nproc = data["slurm"]["nodes"], data["nproc_per_node"]
    print(f"submit -> first training step, jobs/train.py on {nodes} nodes x {nproc} procs, {args.reps} runs each")
    print(f"{'variant':<34}{'median s':>10}{'min s':>9}{'max s':>9}")
    for name, values in times.items():
        print(f"{name:<34}{statistics.median(values):>10.2f}{min(values):>9.2f}{max(values):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
