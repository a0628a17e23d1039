"""The saver's host crashed: the memory tier against disk checkpoints, interleaved, on sim hosts.

Builds one `ddplaunch sim` cluster of 4 hosts (prefix dlb, 10.213.45.0/24 by default): the run on
hosts 1-3, host 4 its spare (recovery.max_host_failures: 1). Each trial runs jobs/train.py (a
checkpoint every 4 steps, a step every ~0.3 s) with one of two tiers, interleaved (A B, B A, ...):

  memory  `checkpoint: {tier: memory, replicas: 1}`, train.py --ckpt-api (ddplaunch.checkpoint:
          saves land in host RAM, a buddy copy on the next host, persisted in the background)
  disk    `checkpoint: {tier: disk}`, train.py's own torch.save + fsync + rename into the dir

Host 1 (rank 0's, the saver's) crashes (`sim fault --crash`: its link down, every process
SIGKILLed, its memory tier emptied) 2-3 steps after a save of step 8, 12 or 16 (drawn per trial:
the fault is injected once rank 0 printed the save's step + 2; a step in flight may still end).
Per trial, from the run's record (its event log's fold: RunView, report/goodput.py's ledger):
crash -> first resumed step, where the checkpoint was read from, the step resumed from,
the steps redone (the last step rank 0 printed before the relaunch minus that step), the ledger's
`checkpoint` and `redone` seconds, and whether the final weights equal an uninterrupted run's.

Needs root; tears its sim down at the end.
Usage: .venv/bin/python bench/ckpt_crash.py [--trials 3] [--tiers memory,disk] [--json out.json]
       [--prefix dlb --subnet 10.213.45.0/24]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import recovery as rec  # noqa: E402  (bench/recovery.py: Lines, kill_tagged, the step/resume/weights lines)

from ddplaunch.record.events import read_events  # noqa: E402
from ddplaunch.record.view import RunView  # noqa: E402
from ddplaunch.report.goodput import ledger  # noqa: E402

EVERY = 4
SAVES = (8, 12, 16)
TRAIN = ["--epochs", "1", "--samples", "1152", "--batch-size", "8", "--ckpt-every", str(EVERY), "--log-every", "1",
         "--seed", "3", "--step-sleep", "0.3"]


def spec_for(cluster, work: Path, tag: str, tier: str, spare: bool = True) -> Path:
    """train.py on hosts 1-3 (host 4 the spare), its checkpoints in `tier` under work/tag/ckpt."""
    import yaml

    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"]
    section: dict = {"path": str(work / tag / "ckpt"), "tier": tier}
    if tier == "memory":
        section["replicas"] = 1
    data.update(hosts=hosts[:3], nproc_per_node=1, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                checkpoint=section,
                job={"script": "jobs/train.py", "args": TRAIN + (["--ckpt-api"] if tier == "memory" else [])})
    if spare:
        data["recovery"] = {"max_host_failures": 1, "spares": [hosts[3]]}
    (work / tag).mkdir(parents=True, exist_ok=True)
    path = work / tag / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def where_read(recovery) -> str:
    """Where the relaunch read its checkpoint, in words: a host's memory (whose save), the durable dir,
    or the file the job's own torch.load read."""
    got = recovery.checkpoint
    if got is not None and got.source == "memory":
        return f"{got.host}'s memory (saved by {got.origin})" if got.origin else f"{got.host}'s memory"
    if got is not None and got.source == "durable":
        return "durable dir (the tier's)"
    path = got.path if got is not None else (recovery.loaded[0] if recovery.loaded else "")
    return f"disk: {Path(path).name} (torch.load)" if path else "?"


def measure(row: dict, lines: "rec.Lines", view: RunView, t_crash: float) -> None:
    """The trial's figures from its output and its record, into `row`."""
    resumed = next((t for t, line in list(lines.lines) if t > t_crash and rec.RESUMED_RE.search(line)), None)
    if resumed is not None:
        row["last_step"] = max(int(m.group(1)) for t, line in list(lines.lines)
                               if t < resumed and (m := rec.STEP_RE.search(line)))
    if view.recoveries:
        recovery = view.recoveries[0]
        row["read_from"] = where_read(recovery)
        row["resumed_from"] = recovery.resumed_from
        if recovery.first_step_at is not None:
            row["resumed_s"] = round(recovery.first_step_at - t_crash, 1)
        if recovery.resumed_from is not None and "last_step" in row:
            row["redone_steps"] = row["last_step"] - recovery.resumed_from
    spent = ledger(view)
    if spent is not None:
        row["wall_s"], row["goodput"] = round(spent.wall_s, 1), round(spent.goodput, 4)
        row["checkpoint_s"], row["redone_s"] = round(spent.parts["checkpoint"], 2), round(spent.parts["redone"], 2)
    saves = sum(s.progress.saves for s in view.stages if s.progress is not None)
    saving = sum(s.progress.saving_s for s in view.stages if s.progress is not None)
    row["saves"], row["stall_ms"] = saves, round(1e3 * saving / saves, 1) if saves else None


def trial(tier: str, cluster, work: Path, n: int, env: dict) -> dict:
    tag = f"ckcrash-{tier}-{n}"
    env = dict(env, DDPLAUNCH_HOME=str(work / "state" / tag))  # a home of its own: no remembered bad hosts
    saver = cluster.hosts[0].name
    saved = random.choice(SAVES)
    # the crash lands a step or so after the step line that triggers it: at saved + 2 the lost launch
    # reaches saved + 2 or + 3, never the next save (saved + 4)
    at = saved + 2
    argv = [sys.executable, "-m", "ddplaunch", "up", str(spec_for(cluster, work, tag, tier)), "--run-id", tag]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    lines = rec.Lines(proc)
    row: dict = {"tier": tier, "trial": n, "saved": saved, "crash_at_step": at}
    try:
        hit = lines.wait(lambda line: (m := rec.STEP_RE.search(line)) is not None and int(m.group(1)) >= at, 240)
        if hit is None:
            row["error"] = "never reached the crash step:\n" + lines.text()[-2000:]
            return row
        t_crash = time.time()
        sim_fault(cluster, saver, crash=True)
        proc.wait(timeout=600)
        row["exit"] = proc.returncode
        measure(row, lines, RunView.of(read_events(Path(env["DDPLAUNCH_HOME"]) / "runs" / tag)), t_crash)
        row["sha"] = (rec.SHA_RE.findall(lines.text()) or [None])[-1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rec.kill_tagged(tag)
        sim_fault(cluster, saver, clear=True)
    return row


def reference(cluster, work: Path, env: dict) -> str:
    """The final weights of the same job (disk tier) run to its end without a crash."""
    spec = spec_for(cluster, work, "ckcrash-ref", "disk", spare=False)
    out = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", "ckcrash-ref"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    found = rec.SHA_RE.findall(out.stdout)
    if not found:
        sys.exit(f"the reference run printed no final weights:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return found[-1]


def _med(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):g} ({min(xs):g}-{max(xs):g})" if xs else "-"


def table(rows: list[dict], ref: str) -> str:
    out = ["| tier | trial | saved at | crash at step | crash → first resumed step (s) | read from | resumed from | "
           "steps redone | ledger `checkpoint` (s) | ledger `redone` (s) | saves, stall each (ms) | "
           "weights = uninterrupted |", "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['tier']} | {r['trial']} | {r['saved']} | {r['crash_at_step']} | error: see the JSON |"
                       + " - |" * 7)
            continue
        out.append(f"| {r['tier']} | {r['trial']} | {r['saved']} | {r['crash_at_step']} | {r.get('resumed_s', '-')} | "
                   f"{r.get('read_from', '-')} | {r.get('resumed_from', '-')} | {r.get('redone_steps', '-')} | "
                   f"{r.get('checkpoint_s', '-')} | {r.get('redone_s', '-')} | {r.get('saves')}, {r.get('stall_ms')} | "
                   f"{'yes' if r.get('sha') == ref else 'no'} |")
    out += ["", "| tier | trials | crash → first resumed step (s) | steps redone | `checkpoint` (s) | `redone` (s) | "
                "`checkpoint` + `redone` (s) | stall per save (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for tier in dict.fromkeys(r["tier"] for r in rows):
        mine = [r for r in rows if r["tier"] == tier and not r.get("error")]
        lost = [r["checkpoint_s"] + r["redone_s"] for r in mine if "checkpoint_s" in r]
        out.append(f"| {tier} | {len(mine)} | {_med([r.get('resumed_s') for r in mine])} | "
                   f"{_med([r.get('redone_steps') for r in mine])} | {_med([r.get('checkpoint_s') for r in mine])} | "
                   f"{_med([r.get('redone_s') for r in mine])} | {_med([round(x, 2) for x in lost])} | "
                   f"{_med([r.get('stall_ms') for r in mine])} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tiers", default="memory,disk", help="interleaved, the order reversed every other trial")
    ap.add_argument("--prefix", default="dlb")
    ap.add_argument("--subnet", default="10.213.45.0/24")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    global sim_fault
    from ddplaunch.sim import SimConfig, sim_down, sim_up
    from ddplaunch.sim.faults import sim_fault
    tiers = args.tiers.split(",")
    cluster = sim_up(SimConfig(n_hosts=4, prefix=args.prefix, subnet=args.subnet, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-ckpt-crash-"))
    env = dict(os.environ, DDPLAUNCH_HOME=str(work / "state"), PYTHONUNBUFFERED="1")
    rows: list[dict] = []
    try:
        ref = reference(cluster, work, env)
        for n in range(args.trials):
            for tier in (tiers if n % 2 == 0 else tiers[::-1]):
                row = trial(tier, cluster, work, n, env)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        sim_down(cluster.state_dir)
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows, ref))
    if args.json:
        args.json.write_text(json.dumps({"reference_sha": ref, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
