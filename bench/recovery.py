"""Recovery from a crashed (or frozen) host, side by side in one run: ddplaunch with a spare vs torchrun's elastic mode.

Builds one `ddplaunch sim` cluster of 4 hosts (prefix drc, 10.213.60.0/24) and runs, interleaved
(A B, B A, ...), `--trials` trials of each:

  ddplaunch  `ddplaunch up` on hosts 1-3, host 4 its spare (recovery.max_host_failures: 1)
  elastic    `torchrun --nnodes 3:4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST1:PORT
             --max-restarts 3` started on all 4 hosts by pdsh (what the issue measured by hand)

Both train jobs/train.py (a checkpoint every 4 steps, a step every ~0.3 s). Once rank 0 printed a
random step in [8, 20], host 3 crashes (`sim fault --crash`: its link down, every process of it
SIGKILLed). Measured from the crash: `named` (ddplaunch's record: when the launcher knew the host
was gone), `resumed` (the first step printed after a "resumed from" line; "-" when none within
--give-up seconds), steps done again (the last step before the crash minus the step resumed
from), and whether the final weights equal an uninterrupted run's (same seed, same world size:
3 for ddplaunch; elastic changes its world from 4 to 3, so no run it could equal exists).

`--fault freeze` stops the host's processes of the run instead (SIGSTOP: a hung device; its host
answers, its heartbeat goes on), with the hang timeout left at its default; `--fault cut` drops
the host's training traffic but sshd's (`sim fault --cut-training`: its ranks run, every rank waits
in a collective, its heartbeat goes on), the hang timeout at its default too; `--baseline REV` runs
ddplaunch of an earlier commit too (a git worktree of it), interleaved, as `ddplaunch-REV`.

Needs root and pdsh (`apt-get install -y pdsh`); tears its sim down at the end.
Usage: .venv/bin/python bench/recovery.py [--trials 5] [--give-up 600] [--fault crash|freeze|cut]
       [--kinds ddplaunch,elastic] [--baseline REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.record.codec import to_data  # noqa: E402
from ddplaunch.record.events import read_events  # noqa: E402
from ddplaunch.record.view import RunView  # noqa: E402

PREFIX, SUBNET = "drc", "10.213.60.0/24"
#: The crashed host (0-based): host 3, neither ddplaunch's master nor elastic's rendezvous host, or
#: with --victim master host 1, ddplaunch's master (elastic's rendezvous host: not run then).
VICTIMS = {"worker": 2, "master": 0}
TRAIN = ["--epochs", "1", "--samples", "1152", "--batch-size", "8", "--ckpt-every", "4", "--log-every", "1",
         "--seed", "3", "--step-sleep", "0.3"]
STEP_RE = re.compile(r"\bstep=(\d+)\b")
RESUMED_RE = re.compile(r"resumed from \S+ at step (\d+)")
SHA_RE = re.compile(r"final_weights_sha256=([0-9a-f]{64})")
#: A recovery's phases in ddplaunch's record (seconds after the crash): the host named, every
#: survivor stopped, the relaunch started, the relaunched job's first step.
PHASES = (("named_s", "detected_at"), ("stopped_s", "stopped_at"), ("relaunched_s", "relaunched_at"),
          ("first_step_s", "first_step_at"))


class Lines:
    """A process's output lines, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.cond = proc, [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append((time.time(), line.rstrip("\n")))
                self.cond.notify_all()

    def wait(self, pred, timeout: float, after: float = 0.0):
        """The first (time, line) that arrived after `after` and matches pred, or None by the deadline."""
        deadline, seen = time.time() + timeout, 0
        with self.cond:
            while True:
                for t, line in self.lines[seen:]:
                    if t > after and pred(line):
                        return t, line
                seen = len(self.lines)
                left = deadline - time.time()
                if left <= 0 or (self.proc.poll() is not None and seen == len(self.lines)):
                    return None
                self.cond.wait(min(left, 0.5))

    def text(self) -> str:
        with self.cond:
            return "\n".join(line for _, line in self.lines)


def run_processes(tag: str) -> list[int]:
    from ddplaunch.hostside import procs

    return list(procs.run_processes(tag, any_netns=True))


def kill_tagged(tag: str) -> None:
    """SIGKILL what this benchmark started under `tag` (by PID; every sim host shares our PID space)."""
    for pid in run_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spec_for(cluster, work: Path, name: str, spare: bool) -> Path:
    import yaml

    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"]
    data.update(hosts=hosts[:3], nproc_per_node=1, workdir=str(ROOT), healthcheck={"sizes": ["64K"], "iterations": 1},
                env={"DDPLAUNCH_CKPT_DIR": str(work / name / "ckpt")},
                job={"script": "jobs/train.py", "args": TRAIN})
    if spare:
        data["recovery"] = {"max_host_failures": 1, "spares": [hosts[3]]}
    (work / name).mkdir(parents=True, exist_ok=True)
    path = work / name / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def elastic_argv(cluster, work: Path, name: str, port: int, tag: str) -> list[str]:
    addrs = [h.addr for h in cluster.hosts]
    ckpt = work / name / "ckpt"
    remote = (f"cd {shlex.quote(str(ROOT))} && exec env DDPLAUNCH_RUN_ID={tag} GLOO_SOCKET_IFNAME={cluster.ifname} "
              f"DDPLAUNCH_CKPT_DIR={ckpt} PYTHONUNBUFFERED=1 {sys.executable} -m torch.distributed.run "
              f"--nnodes 3:4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint {addrs[0]}:{port} "
              f"--rdzv-id {tag} --max-restarts 3 jobs/train.py {' '.join(TRAIN)}")
    return ["pdsh", "-R", "ssh", "-f", "4", "-w", ",".join(addrs), remote]


@contextlib.contextmanager
def worktree(rev: Optional[str], path: Path) -> Iterator[None]:
    """A git worktree of commit `rev` at `path` while the block runs (nothing without a `rev`)."""
    if rev:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
    try:
        yield
    finally:
        if rev:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)


def freeze(tag: str, host: str) -> None:
    """SIGSTOP the run's processes on `host` (torchrun, its workers): as a hung device leaves them."""
    from ddplaunch.hostside import procs

    for pid, environ in procs.run_processes(tag, any_netns=True).items():
        if environ.get(b"DDPLAUNCH_HOST") != host.encode():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"RANK" in environ or b"torch.distributed.run" in argv or b"torchrun" in argv:  # not its shell, its agent
            os.kill(pid, signal.SIGSTOP)


def trial(kind: str, cluster, work: Path, n: int, give_up: float, env: dict, victim: str = "worker",
          fault: str = "crash", baseline: Optional[Path] = None) -> dict:
    tag = f"bench-{kind}-{victim}-{n}"
    crashed = cluster.hosts[VICTIMS[victim]].name
    # a home of its own: the hosts an earlier trial lost are remembered bad there, and the next
    # `up` would put the spare in the victim's place (recovery.remember_bad_hosts)
    env = dict(env, DDPLAUNCH_HOME=str(work / "state" / tag))
    at = random.randint(8, 20)
    cwd = ROOT
    if kind.startswith("ddplaunch"):
        argv = [sys.executable, "-m", "ddplaunch", "up", str(spec_for(cluster, work, tag, spare=True)),
                "--run-id", tag]
        if kind != "ddplaunch":  # an earlier commit's, from its worktree
            cwd, env = baseline, dict(env, PYTHONPATH=str(baseline))
    else:
        (work / tag).mkdir(parents=True, exist_ok=True)
        argv = elastic_argv(cluster, work, tag, random.randint(20000, 39999), tag)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    lines = Lines(proc)
    row = {"kind": kind, "victim": victim, "trial": n, "crash_at_step": at, "fault": fault}
    try:
        hit = lines.wait(lambda line: (m := STEP_RE.search(line)) is not None and int(m.group(1)) >= at, 240)
        if hit is None:
            row["error"] = "never reached the crash step:\n" + lines.text()[-2000:]
            return row
        t_crash = time.time()
        if fault == "freeze":
            freeze(tag, crashed)
        elif fault == "cut":
            sim_fault(cluster, crashed, cut_training=True)
        else:
            sim_fault(cluster, crashed, crash=True)
        resumed = lines.wait(lambda line: RESUMED_RE.search(line) is not None, give_up, after=t_crash)
        first = None
        if resumed is not None:
            first = lines.wait(lambda line: STEP_RE.search(line) is not None,
                               max(1.0, t_crash + give_up - time.time()), after=resumed[0] - 1e-6)
        if first is not None:
            # The last step done before the crash is the last one printed before the relaunch: lines
            # still in flight at t_crash count, and every printed step all_reduced over all ranks.
            last_before = max(int(m.group(1)) for t, line in list(lines.lines)
                              if t < resumed[0] and (m := STEP_RE.search(line)))
            row["resumed_s"] = round(first[0] - t_crash, 1)
            row["last_step"], row["resumed_from"] = last_before, int(RESUMED_RE.search(resumed[1]).group(1))
            row["redone"] = row["last_step"] - row["resumed_from"]
        if kind.startswith("ddplaunch"):
            proc.wait(timeout=max(60.0, t_crash + give_up - time.time()))
            view = RunView.of(read_events(Path(env["DDPLAUNCH_HOME"]) / "runs" / tag))
            rec = to_data(view.recoveries[0]) if view.recoveries else {}
            for phase, key in PHASES:
                if rec.get(key) is not None:
                    row[phase] = round(rec[key] - t_crash, 1)
            row["exit"] = proc.returncode
        else:
            proc.send_signal(signal.SIGINT)
        row["sha"] = (SHA_RE.findall(lines.text()) or [None])[-1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(tag)
        if fault in ("crash", "cut"):
            sim_fault(cluster, crashed, clear=True)
    return row


def reference(cluster, work: Path, env: dict) -> str:
    spec = spec_for(cluster, work, "bench-ref", spare=False)
    out = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", "bench-ref"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    found = SHA_RE.findall(out.stdout)
    if not found:
        sys.exit(f"the reference run printed no final weights:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return found[-1]


def _med(xs: list) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"


def table(rows: list[dict], ref: str, give_up: float) -> str:
    out = ["| launcher | host | trials | fault → host named (s) | fault → resumed step (s) | steps redone | "
           "final weights = uninterrupted |", "|---|---|---:|---:|---:|---:|---:|"]
    for kind, victim in sorted({(r["kind"], r["victim"]) for r in rows}):
        mine = [r for r in rows if (r["kind"], r["victim"]) == (kind, victim)]
        resumed = [r["resumed_s"] for r in mine if "resumed_s" in r]
        label = (f"{kind}, 3 hosts + 1 spare" if kind.startswith("ddplaunch")
                 else "torchrun --nnodes 3:4 (c10d), pdsh") + (f" ({mine[0].get('fault', 'crash')})")
        # elastic runs are stopped once resumed (their world changed: nothing to compare): "-", not 0/N
        equal = f"{sum(r.get('sha') == ref for r in mine)}/{len(mine)}" if kind.startswith("ddplaunch") else "-"
        missing = len(mine) - len(resumed)
        out.append(f"| {label} | {victim} | {len(mine)} | {_med([r['named_s'] for r in mine if 'named_s' in r])} | "
                   f"{_med(resumed)}{f'; {missing} not resumed within {give_up:.0f}s' if missing else ''}"
                   f" | {_med([r['redone'] for r in mine if 'redone' in r])} | {equal} |")
    phased = [r for r in rows if r["kind"].startswith("ddplaunch")]
    if phased:
        out += ["", "ddplaunch's phases (median seconds after the fault, from its record):", "",
                "| launcher | host | named | survivors stopped | relaunch started | first resumed step |",
                "|---|---|---:|---:|---:|---:|"]
        for kind, victim in sorted({(r["kind"], r["victim"]) for r in phased}):
            mine = [r for r in phased if (r["kind"], r["victim"]) == (kind, victim)]
            cells = [_med([r[k] for r in mine if k in r]) for k, _ in PHASES]
            out.append(f"| {kind} | {victim} | {' | '.join(cells)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--give-up", type=float, default=600.0)
    ap.add_argument("--kinds", default="ddplaunch,elastic", help="launchers to run, interleaved")
    ap.add_argument("--victims", default="worker,master",
                    help="crash a worker's host, the master's (ddplaunch only: it is elastic's rendezvous host)")
    ap.add_argument("--dist-timeout", type=int, default=None,
                    help="the job's collective timeout in seconds (jobs/train.py --dist-timeout; default 300)")
    ap.add_argument("--fault", choices=("crash", "freeze", "cut"), default="crash")
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also ddplaunch of git commit REV (a worktree of it), interleaved, as ddplaunch-REV")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the runs' records and logs (printed: where)")
    args = ap.parse_args()
    kinds, victims = args.kinds.split(","), args.victims.split(",")
    kinds += [f"ddplaunch-{args.baseline}"] if args.baseline else []
    if "elastic" in kinds and shutil.which("pdsh") is None:
        sys.exit("pdsh missing: apt-get install -y pdsh")
    global sim_fault
    from ddplaunch.sim import SimConfig, sim_down, sim_up
    from ddplaunch.sim.faults import sim_fault
    cluster = sim_up(SimConfig(n_hosts=4, prefix=PREFIX, subnet=SUBNET, nproc_per_node=1, workdir=ROOT))
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-recovery-"))
    env = dict(os.environ, DDPLAUNCH_HOME=str(work / "state"), PYTHONUNBUFFERED="1",
               PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=(f"-i {cluster.key} -o UserKnownHostsFile={cluster.known_hosts} "
                                                    "-o StrictHostKeyChecking=yes -o BatchMode=yes -o LogLevel=ERROR "
                                                    "-l root %h"))
    if args.dist_timeout is not None:
        TRAIN.extend(["--dist-timeout", str(args.dist_timeout)])
    runs = [(k, v) for v in victims for k in kinds if not (k == "elastic" and v == "master")]
    rows: list[dict] = []
    baseline = work / "baseline"
    try:
        with worktree(args.baseline, baseline):
            ref = reference(cluster, work, env)
            for n in range(args.trials):
                for kind, victim in (runs if n % 2 == 0 else runs[::-1]):
                    row = trial(kind, cluster, work, n, args.give_up, env, victim, args.fault, baseline)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        sim_down(cluster.state_dir)
        if args.keep:
            print(f"records and logs kept in {work}/state/runs")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows, ref, args.give_up))
    if args.json:
        args.json.write_text(json.dumps({"reference_sha": ref, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
