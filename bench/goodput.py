"""Goodput with a fault a minute: one training run meets a crash, a frozen host, a cut training
link and a straggler in turn; where its wall time went, side by side with an earlier commit.

Builds one `ddplaunch sim` cluster of 7 hosts (prefix dgp, 10.213.61.0/24): the run on hosts
1-3, hosts 4-7 its spares (recovery.max_host_failures: 4, evict_stragglers: true), the hang
timeout at its default. jobs/train.py steps every ~0.35 s (40 ms of CPU a step) with a checkpoint
every 10 steps. Each time rank 0 prints a step a multiple of --every past the first fault's
(`--every 150`: ~60 s of training), node 1's current host meets the next fault, in turn:

  crash     `sim fault --crash` (its link down, every process of it SIGKILLed)
  freeze    its processes of the run SIGSTOPped (a hung device; its host answers)
  cut       `sim fault --cut-training` (its training traffic dropped; sshd answers)
  straggler `sim fault --slow 25` (a quarter of a CPU for all of its processes)

Measured per run, from its own record (report/goodput.py's ledger): wall time, goodput, the
seconds per cause, and per fault the seconds from the fault to the first resumed step. Kinds run
interleaved: `ddplaunch` (this tree) and, with `--baseline REV`, `ddplaunch-REV` (a git worktree
of that commit). torchrun's elastic mode is not run here: a frozen host or a cut link leaves its
survivors in a collective until the job's own timeout (jobs/train.py: 300 s) — its crash figures
are bench/recovery.py's.

Needs root; tears its sim down at the end.
Usage: .venv/bin/python bench/goodput.py [--trials 1] [--every 150] [--baseline REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import recovery as rec  # noqa: E402  (bench/recovery.py: Lines, freeze, kill_tagged, worktree)

from ddplaunch.record.events import read_events  # noqa: E402
from ddplaunch.record.view import RunView  # noqa: E402
from ddplaunch.report.goodput import CAUSES, duration, ledger  # noqa: E402

PREFIX, SUBNET = "dgp", "10.213.61.0/24"
FAULTS = ("crash", "freeze", "cut", "straggler")
RELAUNCH_RE = re.compile(r"relaunching on (\S+), (\S+), (\S+)$")


def spec_for(cluster, work: Path, tag: str, steps: int) -> Path:
    import yaml

    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"]
    train = ["--epochs", "1", "--samples", str(steps * 8 * 3), "--batch-size", "8", "--ckpt-every", "10",
             "--log-every", "1", "--seed", "3", "--step-sleep", "0.3", "--burn-ms", "40"]
    data.update(hosts=hosts[:3], nproc_per_node=1, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                env={"DDPLAUNCH_CKPT_DIR": str(work / tag / "ckpt")}, job={"script": "jobs/train.py", "args": train},
                recovery={"max_host_failures": len(FAULTS), "spares": hosts[3:], "evict_stragglers": True})
    (work / tag).mkdir(parents=True, exist_ok=True)
    path = work / tag / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def inject(fault: str, cluster, tag: str, host: str) -> None:
    if fault == "crash":
        sim_fault(cluster, host, crash=True)
    elif fault == "freeze":
        rec.freeze(tag, host)
    elif fault == "cut":
        sim_fault(cluster, host, cut_training=True)
    else:
        sim_fault(cluster, host, slow=25)


def trial(kind: str, cluster, work: Path, n: int, env: dict, every: int, baseline: Optional[Path]) -> dict:
    tag = f"gp-{kind}-{n}"
    env = dict(env, DDPLAUNCH_HOME=str(work / "state" / tag))
    steps = every * (len(FAULTS) + 1)
    argv = [sys.executable, "-m", "ddplaunch", "up", str(spec_for(cluster, work, tag, steps)), "--run-id", tag]
    cwd = ROOT
    if kind != "ddplaunch":
        cwd, env = baseline, dict(env, PYTHONPATH=str(baseline))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    lines = rec.Lines(proc)
    node1 = cluster.hosts[1].name
    hit: list[str] = []
    row: dict = {"kind": kind, "trial": n, "faults": {}}
    try:
        for i, fault in enumerate(FAULTS):
            target = every * (i + 1)
            got = lines.wait(lambda line, at=target: (m := rec.STEP_RE.search(line)) is not None
                             and int(m.group(1)) >= at, 600)
            if got is None:
                row["error"] = f"never reached step {target} (fault {fault}):\n" + lines.text()[-2000:]
                break
            for _, line in list(lines.lines):  # node 1's host now: the newest relaunch's second host
                if (m := RELAUNCH_RE.search(line)) is not None:
                    node1 = m.group(2)
            inject(fault, cluster, tag, node1)
            hit.append(node1)
            row["faults"][fault] = {"host": node1, "at": time.time()}
        proc.wait(timeout=900)
        row["exit"] = proc.returncode
        view = RunView.of(read_events(Path(env["DDPLAUNCH_HOME"]) / "runs" / tag))
        spent = ledger(view)
        if spent is not None:
            row["wall_s"], row["goodput"] = round(spent.wall_s, 1), round(spent.goodput, 4)
            row["parts_s"] = {c: round(s, 1) for c, s in spent.parts.items()}
        for fault, said in row["faults"].items():
            mine = next((r for r in view.recoveries if said["host"] in r.lost and r.first_step_at), None)
            said["resumed_s"] = round(mine.first_step_at - said["at"], 1) if mine is not None else None
        row["sha"] = (rec.SHA_RE.findall(lines.text()) or [None])[-1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rec.kill_tagged(tag)
        for host in hit:
            sim_fault(cluster, host, clear=True)
    return row


def table(rows: list[dict]) -> str:
    out = ["| ddplaunch | runs | wall | goodput | " + " | ".join(CAUSES) + " | "
           + " | ".join(f"{f} → resumed (s)" for f in FAULTS) + " | exit |",
           "|---|---:|---:|---:|" + "---:|" * len(CAUSES) + "---:|" * len(FAULTS) + "---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind and "wall_s" in r]
        if not mine:
            out.append(f"| {kind} | 0 | - | - |" + " - |" * (len(CAUSES) + len(FAULTS)) + " - |")
            continue

        def med(values: list) -> str:
            values = [v for v in values if v is not None]
            return f"{statistics.median(values):.1f}" if values else "-"
        parts = [duration(statistics.median(r["parts_s"][c] for r in mine)) for c in CAUSES]
        resumed = [med([r["faults"].get(f, {}).get("resumed_s") for r in mine]) for f in FAULTS]
        out.append(f"| {kind} | {len(mine)} | {duration(statistics.median(r['wall_s'] for r in mine))} | "
                   f"**{100 * statistics.median(r['goodput'] for r in mine):.0f}%** | " + " | ".join(parts) + " | "
                   + " | ".join(resumed) + f" | {', '.join(str(r['exit']) for r in mine)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--every", type=int, default=150, help="steps of training between two faults")
    ap.add_argument("--baseline", metavar="REV", default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    global sim_fault
    from ddplaunch.sim import SimConfig, sim_down, sim_up
    from ddplaunch.sim.faults import sim_fault
    kinds = ["ddplaunch"] + ([f"ddplaunch-{args.baseline}"] if args.baseline else [])
    cluster = sim_up(SimConfig(n_hosts=7, prefix=PREFIX, subnet=SUBNET, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-goodput-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    baseline = work / "baseline"
    rows: list[dict] = []
    try:
        with rec.worktree(args.baseline, baseline):
            for n in range(args.trials):
                for kind in (kinds if n % 2 == 0 else kinds[::-1]):
                    row = trial(kind, cluster, work, n, env, args.every, baseline)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        sim_down(cluster.state_dir)
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
