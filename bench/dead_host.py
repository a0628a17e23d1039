"""What `ddplaunch check` on 4 sim hosts costs, all up vs one host bad: dead, or slow.

Builds one `ddplaunch sim` cluster of 4 hosts (prefix dld, 10.213.92.0/24) and runs, interleaved
(A B C, C B A, ...), `--trials` of `ddplaunch check --json` (pre-flight, then the health check)
with host 3:

  healthy     up
  sshd_stop   its sshd stopped (the connection is refused at once)
  down        its link down (no answer: the spec's `ssh.connect_timeout`, 5 s in the sim's spec)
  slow        its link rate-limited to 1 Gbit/s (`sim fault --rate 1gbit`): named by the pair gate

`--healthcheck quick` (default) checks a 64K all_reduce; `sim` keeps the sim spec's own health
check (4K and 8M, pair tests of 16M: the pair gate that names a slow host). Per run: the
pre-flight's own `elapsed_s` from the JSON summary, and the wall time of `check` (a failed
pre-flight stops there; a healthy one goes on to the health check). Median (min-max).
Needs root; tears its sim down at the end.
Usage: .venv/bin/python bench/dead_host.py [--trials 3] [--healthcheck quick|sim] [--faults healthy,down]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX, SUBNET = "dld", "10.213.92.0/24"
FAULTS = ("healthy", "sshd_stop", "down", "slow")


def one(cluster, spec: Path, work: Path, fault: str) -> dict:
    from ddplaunch.sim.faults import sim_fault

    victim = cluster.hosts[2].name
    if fault != "healthy":
        sim_fault(cluster, victim, **({"rate": "1gbit"} if fault == "slow" else {fault: True}))
    try:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "ddplaunch", "check", str(spec), "--json"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, DDPLAUNCH_HOME=str(work / "state")))
        wall = time.monotonic() - t0
    finally:
        if fault != "healthy":
            sim_fault(cluster, victim, clear=True)
    summary = json.loads(proc.stdout)
    found = summary["localization"]["bad_hosts"] if fault == "slow" else summary["preflight"]["bad_hosts"]
    named = found == ([] if fault == "healthy" else [victim])
    return {"fault": fault, "wall_s": wall, "preflight_s": summary["preflight"]["elapsed_s"],
            "exit": proc.returncode, "named": named}


def table(rows: list[dict], faults: list[str]) -> str:
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
    lines = ["| host 3 | runs | pre-flight (s) | `check` wall (s) | right hosts named |", "|---|---:|---:|---:|---:|"]
    for fault in faults:
        mine = [r for r in rows if r["fault"] == fault]
        lines.append(f"| {fault} | {len(mine)} | {med([r['preflight_s'] for r in mine])} | "
                     f"{med([r['wall_s'] for r in mine])} | {sum(r['named'] for r in mine)}/{len(mine)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--healthcheck", choices=("quick", "sim"), default="quick")
    ap.add_argument("--faults", default=",".join(FAULTS[:3]), help=f"a comma-separated subset of {FAULTS}")
    args = ap.parse_args()
    faults = args.faults.split(",")
    if set(faults) - set(FAULTS):
        ap.error(f"--faults: {sorted(set(faults) - set(FAULTS))} unknown; choose from {FAULTS}")
    from ddplaunch.sim import SimConfig, sim_down, sim_up

    cluster = sim_up(SimConfig(n_hosts=4, prefix=PREFIX, subnet=SUBNET, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-dead-"))
    try:
        data = yaml.safe_load(cluster.spec_path.read_text())
        data["workdir"] = str(ROOT)
        if args.healthcheck == "quick":
            data["healthcheck"] = {"sizes": ["64K"], "iterations": 2}
        spec = work / "cluster.yaml"
        spec.write_text(yaml.safe_dump(data))
        rows = []
        for trial in range(args.trials):
            for fault in (faults if trial % 2 == 0 else faults[::-1]):
                rows.append(one(cluster, spec, work, fault))
                print(json.dumps(rows[-1]), flush=True)
        print(table(rows, faults))
    finally:
        sim_down(cluster.state_dir, prefix=PREFIX)


if __name__ == "__main__":
    main()
