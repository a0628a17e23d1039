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
interleaved: `ddplaunch` (this tree), with `--baseline REV` `ddplaunch-REV` (a git worktree of
that commit), and with `--kinds ...,elastic` torchrun's elastic mode on the same 7 hosts,
started by pdsh: every host runs an agent (`--nnodes 3:3 --rdzv-backend c10d --max-restarts 8`,
the rendezvous's join_timeout an hour: waiting nodes stay), 3 of them train and the other 4 wait
in the rendezvous (elastic's nearest to spares: a waiting node joins the next round once a member
fails); the fault's target is the host of rank 1 (rank 2's when rank 1 runs on the rendezvous
host: elastic cannot outlive its store's host). Its survivors wait in their collective for the
job's timeout, set to ddplaunch's default `job.hang_timeout` (60 s). Elastic has no ledger: for
every kind the table also has `steps x step / wall`, the steps the job needed times its median
step interval (rank 0's lines), over the wall time from the launch to the final weights' line:
the same estimate of goodput for both.

`--kinds ddplaunch,memory` runs the same faults with the job's checkpoints in the memory tier
(`memory`: `checkpoint: {tier: memory, replicas: 1}`, train.py --ckpt-api, a save every
`--memory-every` steps, default 10 as the disk's; `memory-N`: every N steps) against its own torch.save + fsync + rename
(`ddplaunch`), interleaved; the table's last columns are the ledger's `checkpoint` + `redone` and the
stall per save rank 0 measured (the entry's hooks: the time inside torch.save, or inside
ddplaunch.checkpoint.save; train.py's fsync and rename after its torch.save are not in it).
A fault at a multiple of --every comes just after a save of every 10 steps: nothing is redone;
`--fault-offset 5` puts each half an interval (of 10) later, where a failure comes on average.

Needs root; tears its sim down at the end.
Needs pdsh for elastic (`apt-get install -y pdsh`).
Usage: .venv/bin/python bench/goodput.py [--trials 1] [--every 150] [--baseline REV] [--kinds ddplaunch,elastic]
       [--kinds ddplaunch,memory --memory-every 10 --fault-offset 5] [--prefix dgp --subnet 10.213.61.0/24]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
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


#: Elastic's survivors wait this long in a collective with a lost peer: ddplaunch's default hang_timeout.
ELASTIC_TIMEOUT_S = 60
#: Seconds elastic gets to train from one fault to the next (~60 s of steps, its 60 s timeout, a
#: rendezvous round and a restart take ~3 minutes) before its run is called stuck.
ELASTIC_GIVE_UP_S = 420


def train_args(steps: int, every: int = 10) -> list[str]:
    return ["--epochs", "1", "--samples", str(steps * 8 * 3), "--batch-size", "8", "--ckpt-every", str(every),
            "--log-every", "1", "--seed", "3", "--step-sleep", "0.3", "--burn-ms", "40"]


def spec_for(cluster, work: Path, tag: str, steps: int, memory_every: Optional[int] = None) -> Path:
    """The run's spec: train.py's own torch.save checkpoints every 10 steps, or with `memory_every`
    ddplaunch.checkpoint's memory tier (one buddy copy) every that many steps."""
    import yaml

    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"]
    if memory_every is None:
        train, ckpt = train_args(steps), {"env": {"DDPLAUNCH_CKPT_DIR": str(work / tag / "ckpt")}}
    else:
        train = [*train_args(steps, memory_every), "--ckpt-api"]
        ckpt = {"checkpoint": {"path": str(work / tag / "ckpt"), "tier": "memory", "replicas": 1}}
    data.update(hosts=hosts[:3], nproc_per_node=1, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                job={"script": "jobs/train.py", "args": train}, **ckpt,
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


def estimate(lines: "rec.Lines", started: float, steps: int) -> dict:
    """`steps x step / wall`: the steps the job needed times rank 0's median step interval, over the
    wall time from the launch to the final weights' line (the same for every kind)."""
    stamps = [t for t, line in list(lines.lines) if rec.STEP_RE.search(line)]
    end = next((t for t, line in list(lines.lines) if rec.SHA_RE.search(line)), None)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if end is None or not gaps:
        return {}
    return {"end_wall_s": round(end - started, 1), "step_s": round(statistics.median(gaps), 4),
            "estimate": round(steps * statistics.median(gaps) / (end - started), 4)}


def resumed_after(lines: "rec.Lines", at: float) -> Optional[float]:
    """Seconds from `at` to the first step line after the first "resumed from" line after it."""
    resumed = next((t for t, line in list(lines.lines) if t > at and rec.RESUMED_RE.search(line)), None)
    first = next((t for t, line in list(lines.lines) if resumed is not None and t > resumed
                  and rec.STEP_RE.search(line)), None)
    return round(first - at, 1) if first is not None else None


def host_of(pid: int, cluster) -> Optional[str]:
    """The sim host whose network namespace `pid` runs in."""
    try:
        net = os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    for host in cluster.hosts:
        with contextlib.suppress(OSError):
            if net == f"net:[{os.stat(f'/run/netns/{host.ns}').st_ino}]":
                return host.name
    return None


def elastic_target(cluster, tag: str) -> Optional[str]:
    """The host of elastic's rank 1 now, or of rank 2 when rank 1 runs on the rendezvous host."""
    from ddplaunch.hostside import procs

    by_rank = {environ.get(b"RANK"): host_of(pid, cluster)
               for pid, environ in procs.run_processes(tag, any_netns=True).items() if b"RANK" in environ}
    store = cluster.hosts[0].name
    return next((by_rank[r] for r in (b"1", b"2") if by_rank.get(r) not in (None, store)), None)


def elastic_freeze(cluster, tag: str, host: str) -> None:
    """SIGSTOP elastic's agent and worker on `host` (rec.freeze finds ddplaunch's by its host variable)."""
    from ddplaunch.hostside import procs

    for pid in procs.run_processes(tag, any_netns=True):
        if host_of(pid, cluster) == host and b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGSTOP)
            for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                os.kill(int(child), signal.SIGSTOP)


def clean_up(proc: subprocess.Popen, tag: str, cluster, hit: list[str]) -> None:
    """A trial's end: its launcher and what it started killed, its faults cleared."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    rec.kill_tagged(tag)
    for host in hit:
        sim_fault(cluster, host, clear=True)


def elastic_trial(cluster, work: Path, n: int, env: dict, every: int) -> dict:
    tag = f"gp-elastic-{n}"
    steps = every * (len(FAULTS) + 1)
    ckpt = work / tag / "ckpt"
    ckpt.mkdir(parents=True)
    remote = (f"cd {shlex.quote(str(ROOT))} && exec env DDPLAUNCH_RUN_ID={tag} GLOO_SOCKET_IFNAME={cluster.ifname} "
              f"DDPLAUNCH_CKPT_DIR={ckpt} PYTHONUNBUFFERED=1 {sys.executable} -m torch.distributed.run "
              f"--nnodes 3:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint {cluster.hosts[0].addr}:29611 "
              f"--rdzv-id {tag} --rdzv-conf join_timeout=3600 --max-restarts 8 "
              f"jobs/train.py {' '.join(train_args(steps))} "
              f"--dist-timeout {ELASTIC_TIMEOUT_S}")
    started = time.time()
    proc = subprocess.Popen(["pdsh", "-R", "ssh", "-f", str(len(cluster.hosts)), "-w",
                             ",".join(h.addr for h in cluster.hosts), remote],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines = rec.Lines(proc)
    hit: list[str] = []
    row: dict = {"kind": "elastic", "trial": n, "faults": {}}
    try:
        for i, fault in enumerate(FAULTS):
            target = every * (i + 1)
            got = lines.wait(lambda line, at=target: (m := rec.STEP_RE.search(line)) is not None
                             and int(m.group(1)) >= at, ELASTIC_GIVE_UP_S)
            host = elastic_target(cluster, tag) if got is not None else None
            if host is None:
                row["error"] = (f"no step {target} within {ELASTIC_GIVE_UP_S}s (fault {fault}), or no rank 1 or 2 off "
                                "the store's host")
                break
            if fault == "freeze":
                elastic_freeze(cluster, tag, host)
            else:
                inject(fault, cluster, tag, host)
            hit.append(host)
            row["faults"][fault] = {"host": host, "at": time.time()}
        if "error" not in row:
            lines.wait(lambda line: rec.SHA_RE.search(line) is not None, ELASTIC_GIVE_UP_S)
        row.update(estimate(lines, started, steps))
        row["last_step"] = max((int(m.group(1)) for _, line in list(lines.lines) if (m := rec.STEP_RE.search(line))),
                               default=0)
        row["steps"] = steps
        for fault, said in row["faults"].items():
            said["resumed_s"] = resumed_after(lines, said["at"]) if fault != "straggler" else None
        row["sha"] = (rec.SHA_RE.findall(lines.text()) or [None])[-1]
        if row["sha"] is None:
            row["tail"] = lines.text()[-3000:]
    finally:
        clean_up(proc, tag, cluster, hit)
    return row


def redone_steps(view: RunView) -> int:
    """Steps trained again after the run's recoveries: each lost launch's last step (the step it
    resumed from plus the steps its rank 0 reported) past the step the relaunch resumed from."""
    done, base = 0, 0
    for r in view.recoveries:
        if r.steps_before is not None and r.resumed_from is not None:
            done += max(0, base + r.steps_before - r.resumed_from)
        base = r.resumed_from or 0
    return done


def memory_interval(kind: str, memory_every: int) -> Optional[int]:
    """The memory tier's checkpoint interval in steps for a kind `memory` or `memory-N`; None: not the tier."""
    if kind == "memory":
        return memory_every
    return int(kind.split("-", 1)[1]) if kind.startswith("memory-") else None


def trial(kind: str, cluster, work: Path, n: int, env: dict, every: int, baseline: Optional[Path],
          memory_every: int = 10, offset: int = 0) -> dict:
    tag = f"gp-{kind}-{n}"
    env = dict(env, DDPLAUNCH_HOME=str(work / "state" / tag))
    steps = every * (len(FAULTS) + 1)
    save_every = memory_interval(kind, memory_every)
    spec = spec_for(cluster, work, tag, steps, save_every)
    argv = [sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", tag]
    cwd = ROOT
    if kind != "ddplaunch" and save_every is None:  # ddplaunch-REV: an earlier commit's
        cwd, env = baseline, dict(env, PYTHONPATH=str(baseline))
    started = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    lines = rec.Lines(proc)
    node1 = cluster.hosts[1].name
    hit: list[str] = []
    row: dict = {"kind": kind, "trial": n, "faults": {}, "save_every": save_every or 10}
    try:
        for i, fault in enumerate(FAULTS):
            target = every * (i + 1) + offset
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
            row["parts_s"] = {c: round(s, 2) for c, s in spent.parts.items()}
        progress = [s.progress for s in view.stages if s.progress is not None]
        row["saves"] = sum(p.saves for p in progress)
        row["stall_ms"] = round(1e3 * sum(p.saving_s for p in progress) / row["saves"], 2) if row["saves"] else None
        row["redone_steps"] = redone_steps(view)
        for fault, said in row["faults"].items():
            mine = next((r for r in view.recoveries if said["host"] in r.lost and r.first_step_at), None)
            said["resumed_s"] = round(mine.first_step_at - said["at"], 1) if mine is not None else None
        row["sha"] = (rec.SHA_RE.findall(lines.text()) or [None])[-1]
        row.update(estimate(lines, started, steps))
    finally:
        clean_up(proc, tag, cluster, hit)
    return row


def _med(values: list) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.1f}" if values else "-"


def table(rows: list[dict]) -> str:
    out = ["| kind | runs | wall | goodput (ledger) | " + " | ".join(CAUSES) + " | steps x step / wall | "
           + " | ".join(f"{f} → resumed (s)" for f in FAULTS) + " | exit |",
           "|---|---:|---:|---:|" + "---:|" * (len(CAUSES) + 1) + "---:|" * len(FAULTS) + "---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind and ("wall_s" in r or "estimate" in r)]
        if not mine:
            out.append(f"| {kind} | 0 | - | - |" + " - |" * (len(CAUSES) + 1 + len(FAULTS)) + " - |")
            continue
        ledgered = [r for r in mine if "wall_s" in r]
        wall = statistics.median(r.get("wall_s", r.get("end_wall_s", 0.0)) for r in mine)
        goodput = f"**{100 * statistics.median(r['goodput'] for r in ledgered):.0f}%**" if ledgered else "-"
        parts = [duration(statistics.median(r["parts_s"][c] for r in ledgered)) if ledgered else "-" for c in CAUSES]
        estimates = [r["estimate"] for r in mine if "estimate" in r]
        estimate = f"{100 * statistics.median(estimates):.0f}%" if estimates else "-"
        resumed = [_med([r["faults"].get(f, {}).get("resumed_s") for r in mine]) for f in FAULTS]
        out.append(f"| {kind} | {len(mine)} | {duration(wall)} | {goodput} | " + " | ".join(parts) + f" | {estimate} | "
                   + " | ".join(resumed) + f" | {', '.join(str(r.get('exit', '-')) for r in mine)} |")
    out += lost_table([r for r in rows if "parts_s" in r])
    out += [f"\n{r['kind']} (trial {r['trial']}): {r['error']}; its last step {r.get('last_step', '?')} of "
            f"{r.get('steps', '?')}" for r in rows if r.get("error")]
    return "\n".join(out)


def lost_table(rows: list[dict]) -> list[str]:
    """Per run: the ledger's `checkpoint` and `redone`, their sum, the saves and the stall of each."""
    if not rows:
        return []
    out = ["", "| kind | trial | save every (steps) | saves | stall per save (ms) | steps redone | "
               "`checkpoint` (s) | `redone` (s) | `checkpoint` + `redone` (s) | goodput |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        parts = r["parts_s"]
        out.append(f"| {r['kind']} | {r['trial']} | {r.get('save_every', '-')} | {r.get('saves', '-')} | "
                   f"{r.get('stall_ms', '-')} | {r.get('redone_steps', '-')} | {parts['checkpoint']:.2f} | "
                   f"{parts['redone']:.2f} | **{parts['checkpoint'] + parts['redone']:.2f}** | "
                   f"{100 * r['goodput']:.1f}% |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--every", type=int, default=150, help="steps of training between two faults")
    ap.add_argument("--baseline", metavar="REV", default=None)
    ap.add_argument("--kinds", default="ddplaunch",
                    help="ddplaunch (train.py's torch.save checkpoints), memory or memory-N (the memory tier, every "
                         "N steps) and/or elastic, interleaved")
    ap.add_argument("--memory-every", type=int, default=10, help="the memory tier's checkpoint interval in steps")
    ap.add_argument("--fault-offset", type=int, default=0,
                    help="steps past each multiple of --every that its fault comes (ddplaunch and memory kinds): "
                         "0 is just after a save of the disk's every-10 steps, 5 half its interval, a failure's "
                         "expected place")
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--subnet", default=SUBNET)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    global sim_fault
    from ddplaunch.sim import SimConfig, sim_down, sim_up
    from ddplaunch.sim.faults import sim_fault
    kinds = args.kinds.split(",") + ([f"ddplaunch-{args.baseline}"] if args.baseline else [])
    if "elastic" in kinds and shutil.which("pdsh") is None:
        sys.exit("goodput.py: elastic is started by pdsh: apt-get install -y pdsh")
    cluster = sim_up(SimConfig(n_hosts=7, prefix=args.prefix, subnet=args.subnet, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-goodput-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDSH_RCMD_TYPE="ssh",
               PDSH_SSH_ARGS=(f"-i {cluster.key} -o UserKnownHostsFile={cluster.known_hosts} "
                              "-o StrictHostKeyChecking=yes -o BatchMode=yes -o LogLevel=ERROR -l root %h"))
    baseline = work / "baseline"
    rows: list[dict] = []
    try:
        with rec.worktree(args.baseline, baseline):
            for n in range(args.trials):
                for kind in (kinds if n % 2 == 0 else kinds[::-1]):
                    row = (elastic_trial(cluster, work, n, env, args.every) if kind == "elastic"
                           else trial(kind, cluster, work, n, env, args.every, baseline, args.memory_every,
                                      args.fault_offset))
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
