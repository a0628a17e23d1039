"""Fan-out latency of ddplaunch's SSH layer on sim hosts, side by side in one run.

For 1, 4 and 16 hosts of a `ddplaunch sim` cluster: wall time to connect and run `true` on every
host through ddplaunch's SshBackend (parallel Fabric connections, host keys verified) vs a
sequential `ssh host true` loop (OpenSSH client, one host after another). Needs root; builds and
removes its own sim cluster (prefix dlb, 10.213.11.0/24).
Usage: .venv/bin/python bench/fanout.py [--repeats 3]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddplaunch.backends.ssh import SshBackend  # noqa: E402
from ddplaunch.sim import SimConfig, sim_down, sim_up  # noqa: E402
from ddplaunch.spec.load import load_spec  # noqa: E402

SIZES = (1, 4, 16)


def busy_cpu_seconds():
    """CPU-seconds the whole machine has spent busy (all processes, all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def via_ddplaunch(spec, cpu):
    backend = SshBackend(spec)
    c0, t0 = busy_cpu_seconds(), time.perf_counter()
    results = backend.probe(lambda host: "true", timeout=30)
    took = time.perf_counter() - t0
    cpu.append(busy_cpu_seconds() - c0)
    backend.close()
    bad = [str(err or res) for _, res, err in results if err or res[0] != 0]
    if bad:
        sys.exit(f"fan-out failed: {bad}")
    return took


def via_ssh_loop(cluster, hosts):
    t0 = time.perf_counter()
    for h in hosts:
        subprocess.run(["ssh", "-i", str(cluster.key), "-o", f"UserKnownHostsFile={cluster.known_hosts}",
                        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{h.addr}", "true"],
                       check=True, timeout=30, capture_output=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-fanout-"))
    cluster = sim_up(SimConfig(n_hosts=max(SIZES), prefix="dlb", subnet="10.213.11.0/24", state_dir=state))
    try:
        full = load_spec(cluster.spec_path)
        rows = []
        for n in SIZES:
            spec = full.model_copy(update={"hosts": full.hosts[:n]})
            cpu: list[float] = []
            ours = [via_ddplaunch(spec, cpu) for _ in range(args.repeats)]
            loop = [via_ssh_loop(cluster, cluster.hosts[:n]) for _ in range(args.repeats)]
            rows.append((n, statistics.median(ours), statistics.median(loop), statistics.median(cpu)))
        t1_ours, t1_loop = rows[0][1], rows[0][2]
        cores = os.cpu_count()
        print(f"{'hosts':>5} {'ddplaunch s':>12} {'t(n)/t(1)':>10} {'ssh loop s':>11} {'t(n)/t(1)':>10} "
              f"{'busy CPU-s':>11} {'CPU-s/cores':>12}")
        for n, ours, loop, cpu_s in rows:
            print(f"{n:>5} {ours:>12.3f} {ours / t1_ours:>10.2f} {loop:>11.3f} {loop / t1_loop:>10.2f} "
                  f"{cpu_s:>11.2f} {cpu_s / cores:>12.2f}")
        print(f"(median of {args.repeats}; connect + `true` on every host; all sim hosts share this "
              f"machine's {cores} cores, so the parallel fan-out is bounded by busy CPU-s / cores)")
    finally:
        sim_down(state, prefix="dlb", purge=True)


if __name__ == "__main__":
    main()
