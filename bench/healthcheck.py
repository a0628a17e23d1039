"""The health check's bus bandwidth against independent measurements, on two sim hosts.

One run, interleaved: `ddplaunch check` (ddplaunch/healthcheck.py, one rank per host) and an
independent all_reduce loop (bench/allreduce_loop.py, launched on the same hosts), both at large
sizes, plus iperf3 between the two hosts as the link's limit. Target: the health check within
10 % of the independent loop. Needs root; builds and removes its own sim cluster (prefix dlh).
Usage: .venv/bin/python bench/healthcheck.py [--repeats 3]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.sim import SimConfig, sim_down, sim_up  # noqa: E402

SIZES = [16 << 20, 64 << 20]
ITERS = 10


def ddplaunch(args, env):
    proc = subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.exit(f"ddplaunch {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def iperf3(cluster):
    a, b = cluster.hosts[0], cluster.hosts[1]
    server = subprocess.Popen(cluster.exec_argv(a, ["iperf3", "-s", "-1", "-B", a.addr]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            out = subprocess.run(cluster.exec_argv(b, ["iperf3", "-c", a.addr, "-t", "3", "-J"]),
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
        sys.exit("iperf3 did not connect")
    finally:
        server.kill()
        server.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-hc-"))
    cluster = sim_up(SimConfig(n_hosts=2, prefix="dlh", subnet="10.213.12.0/24", state_dir=state))
    env = dict(os.environ, DDPLAUNCH_HOME=str(state / "home"))
    try:
        spec = yaml.safe_load(cluster.spec_path.read_text())
        spec.update(nproc_per_node=1, preflight={"enabled": False},
                    healthcheck={"sizes": SIZES, "iterations": ITERS},
                    job={"script": "bench/allreduce_loop.py",
                         "args": ["--sizes", ",".join(map(str, SIZES)), "--iters", str(ITERS)]})
        path = state / "bench.yaml"
        path.write_text(yaml.safe_dump(spec))
        hc = {s: [] for s in SIZES}
        loop = {s: [] for s in SIZES}
        for _ in range(args.repeats):
            summary = json.loads(ddplaunch(["check", str(path), "--json"], env))
            for row in summary["healthcheck"]["bandwidth"]:
                hc[row["bytes"]].append(row["busbw_gbps"])
            out = ddplaunch(["up", str(path), "--skip-healthcheck"], env)
            for size, bw in re.findall(r"LOOP bytes=(\d+) busbw_gbps=([\d.]+)", out):
                loop[int(size)].append(float(bw))
        link = iperf3(cluster)
        print(f"{'size':>8} {'healthcheck GB/s':>17} {'independent loop GB/s':>22} {'hc/loop':>8} "
              f"{'iperf3 link GB/s':>17}")
        for size in SIZES:
            h, l = statistics.median(hc[size]), statistics.median(loop[size])
            print(f"{size >> 20:>6}Mi {h:>17.3f} {l:>22.3f} {h / l:>8.2f} {link:>17.2f}")
        print(f"(2 sim hosts x 1 rank, Gloo, median of {args.repeats} interleaved runs, {ITERS} iterations "
              "per size; iperf3: one TCP stream for 3 s)")
    finally:
        sim_down(state, prefix="dlh", purge=True)


if __name__ == "__main__":
    main()
