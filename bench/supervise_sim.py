"""The supervisor of a long run of 1,024 emulated ranks on 128 real (simulated) hosts, over SSH or Slurm.

Builds a `ddplaunch sim` cluster (prefix dsv, 10.213.80.0/24; `--backend slurm`: with Slurm, one
allocation of every node), starts `ddplaunch up --detach --emulate 8` on it (8 emulated ranks per
host, a step every `--step-s`: the real host-side path — node agents, heartbeats, the entry's
reports — with no torch) and watches the run's supervisor from outside for `--minutes`:

  - its CPU (utime + stime from /proc/PID/stat) and RSS (VmRSS) every 10 s, its threads;
  - the event log's growth (bytes/s, extrapolated to a day at 1,000 hosts: x 1,000 / hosts);
  - one rank slowed 1.5x at minute `--slow-at`: when it is named (host and rank) after the step
    it slowed in began (the time of rank 0's line of the step before);
  - one rank frozen (SIGSTOP) at minute `--freeze-at`: when the hang rule (job.hang_timeout)
    names it, from the time of rank 0's line of the last step before it;
  - no host called lost or quiet, no rank silent but the frozen one's.

Prints a table (and `--json`). Needs root; tears the sim down at the end (`--keep` leaves it).
Usage: .venv/bin/python bench/supervise_sim.py [--backend ssh|slurm] [--hosts 128] [--ranks 8]
       [--minutes 30] [--step-s 1] [--window 5] [--slow-at 10] [--freeze-at 28] [--hang-timeout 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from ddplaunch.record.events import (HostQuiet, HostState, RanksSilent, RecoveryStarted, RunEnded, Shown,  # noqa: E402
                                     RunStarted, StragglerNamed, read_events)
from ddplaunch.record.results import NodeState  # noqa: E402

PREFIX, SUBNET = "dsv", "10.213.80.0/24"
TICK = os.sysconf("SC_CLK_TCK")
SLOW_FACTOR = 1.5


def spec_of(cluster: Any, backend: str, hosts: int, args: argparse.Namespace, tmp: Path) -> Path:
    if backend == "slurm":
        data = yaml.safe_load(cluster.slurm.spec_path.read_text())
        data["slurm"].update(nodes=hosts, time=f"{int(args.minutes) + 15}:00", output_dir=str(tmp / "slurm-out"))
    else:
        data = yaml.safe_load(cluster.spec_path.read_text())
    data.update(workdir=str(ROOT), nproc_per_node=1, stragglers={"window": args.window},
                job={"script": "jobs/train.py", "hang_timeout": args.hang_timeout})
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sample(pid: int, run_dir: Path) -> dict[str, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
    events = run_dir / "events.jsonl"
    return {"t": time.monotonic(), "cpu_s": (int(fields[11]) + int(fields[12])) / TICK, "rss_mib": rss / 1024,
            "threads": threads, "log_bytes": events.stat().st_size if events.exists() else 0}


def supervisor_pid(run_dir: Path, timeout: float = 600) -> int | None:
    """The pid of the run's supervisor, once it took the run (on Slurm, once the allocation's
    batch script started it: on the sim, a process of this machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
        started = next((e for e in events if isinstance(e, RunStarted)), None)
        if started is not None:
            return started.supervisor_pid
        time.sleep(2)
    return None


def line_time(events: list[Any], text: str) -> float | None:
    return next((e.t for e in events if isinstance(e, Shown) and text in e.text), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["ssh", "slurm"], default="ssh")
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--slow-at", type=float, default=10, help="minute")
    ap.add_argument("--freeze-at", type=float, default=28, help="minute")
    ap.add_argument("--hang-timeout", type=float, default=60)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from ddplaunch.sim import SimConfig, sim_down, sim_up

    def stop(signum: int, frame: Any) -> None:  # run in the background, SIGINT may be ignored: tear down anyway
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    tmp = Path(tempfile.mkdtemp(prefix="ddpl-bench-supsim-"))
    tmp.chmod(0o711)  # munged (its own user) traverses it to the sim's state dir; nobody lists it
    t0 = time.monotonic()
    cluster = sim_up(SimConfig(n_hosts=args.hosts, prefix=PREFIX, subnet=SUBNET, state_dir=tmp / "sim",
                               nproc_per_node=1, workdir=ROOT, slurm=args.backend == "slurm", clean_home=True,
                               slurm_nodes=args.hosts if args.backend == "slurm" else None,
                               # srun's launch of 128 nodes' tasks on 2 cores answered past Slurm's 10 s
                               slurm_message_timeout=60 if args.backend == "slurm" else None))
    print(f"sim of {args.hosts} hosts up in {time.monotonic() - t0:.0f}s", flush=True)
    hosts = [h.name for h in cluster.hosts]
    slow_step = int(args.slow_at * 60 / args.step_s)
    freeze_step = slow_step + int((args.freeze_at - args.slow_at) * 60 / (args.step_s * SLOW_FACTOR))
    slow_host, freeze_host = args.hosts * 37 // 128, args.hosts * 90 // 128
    slow_rank, freeze_rank = slow_host * args.ranks + 5 % args.ranks, freeze_host * args.ranks + 2 % args.ranks
    run_id = f"supsim-{args.backend}"
    env = dict(os.environ, DDPLAUNCH_HOME=str(tmp / "home"), PYTHONUNBUFFERED="1")
    run_dir = tmp / "home" / "runs" / run_id
    spec = spec_of(cluster, args.backend, args.hosts, args, tmp)
    up = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), "--detach", "--run-id", run_id,
                         "--emulate", str(args.ranks), "--emulate-step-s", str(args.step_s),
                         "--emulate-slow", f"{slow_rank}:{SLOW_FACTOR}@{slow_step}",
                         "--emulate-freeze", f"{freeze_rank}@{freeze_step}"],
                        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(up.stdout.strip(), up.stderr.strip()[-2000:], flush=True)
    samples: list[dict[str, float]] = []
    try:
        pid = supervisor_pid(run_dir)
        assert pid is not None, f"no supervisor: {up.stdout} {up.stderr}"
        begin = time.monotonic()
        deadline = begin + args.minutes * 60 + args.hang_timeout + 300
        while time.monotonic() < deadline:
            try:
                samples.append(sample(pid, run_dir) | {"min": (time.monotonic() - begin) / 60})
            except (OSError, StopIteration):
                break  # the supervisor ended (the run ended)
            time.sleep(10)
        events = read_events(run_dir)
        result = summarize(args, events, samples, hosts, slow_host, slow_rank, freeze_host, freeze_rank,
                           slow_step, freeze_step)
    finally:
        if not args.keep:
            subprocess.run([sys.executable, "-m", "ddplaunch", "down", run_id], env=env, cwd=ROOT,
                           capture_output=True, timeout=300)
            sim_down(cluster.state_dir, prefix=PREFIX)
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def summarize(args: argparse.Namespace, events: list[Any], samples: list[dict[str, float]], hosts: list[str],
              slow_host: int, slow_rank: int, freeze_host: int, freeze_rank: int, slow_step: int,
              freeze_step: int) -> dict[str, Any]:
    steady = [s for s in samples if s["min"] >= 5]
    before_freeze = [s for s in steady if s["min"] <= args.freeze_at]
    cores = ((before_freeze[-1]["cpu_s"] - before_freeze[0]["cpu_s"]) / (before_freeze[-1]["t"] - before_freeze[0]["t"])
             if len(before_freeze) > 1 else None)
    rss_early = [s["rss_mib"] for s in steady if s["min"] <= 10]
    rss_late = [s["rss_mib"] for s in before_freeze if s["min"] >= args.freeze_at - 10]
    growth = ((before_freeze[-1]["log_bytes"] - before_freeze[0]["log_bytes"]) /
              (before_freeze[-1]["t"] - before_freeze[0]["t"]) if len(before_freeze) > 1 else None)
    named = [e for e in events if isinstance(e, StragglerNamed)]
    slowed_at = line_time(events, f"step={slow_step - 1} ")
    froze_at = line_time(events, f"step={freeze_step - 1} ")
    hang = next((e for e in events if isinstance(e, Shown) and "stuck at:" in e.text), None)
    end = events[-1] if events and isinstance(events[-1], RunEnded) else None
    frozen_named = hang is not None and f"rank {freeze_rank} ({hosts[freeze_host]}): frozen" in hang.text
    return {
        "backend": args.backend, "hosts": len(hosts), "ranks": len(hosts) * args.ranks, "minutes": args.minutes,
        "step_s": args.step_s, "window": args.window, "samples": len(samples),
        "cores": cores, "threads": max((s["threads"] for s in samples), default=None),
        "rss_min5_10_mib": statistics.mean(rss_early) if rss_early else None,
        "rss_last10_mib": statistics.mean(rss_late) if rss_late else None,
        "log_bytes_per_s": growth,
        "log_gb_per_day_at_1000_hosts": growth * 86400 / 1e9 * (1000 / len(hosts)) if growth is not None else None,
        "log_mb_total": (samples[-1]["log_bytes"] / 1e6) if samples else None,
        "slowed": f"{hosts[slow_host]} rank {slow_rank}",
        "named": [f"{e.straggler.host} ranks {e.straggler.ranks}" for e in named],
        "named_s": named[0].t - slowed_at if named and slowed_at is not None else None,
        "frozen": f"{hosts[freeze_host]} rank {freeze_rank}", "frozen_named": frozen_named,
        "frozen_named_s": hang.t - froze_at if hang is not None and froze_at is not None else None,
        "hang_line": hang.text if hang is not None else None,
        "lost": [e.host for e in events if isinstance(e, HostState) and e.state == NodeState.LOST],
        "recoveries": sum(isinstance(e, RecoveryStarted) for e in events),
        "quiet": [e.host for e in events if isinstance(e, HostQuiet)],
        "silent": {e.host: e.ranks for e in events if isinstance(e, RanksSilent)},
        "self_suspect": sum(isinstance(e, Shown) and "went silent at once" in e.text for e in events),
        "end": f"{end.state} (exit {end.exit_code})" if end is not None else "no end",
        "cpu_rss_log": [(round(s["min"], 1), round(s["cpu_s"], 1), round(s["rss_mib"]), s["log_bytes"])
                        for s in samples],
    }


def print_table(r: dict[str, Any]) -> None:
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    print("\n| backend | ranks (hosts x 8) | supervisor CPU | RSS min 5-10 / last 10 | threads | event log | "
          "per day at 1,000 hosts | slowed rank named | frozen rank named | lost / quiet / silent |")
    print("|---|---|---:|---|---:|---:|---:|---|---|---|")
    print(f"| {r['backend']} | {r['ranks']} ({r['hosts']}) | {f(r['cores'], '.3f')} cores | "
          f"{f(r['rss_min5_10_mib'], '.0f')} / {f(r['rss_last10_mib'], '.0f')} MiB | {r['threads']} | "
          f"{f(r['log_bytes_per_s'], '.0f')} B/s | {f(r['log_gb_per_day_at_1000_hosts'], '.2f')} GB | "
          f"{r['named']} after {f(r['named_s'], '.1f')} s (slowed: {r['slowed']}) | "
          f"{'yes' if r['frozen_named'] else 'NO'} after {f(r['frozen_named_s'], '.0f')} s ({r['frozen']}) | "
          f"{len(r['lost'])} / {len(r['quiet'])} / {r['silent']} |")
    print(f"\nend: {r['end']}; hang line: {r['hang_line']}")


if __name__ == "__main__":
    main()
