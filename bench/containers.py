"""What running every rank inside an image costs a launch: `ddplaunch up` bare vs in podman, same run.

Builds one `ddplaunch sim` cluster of 3 hosts (prefix dlc, 10.213.91.0/24) and the test image
(ddplaunch/sim/image.py: Debian + a venv with torch 2.13, cached after the first build), then
runs, interleaved (A B, B A, ...), `--trials` launches of each on 3 hosts x 2 ranks: the health
check (64K all_reduce), then jobs/toy_ddp.py:

  bare     torchrun from the launcher's venv on the hosts
  podman   `container: {image, runtime: podman}`: the pre-flight probes in the image, each node's
           torchrun in its own container (--network=host --ipc=host), removed on exit

Per launch: wall time of `up`, and the time to `HEALTHCHECK OK` (connections, pre-flight and
the health check before it). Median of the trials; the container's cost is the difference.
Needs root and podman; tears its sim down at the end (the image stays cached).
Usage: .venv/bin/python bench/containers.py [--trials 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX, SUBNET = "dlc", "10.213.91.0/24"


def write_spec(cluster, work: Path, mode: str, image: str) -> Path:
    from ddplaunch.sim.image import IMAGE_VENV

    data = yaml.safe_load(cluster.spec_path.read_text())
    data.update(nproc_per_node=2, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                job={"script": "jobs/toy_ddp.py"})
    if mode == "podman":
        data.update(python=f"{IMAGE_VENV}/bin/python", container={"image": image, "runtime": "podman"})
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_run(cluster, work: Path, mode: str, n: int, image: str) -> dict:
    spec = write_spec(cluster, work, mode, image)
    env = dict(os.environ, DDPLAUNCH_HOME=str(work / "state"), PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", f"bench-{mode}-{n}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    healthy, out = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if healthy is None and "HEALTHCHECK OK" in line:
            healthy = time.time() - t0
    proc.wait(timeout=600)
    row = {"mode": mode, "trial": n, "exit": proc.returncode, "wall_s": round(time.time() - t0, 2),
           "healthy_s": round(healthy, 2) if healthy else None}
    if proc.returncode != 0:
        row["tail"] = "".join(out[-15:])
    return row


def table(rows: list[dict]) -> str:
    def med(mode: str, key: str) -> float:
        values = [r[key] for r in rows if r["mode"] == mode and r["exit"] == 0 and r.get(key) is not None]
        return statistics.median(values) if values else float("nan")
    lines = [f"`up` on 3 sim hosts x 2 ranks (health check, then jobs/toy_ddp.py), median of "
             f"{len(rows) // 2} interleaved launches each",
             "| ranks run | wall (s) | to HEALTHCHECK OK (s) | ok |", "|---|---:|---:|---:|"]
    for mode, label in (("bare", "bare, the hosts' venv"), ("podman", "in the image (podman, cached image)")):
        ok = sum(1 for r in rows if r["mode"] == mode and r["exit"] == 0)
        lines.append(f"| {label} | {med(mode, 'wall_s'):.2f} | {med(mode, 'healthy_s'):.2f} | "
                     f"{ok}/{sum(1 for r in rows if r['mode'] == mode)} |")
    lines.append(f"container cost per launch: {med('podman', 'wall_s') - med('bare', 'wall_s'):+.2f} s wall, "
                 f"{med('podman', 'healthy_s') - med('bare', 'healthy_s'):+.2f} s to a healthy world")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    from ddplaunch.sim import SimConfig, sim_down, sim_up
    from ddplaunch.sim.image import ensure_test_image

    image = ensure_test_image()
    cluster = sim_up(SimConfig(n_hosts=3, prefix=PREFIX, subnet=SUBNET, nproc_per_node=2, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-containers-"))
    rows = []
    try:
        for n in range(args.trials):
            for mode in (("bare", "podman") if n % 2 == 0 else ("podman", "bare")):
                row = one_run(cluster, work, mode, n, image)
                print(row, flush=True)
                rows.append(row)
    finally:
        sim_down(cluster.state_dir)
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()
