"""`ddplaunch up` on 16 hosts reached directly vs all through one bastion (ProxyJump), same run.

Builds one `ddplaunch sim` cluster of 17 hosts (prefix dlb, 10.213.90.0/24): host 1 is the
bastion, hosts 2-17 run the job (1 rank each: a health check with a 64K all_reduce, then
jobs/toy_ddp.py). Interleaved (A B, B A, ...), `--trials` runs of each:

  direct   the hosts by address, as today
  bastion  the hosts by aliases of a test ssh config (a private HOME), every one `ProxyJump
           bastion`: one connection to the bastion carries every host's connection

Per run: wall time of `up`, the time to a healthy world (`HEALTHCHECK OK`: the connections, the
pre-flight and the health check before it), and the CPU the bastion's sshd spent (its master's
children, reaped: utime+stime+cutime+cstime of the sshd that serves the bastion, before and after).
Median of the trials. Needs root; tears its sim down at the end.
Usage: .venv/bin/python bench/bastion.py [--trials 3] [--hosts 16]
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

PREFIX, SUBNET = "dlb", "10.213.90.0/24"


def sshd_cpu_s(pid: int) -> float:
    """utime+stime+cutime+cstime of a process, in seconds (its reaped children included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def write_spec(cluster, work: Path, mode: str) -> tuple[Path, dict]:
    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"][1:]
    env = dict(os.environ, DDPLAUNCH_HOME=str(work / "state"), PYTHONUNBUFFERED="1")
    if mode == "bastion":
        home = work / "home"
        (home / ".ssh").mkdir(parents=True, exist_ok=True)
        bastion = cluster.hosts[0]
        text = f"Host bastion\n  HostName {bastion.addr}\n"
        for h in cluster.hosts[1:]:
            text += f"Host {h.name}\n  HostName {h.addr}\n  ProxyJump bastion\n"
        text += f"Host *\n  User root\n  IdentityFile {cluster.key}\n"
        (home / ".ssh" / "config").write_text(text)
        hosts = [h.name for h in cluster.hosts[1:]]
        data["ssh"] = {"known_hosts": str(cluster.known_hosts), "connect_timeout": data["ssh"]["connect_timeout"]}
        env["HOME"] = str(home)
    data.update(hosts=hosts, nproc_per_node=1, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                job={"script": "jobs/toy_ddp.py"})
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, env


def one_run(cluster, work: Path, mode: str, n: int) -> dict:
    spec, env = write_spec(cluster, work, mode)
    bastion_sshd = cluster.hosts[0].sshd_pid
    assert bastion_sshd is not None
    cpu0, t0 = sshd_cpu_s(bastion_sshd), time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", f"bench-{mode}-{n}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    job_at = None
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        out.append(line)
        if job_at is None and "HEALTHCHECK OK" in line:
            job_at = time.time() - t0
    proc.wait(timeout=600)
    wall = time.time() - t0
    time.sleep(0.5)  # the sessions' sshd children are reaped by now
    row = {"mode": mode, "trial": n, "exit": proc.returncode, "wall_s": round(wall, 2),
           "to_job_s": round(job_at, 2) if job_at else None, "bastion_cpu_s": round(sshd_cpu_s(bastion_sshd) - cpu0, 2)}
    if proc.returncode != 0:
        row["tail"] = "".join(out[-15:])
    return row


def table(rows: list[dict], hosts: int) -> str:
    def med(mode: str, key: str) -> str:
        values = [r[key] for r in rows if r["mode"] == mode and r.get(key) is not None and r["exit"] == 0]
        return f"{statistics.median(values):.2f}" if values else "-"
    lines = [f"`up` on {hosts} sim hosts x 1 rank (health check, then jobs/toy_ddp.py), median of "
             f"{len(rows) // 2} interleaved runs each",
             "| how the hosts are reached | wall (s) | to HEALTHCHECK OK (s) | bastion sshd CPU (s) | ok |",
             "|---|---:|---:|---:|---:|"]
    for mode, label in (("direct", "directly, by address"), ("bastion", "all through one bastion (ProxyJump)")):
        ok = sum(1 for r in rows if r["mode"] == mode and r["exit"] == 0)
        total = sum(1 for r in rows if r["mode"] == mode)
        lines.append(f"| {label} | {med(mode, 'wall_s')} | {med(mode, 'to_job_s')} | {med(mode, 'bastion_cpu_s')} "
                     f"| {ok}/{total} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--hosts", type=int, default=16)
    args = ap.parse_args()
    from ddplaunch.sim import SimConfig, sim_down, sim_up

    cluster = sim_up(SimConfig(n_hosts=args.hosts + 1, prefix=PREFIX, subnet=SUBNET, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-bastion-"))
    rows = []
    try:
        for n in range(args.trials):
            for mode in (("direct", "bastion") if n % 2 == 0 else ("bastion", "direct")):
                row = one_run(cluster, work, mode, n)
                print(row, flush=True)
                rows.append(row)
    finally:
        sim_down(cluster.state_dir)
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows, args.hosts))


if __name__ == "__main__":
    main()
