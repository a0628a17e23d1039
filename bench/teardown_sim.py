"""A finished job is reported finished: jobs/teardown_repro.py N times on 3 sim hosts x 2 ranks
through `ddplaunch up`, interleaved with N bare `torchrun --standalone` runs of 6 ranks of the same
script; counts runs reported ok and ranks that aborted at exit (SIGABRT) each way.

    .venv/bin/python bench/teardown_sim.py [--runs 10]      # needs root (ddplaunch sim)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ddplaunch.sim import SimConfig, sim_down, sim_up  # noqa: E402

ABORT_RE = re.compile(r"exitcode\s*:\s*-6\b|killed by SIGABRT|terminate called without an active exception")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-teardown-"))
    cluster = sim_up(SimConfig(n_hosts=3, prefix="dtd", subnet="10.213.60.0/24", state_dir=work / "sim",
                               workdir=ROOT))
    try:
        spec = yaml.safe_load(cluster.spec_path.read_text())
        spec.update(healthcheck={"enabled": False}, job={"script": "jobs/teardown_repro.py"})
        path = work / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        env = dict(os.environ, DDPLAUNCH_HOME=str(work / "state"))
        rows = {"ddplaunch up (3 hosts x 2)": [0, 0], "bare torchrun (6 ranks)": [0, 0]}
        for i in range(args.runs):
            up = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(path), "-v"], capture_output=True,
                                text=True, timeout=600, cwd=ROOT, env=env)
            rows["ddplaunch up (3 hosts x 2)"][0] += up.returncode == 0
            rows["ddplaunch up (3 hosts x 2)"][1] += len(ABORT_RE.findall(up.stdout + up.stderr))
            bare = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", "6", "jobs/teardown_repro.py"], capture_output=True,
                                  text=True, timeout=600, cwd=ROOT, env=env)
            rows["bare torchrun (6 ranks)"][0] += bare.returncode == 0
            rows["bare torchrun (6 ranks)"][1] += len(ABORT_RE.findall(bare.stdout + bare.stderr))
            print(f"run {i + 1}: up exit {up.returncode}, bare exit {bare.returncode}", flush=True)
        print("\n| launch | runs | reported ok | aborts at exit seen |\n|---|---:|---:|---:|")
        for name, (ok, aborts) in rows.items():
            print(f"| {name} | {args.runs} | {ok} | {aborts} |")
    finally:
        sim_down(cluster.state_dir, purge=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
