"""Stragglers: how fast a slowed host is named, what the ranks' timing costs, and a naive detector beside it.

Builds one `ddplaunch sim` cluster of 4 hosts (prefix dst, 10.213.61.0/24); `ddplaunch up` runs
jobs/train.py on them, 1 rank each, every step spending 40 ms of CPU (`--burn-ms 40`). Three parts:

  detection  `--trials` runs per slowdown level: once rank 0 printed step 30, host 3's processes
             are limited to a slice of one CPU (`sim fault --slow`, cgroups); measured: slowed ->
             "straggler:" line on screen, the slowdown ddplaunch reports, and what a naive detector
             (the rank whose step time is 15 % above the median, over the same steps, read from the
             same runs' timing events) names: in DDP every rank's step lasts as long as the
             slowest's, so it names nobody, or a host at random.
  healthy    the same job never slowed, `--healthy-s` seconds, disturbed as a shared machine is
             (issue #55), every `--disturb-every` seconds (0: never): a burst of load on the whole
             machine (2 processes spinning for 8 s on the 2 cores), then, half a period later, one
             host's rank paused for 2 s (SIGSTOP: a GC, a checkpoint, the page cache), the host
             taken in turn. Counted: the verdicts (every one a false positive), per host-hour.
  eviction   `--evictions` runs per backend (`--evict-on ssh,slurm`) with `recovery.evict_stragglers`
             and a spare, 3 ranks (SSH: hosts 0-2, host 3 the spare; Slurm: its own 3-node sim, 2
             nodes and a count of 1 spare), a checkpoint every 25 steps: once rank 0 printed step 80
             a run host is limited to 15 % of a CPU; measured from rank 0's own timing events: its
             steps per second before the slowdown, while slowed and after the eviction, and after
             against before (the issue asks >= 90 %).
  overhead   the job with the ranks' timing on and off (DDPLAUNCH_STEP_TIMING=0), interleaved
             (on, off, off, on, ...): the median step time of each, from the job's own step lines.

The slices (percent of one CPU) are for a 2-core machine where the 4 ranks share the cores (each
gets about half a CPU while computing): the slowdown they cause is what the table reports.
Needs root; tears its sim down at the end.
The verdicts' precision (as Greyhound and Mycroft report theirs) is over every verdict of the
bench: the slowed host named in a detection or eviction trial is a true one; any other host named
there, and any host named in the healthy run, a false one. Recall: the trials whose slowed host
was named.
Usage: .venv/bin/python bench/stragglers.py [--trials 5] [--healthy-s 120] [--disturb-every 60]
       [--evictions 3] [--evict-on ssh,slurm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.record.events import StepWindow, StragglerNamed, read_events  # noqa: E402
from ddplaunch.sim import SimConfig, sim_down, sim_up  # noqa: E402
from ddplaunch.sim.faults import sim_fault  # noqa: E402
from ddplaunch.sim.netns import netns_pids  # noqa: E402

PREFIX, SUBNET = "dst", "10.213.61.0/24"
SLURM_PREFIX, SLURM_SUBNET = "dsv", "10.213.62.0/24"
#: The eviction trials' slowdown starts once rank 0 printed this step (its pace before is measured up to it).
SLOWED_AT = 80
VICTIM = 2
#: The slowed host's CPU slices (percent of one CPU), `--levels` (on a machine that other work
#: keeps busy every process gets less than a quarter of a CPU: there only a thinner slice slows).
LEVELS = (25, 36)
STEP_TIME_RE = re.compile(r"\[\S+:0\] step=(\d+) ")


def train_job(samples: int, ckpt_every: int = 0, log_every: int = 5) -> dict:
    """jobs/train.py for one epoch of `samples`, 40 ms of CPU a step."""
    return {"script": "jobs/train.py", "args": ["--epochs", "1", "--samples", str(samples), "--batch-size", "8",
                                                "--ckpt-every", str(ckpt_every), "--log-every", str(log_every),
                                                "--burn-ms", "40", "--seed", "3"]}


def spec_text(cluster, tmp: Path, samples: int, timing: bool) -> Path:
    import yaml
    data = yaml.safe_load(cluster.spec_path.read_text())
    data.update(workdir=str(ROOT), nproc_per_node=1, healthcheck={"enabled": False},
                env={"DDPLAUNCH_CKPT_DIR": str(tmp / f"ckpt-{time.monotonic_ns()}"),
                     **({} if timing else {"DDPLAUNCH_STEP_TIMING": "0"})},
                job=train_job(samples))
    path = tmp / f"spec-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def up(spec: Path, tmp: Path, run_id: str) -> subprocess.Popen:
    env = {"DDPLAUNCH_HOME": str(tmp / "state"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**__import__("os").environ, **env})


def read_until(proc: subprocess.Popen, needle: str, timeout: float) -> list[tuple[float, str]]:
    deadline, lines = time.monotonic() + timeout, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.monotonic(), line))
        if needle in line or time.monotonic() > deadline:
            break
    return lines


def naive(events: list, after_step: int) -> str:
    """The naive detector on the same run: the host whose step time is >= 15 % over the median
    host's, in the first window of steps after `after_step`."""
    window = next((e for e in events if isinstance(e, StepWindow) and e.first > after_step), None)
    if window is None or len(window.hosts) < 2:
        return "no data"
    median = statistics.median(part[2] for part in window.hosts.values())
    slow = [h for h, part in window.hosts.items() if part[2] >= 1.15 * median]
    return ", ".join(slow) if slow else "nobody"


def detection(cluster, tmp: Path, level: str, quota: int, trial: int, stopped: bool = False) -> dict:
    """One trial: host VICTIM limited to `quota` % of one CPU once rank 0 printed step 30 (cgroups),
    or with `stopped`, its ranks let run `quota` % of every 100 ms (SIGSTOP/SIGCONT: as much slower
    than its peers whatever else keeps the machine busy, where a CPU slice above what every process
    gets anyway slows nothing)."""
    run_id = f"bst-{'stop' if stopped else 'cpu'}{quota}-{trial}"
    proc = up(spec_text(cluster, tmp, 40000, True), tmp, run_id)
    victim = cluster.hosts[VICTIM]
    done = threading.Event()
    try:
        read_until(proc, "step=30 ", 300)
        if stopped:
            threading.Thread(target=_duty, args=(victim, quota, done), daemon=True).start()
        else:
            sim_fault(cluster, victim.name, slow=quota)
        t0 = time.monotonic()
        got = read_until(proc, "[ddplaunch] straggler:", 120)
        named_s = got[-1][0] - t0 if got and "straggler:" in got[-1][1] else None
        line = got[-1][1] if got else ""
    finally:
        done.set()
        sim_fault(cluster, victim.name, clear=True)
        proc.send_signal(2)
        proc.communicate(timeout=120)
    victim = victim.name
    events = read_events(tmp / "state" / "runs" / run_id)
    found = [e.straggler for e in events if isinstance(e, StragglerNamed)]
    return {"level": level, "quota": quota, "trial": trial, "named_s": named_s, "named_all": [f.host for f in found],
            "host": found[0].host if found else None, "right": bool(found and found[0].host == victim),
            "slowdown": found[0].slowdown if found else None, "naive": naive(events, 30), "line": line.strip()}


def healthy(cluster, tmp: Path, seconds: float, disturb_every: float) -> dict:
    """The job never slowed for `seconds`, disturbed every `disturb_every` seconds (see the module's
    doc): the hosts named (each a false positive) and what was done to the machine when."""
    run_id = "bst-healthy"
    proc = up(spec_text(cluster, tmp, 400000, True), tmp, run_id)
    read_until(proc, "step=30 ", 300)  # training runs: the run's time counts from here
    done, disturbed = threading.Event(), []
    worker = threading.Thread(target=_disturb, args=(cluster, disturb_every, done, disturbed), daemon=True)
    if disturb_every > 0:
        worker.start()
    ran = time.monotonic()
    time.sleep(seconds)
    done.set()
    if worker.is_alive():
        worker.join()  # a burst or a pause under way ends first
    ran = time.monotonic() - ran
    proc.send_signal(2)
    proc.communicate(timeout=120)
    events = read_events(tmp / "state" / "runs" / run_id)
    steps = max((e.last for e in events if isinstance(e, StepWindow)), default=0)
    named = [e.straggler for e in events if isinstance(e, StragglerNamed)]
    return {"seconds": ran, "steps": steps, "hosts": len(cluster.hosts), "disturbed": disturbed,
            "named": [s.host for s in named], "verdicts": [s.describe() for s in named]}


def _disturb(cluster, every: float, done: threading.Event, said: list) -> None:
    """Every `every` s: a burst of load on the whole machine (2 spinning processes, 8 s); half a
    period later one host's ranks stopped for 2 s (the hosts in turn)."""
    turn = 0
    while not done.wait(every / 2):
        spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 8: pass"
        burst = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
        said.append(["burst", "the whole machine, 8 s", time.monotonic()])
        for p in burst:
            p.wait()
        if done.wait(every / 2):
            return
        host = cluster.hosts[turn % len(cluster.hosts)]
        turn += 1
        ranks = [pid for pid in netns_pids(host.ns) if _is_rank(pid)]
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(2)
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        said.append(["pause", f"{host.name}: {len(ranks)} rank(s) stopped 2 s", time.monotonic()])


def _duty(host, percent: int, done: threading.Event) -> None:
    """`host`'s ranks run `percent` % of every 100 ms, stopped the rest, until `done`."""
    ranks = [pid for pid in netns_pids(host.ns) if _is_rank(pid)]
    while not done.is_set():
        time.sleep(percent / 1000)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        time.sleep((100 - percent) / 1000)
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)


def _is_rank(pid: int) -> bool:
    """A training rank (torchrun's worker: LOCAL_RANK in its environment), not its agent or sshd."""
    try:
        return b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def precision(results: dict) -> dict:
    """Every verdict of the bench, true or false (see the module's doc), its precision, and recall."""
    true = false = trials = found = 0
    for r in results["detection"]:
        trials += 1
        found += r["right"]
        true += r["right"]
        false += len(r["named_all"]) - r["right"]
    for r in results["eviction"]:
        trials += 1
        found += r["victim"] in r["named"]
        true += r["victim"] in r["named"]
        false += len([h for h in r["named"] if h != r["victim"]])
    false += len(results.get("healthy", {}).get("named", []))
    return {"true": true, "false": false, "precision": true / (true + false) if true + false else None,
            "trials": trials, "recall": found / trials if trials else None}


def eviction(cluster, tmp: Path, backend: str, trial: int) -> dict:
    """One slowed host evicted at the next checkpoint (see the module's doc); its pace figures."""
    import yaml
    run_id = f"bst-evict-{backend}-{trial}"
    names = [h.name for h in cluster.hosts]
    common = {"workdir": str(ROOT), "nproc_per_node": 1, "healthcheck": {"sizes": ["64K"], "iterations": 1},
              "env": {"DDPLAUNCH_CKPT_DIR": str(tmp / f"ckpt-{run_id}")},
              "job": train_job(6000, ckpt_every=25, log_every=10)}
    if backend == "slurm":
        data = yaml.safe_load(cluster.slurm.spec_path.read_text())
        data.update(common, recovery={"max_host_failures": 1, "spares": 1, "evict_stragglers": True})
        data["slurm"].update(nodes=2, output_dir=str(tmp / f"slurm-out-{trial}"))
        victim = names[2]
    else:
        data = yaml.safe_load(cluster.spec_path.read_text())
        data.update(common, hosts=data["hosts"][:3], recovery={"max_host_failures": 1, "spares": [data["hosts"][3]],
                                                                 "evict_stragglers": True})
        victim = names[1]
    spec = tmp / f"{run_id}.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = up(spec, tmp, run_id)
    try:
        read_until(proc, f"step={SLOWED_AT} ", 300)
        sim_fault(cluster, victim, slow=15)
        proc.communicate(timeout=600)
    finally:
        sim_fault(cluster, victim, clear=True)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if backend == "slurm":
        from ddplaunch.sim.slurm import wait_nodes_idle
        wait_nodes_idle(cluster.slurm, names, timeout=120)
    events = read_events(tmp / "state" / "runs" / run_id)
    return {"backend": backend, "trial": trial, "rc": proc.returncode, "victim": victim,
            "named": [e.straggler.host for e in events if isinstance(e, StragglerNamed)], **paces(events)}


def paces(events: list) -> dict:
    """Steps per second from the judged windows (1 / the median host's median step time): before
    the slowdown (up to SLOWED_AT), while slowed (from 20 steps later on) and after the relaunch."""
    starts = [i for i, e in enumerate(events) if type(e).__name__ == "RecoveryStarted"]
    relaunch = starts[-1] if starts else len(events)
    windows = [(i, e) for i, e in enumerate(events) if isinstance(e, StepWindow)]

    def rate(picked: list[StepWindow]) -> Optional[float]:
        times = [part[2] for e in picked for part in e.hosts.values()]
        return 1 / statistics.median(times) if times and statistics.median(times) > 0 else None
    before = rate([e for i, e in windows if i < relaunch and e.last <= SLOWED_AT])
    slowed = rate([e for i, e in windows if i < relaunch and e.first > SLOWED_AT + 20])
    after = rate([e for i, e in windows if i > relaunch])
    return {"evicted": bool(starts), "before": before, "slowed": slowed, "after": after,
            "pace": after / before if after and before else None}


def _eviction_table(rows: list) -> None:
    print("\n| backend | trials | slowed host named and evicted | steps per second before / slowed / after (median) | "
          "after the eviction, of before (median, min) |")
    print("|---|---:|---:|---|---|")
    for backend in sorted({r["backend"] for r in rows}):
        rs = [r for r in rows if r["backend"] == backend]
        ok = [r for r in rs if r["evicted"] and r["named"] == [r["victim"]] and r["rc"] == 0]
        rate = {k: statistics.median(r[k] for r in ok) if ok else float("nan") for k in ("before", "slowed", "after")}
        pace = [r["pace"] for r in ok if r["pace"]]
        print(f"| {backend} | {len(rs)} | {len(ok)}/{len(rs)} | {rate['before']:.1f} / {rate['slowed']:.1f} / "
              f"{rate['after']:.1f} | " + (f"{statistics.median(pace):.0%}, {min(pace):.0%}" if pace else "-") + " |")


def step_time(cluster, tmp: Path, timing: bool, n: int) -> float:
    """Seconds per step from rank 0's step lines between step 20 and the last (screen events)."""
    run_id = f"bst-ovh-{int(timing)}-{n}"
    proc = up(spec_text(cluster, tmp, 3200, timing), tmp, run_id)
    proc.communicate(timeout=600)
    marks = []
    for e in read_events(tmp / "state" / "runs" / run_id):
        m = STEP_TIME_RE.search(getattr(e, "text", ""))
        if type(e).__name__ == "Shown" and m and int(m.group(1)) >= 20:
            marks.append((int(m.group(1)), e.mono))
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return (t1 - t0) / (s1 - s0)


def _detection_table(detection: list) -> None:
    print("\n| slowdown (CPU slice) | named after (median, max) | right host | slowdown reported (median) | "
          "naive step-time detector named |")
    print("|---|---|---|---|---|")
    for level in sorted({r["level"] for r in detection}, key=lambda name: int(re.sub(r"\D", "", name))):
        rs = [r for r in detection if r["level"] == level]
        named = [r["named_s"] for r in rs if r["named_s"] is not None]
        slow = [r["slowdown"] for r in rs if r["slowdown"] is not None]
        print(f"| {level} | "
              + (f"{statistics.median(named):.1f} s, {max(named):.1f} s" if named else "never") + " | "
              f"{sum(r['right'] for r in rs)}/{len(rs)} | "
              + (f"{statistics.median(slow):.0%}" if slow else "-") + " | "
              + ", ".join(sorted(set(r["naive"] for r in rs))) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="the slowed host's CPU slices, percent")
    ap.add_argument("--stopped", action="store_true", help="slow the host by stopping its ranks (100 - level) %% of "
                    "every 100 ms instead of a CPU slice (a slowdown against its peers on a machine others keep busy)")
    ap.add_argument("--healthy-s", type=float, default=120)
    ap.add_argument("--disturb-every", type=float, default=60, help="seconds; 0: the healthy run undisturbed")
    ap.add_argument("--overhead-pairs", type=int, default=3)
    ap.add_argument("--evictions", type=int, default=0, help="eviction trials per backend")
    ap.add_argument("--evict-on", default="ssh", help="backends of the eviction trials: ssh, slurm or both")
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = [int(q) for q in args.levels.split(",") if q.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="ddpl-strag-"))
    cluster = sim_up(SimConfig(n_hosts=4, prefix=PREFIX, subnet=SUBNET, state_dir=tmp / "sim", workdir=ROOT,
                               nproc_per_node=1))
    results: dict = {"detection": [], "overhead": {"on": [], "off": []}, "eviction": []}
    backends = [b.strip() for b in args.evict_on.split(",") if b.strip()] if args.evictions else []
    slurm = None
    try:
        if "slurm" in backends:  # its state dir where munged (another user) reaches it: the default
            slurm = sim_up(SimConfig(n_hosts=3, prefix=SLURM_PREFIX, subnet=SLURM_SUBNET, workdir=ROOT,
                                     nproc_per_node=1, slurm=True))
        for trial in range(args.evictions):
            for backend in backends:
                r = eviction(slurm if backend == "slurm" else cluster, tmp, backend, trial)
                print(f"  eviction {backend} trial {trial}: rc {r['rc']} named {r['named']} evicted {r['evicted']} "
                      f"pace {r['pace']}", flush=True)
                results["eviction"].append(r)
        for trial in range(args.trials):
            for quota in (levels if trial % 2 == 0 else levels[::-1]):
                level = f"running {quota}% of the time" if args.stopped else f"{quota}% of a CPU"
                r = detection(cluster, tmp, level, quota, trial, args.stopped)
                print(f"  {level} trial {trial}: named {r['named_s']}s host {r['host']} slowdown {r['slowdown']} "
                      f"naive: {r['naive']}", flush=True)
                results["detection"].append(r)
        for n in range(args.overhead_pairs):
            for timing in ((True, False) if n % 2 == 0 else (False, True)):
                results["overhead"]["on" if timing else "off"].append(step_time(cluster, tmp, timing, n))
        if args.healthy_s > 0:
            results["healthy"] = healthy(cluster, tmp, args.healthy_s, args.disturb_every)
    finally:
        sim_down(tmp / "sim")
        if slurm is not None:
            sim_down(slurm.state_dir)
    if results["detection"]:
        _detection_table(results["detection"])
    on, off = results["overhead"]["on"], results["overhead"]["off"]
    if on and off:
        print(f"\nstep time with the ranks' timing on: {statistics.median(on) * 1e3:.1f} ms, off: "
              f"{statistics.median(off) * 1e3:.1f} ms (median of {len(on)} interleaved runs each): "
              f"{(statistics.median(on) / statistics.median(off) - 1):+.1%}")
    if results["eviction"]:
        _eviction_table(results["eviction"])
    h = results.get("healthy")
    if h:
        hours = h["seconds"] * h["hosts"] / 3600
        kinds = [d[0] for d in h["disturbed"]]
        print(f"healthy run of {h['seconds']:.0f} s ({h['steps']} steps; {kinds.count('burst')} bursts of load, "
              f"{kinds.count('pause')} rank pauses): false verdicts {len(h['named'])} "
              f"({len(h['named']) / hours:.1f} per host-hour)"
              + "".join(f"\n  {v}" for v in h["verdicts"]))
    p = results["precision"] = precision(results)
    if p["true"] + p["false"]:
        print(f"verdicts: {p['true']} true, {p['false']} false: precision {p['precision']:.0%}; recall "
              f"{p['recall']:.0%} of {p['trials']} slowed trials")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
