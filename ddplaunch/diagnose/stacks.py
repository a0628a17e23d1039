"""Where each rank of a hung job is stuck: a py-spy stack dump of every worker on every host
(hostside/dumpstacks.py, found by the run's tag and their RANK), one line grouping the ranks by the
call they are in, the dumps saved in the run's directory, and the hosts whose ranks are frozen
(stopped, or in an uninterruptible wait) while another host's can run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ddplaunch.backends.contract import Launcher
from ddplaunch.diagnose.hostprograms import ask_hosts
from ddplaunch.hostside.payloads import HostFrozen
from ddplaunch.hostside.procs import FROZEN, FROZEN_WHY
from ddplaunch.output.console import hosts_named, rank_ranges
from ddplaunch.plan.hostprogram import host_program
from ddplaunch.plan.launch import tool_python
from ddplaunch.record.runs import write_private
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: The rank-side step timing's file (in the package, or staged in a host's run directory): its
#: wrappers sit between a job's line and torch's call.
TIMING_FILE = re.compile(r"/(hostside|\.ddplaunch/runs/[^/]+)/steptiming\.py$")
#: Seconds py-spy gets per host (all its workers are dumped in parallel there).
DUMP_TIMEOUT = 30.0


@dataclass
class RankStack:
    """Where one process of the run is, from its py-spy dump."""

    host: str
    pid: int
    rank: Optional[int]
    where: str
    threads: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[str] = None


def collect_stacks(backend: Launcher[Any], spec: ClusterSpec, run_id: str, hosts: Optional[list[HostSpec]] = None
                   ) -> tuple[list[RankStack], list[str], dict[str, Any]]:
    """Dump every worker of run `run_id` on every host with py-spy.

    Returns:
        (one RankStack per dumped process, one line per problem naming its hosts, raw answers by
        host label).
    """
    def command(host: HostSpec) -> tuple[str, str]:
        python = tool_python(spec, host)
        return host_program("dumpstacks", python, run_id, python)

    stacks: list[RankStack] = []
    raw: dict[str, Any] = {}
    found: dict[str, list[str]] = {}  # a problem -> the hosts that have it: one line each at 1,000 hosts

    def problem(host: HostSpec, what: str) -> None:
        found.setdefault(what, []).append(host.label)
    for answer in ask_hosts(backend, command, hosts, DUMP_TIMEOUT):
        host, data = answer.host, answer.data
        if answer.error is not None or answer.code is None:
            error = str(answer.error)
            problem(host, f"no stack dump: {error.removeprefix(host.label + ': ')}")
            continue
        if not isinstance(data, dict):
            problem(host, f"no stack dump (exit {answer.code}): {answer.output.strip()[-300:]}")
            continue
        raw[host.label] = data
        if not data["procs"]:
            problem(host, "no process of this run (torchrun never started there?)")
        elif not data["py_spy"]:
            problem(host, f"py-spy not found (looked for {', '.join(data['looked_for'])} and "
                          "PATH): install it on the host with `pip install py-spy` in the job's environment")
        elif not data["workers"]:
            problem(host, "no worker started yet: torchrun is still in rendezvous (a host missing? see rdzv_timeout)")
        for proc in data["procs"]:
            threads = proc.get("threads") or []
            where = stuck_at(threads, proc["cwd"]) if threads else \
                f"frozen (process state {proc['state']}: {FROZEN_WHY.get(proc['state'], 'cannot run')})" \
                if proc.get("state") in FROZEN else "unknown"
            stacks.append(RankStack(host=host.label, pid=proc["pid"], rank=proc["rank"], threads=threads,
                                    where=where, error=proc.get("error")))
    return stacks, [f"{hosts_named(labels)}: {what}" for what, labels in found.items()], raw


def frozen_hosts(raw: dict[str, Any]) -> dict[str, str]:
    """Hosts whose every rank process is frozen (stopped, or in an uninterruptible wait) while
    some other host has a rank that can run: label -> why. Empty when the evidence pins nothing
    (every host frozen alike, or no host's ranks are)."""
    frozen, running = {}, False
    for host, data in raw.items():
        workers = [p for p in data.get("procs") or [] if p.get("rank") is not None]
        states = {p.get("state") for p in workers}
        if workers and states <= set(FROZEN):
            pids = " ".join(str(p["pid"]) for p in workers)
            frozen[host] = (f"its ranks are frozen (process state {'/'.join(sorted(str(s) for s in states))}: "
                            f"pid {pids}) while the host answers")
        elif workers:
            running = True
    return frozen if running else {}


def frozen_by_agents(reports: dict[str, HostFrozen], stacks: list[RankStack], hosts: int
                     ) -> tuple[list[RankStack], dict[str, str]]:
    """What the node agents said of their frozen ranks (host label -> its latest word; the stage
    has `hosts` hosts), for the ranks no stack dump covered (a host whose dump failed or ran out
    of time: a thousand hosts' dumps need not answer for a frozen rank to be named): their stacks
    (frozen, with the state), and the hosts whose every rank is frozen while another host has a
    rank that can run."""
    dumped = {(s.host, s.rank) for s in stacks}
    found: list[RankStack] = []
    whole: dict[str, str] = {}
    for host, said in reports.items():
        ranks = said.states()
        for rank, (state, pid) in sorted(ranks.items()):
            if (host, rank) not in dumped:
                why = FROZEN_WHY.get(state, "cannot run")
                found.append(RankStack(host=host, pid=pid, rank=rank, where=f"frozen (process state {state}: {why})"))
        if ranks and len(ranks) >= said.of:
            states = "/".join(sorted({state for state, _ in ranks.values()}))
            pids = " ".join(str(pid) for _, pid in ranks.values())
            whole[host] = f"its ranks are frozen (process state {states}: pid {pids}), as its node's agent saw"
    return found, whole if len(whole) < hosts else {}


def stuck_at(threads: list[dict[str, Any]], cwd: str) -> str:
    """`all_reduce at jobs/x.py:14`: the call the user's innermost frame is in, in the main thread.

    User frames are those outside site-packages and the Python library; the call is the first
    frame inside them that is not a decorator's wrapper.
    """
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), threads[0] if threads else None)
    frames = (main or {}).get("frames") or []
    if not frames:
        return "unknown"
    for i, frame in enumerate(frames):  # innermost first
        if _is_user(frame["filename"]):
            inner = [f["name"] for f in frames[:i] if "wrapper" not in f["name"] and "<locals>" not in f["name"]]
            call = inner[-1] if inner else frame["name"]
            return f"{call} at {_relative(frame['filename'], cwd)}:{frame['line']}"
    top = frames[0]
    return f"{top['name']} ({top.get('short_filename') or top['filename']}:{top['line']})"


def _is_user(filename: str) -> bool:
    return not (re.search(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d", filename)
                or filename.startswith("<") or TIMING_FILE.search(filename) is not None)


def _relative(filename: str, cwd: str) -> str:
    prefix = cwd.rstrip("/") + "/"
    return filename[len(prefix):] if filename.startswith(prefix) else filename


def render_stack(stack: RankStack) -> str:
    """A py-spy-like text dump of one process (what is saved in the run's stacks/ directory)."""
    who = f"rank {stack.rank}" if stack.rank is not None else "torchrun"
    out = [f"{who} on {stack.host}, pid {stack.pid}: {stack.where}"]
    if stack.error:
        out.append(f"  py-spy failed: {stack.error}")
    for thread in stack.threads:
        out.append(f"Thread {thread.get('os_thread_id')} ({'active' if thread.get('active') else 'idle'}): "
                   f"\"{thread.get('thread_name')}\"")
        out += [f"    {f['name']} ({f['filename']}:{f['line']})" for f in thread.get("frames", [])]
    return "\n".join(out) + "\n"


def summarize_stacks(stacks: list[RankStack]) -> str:
    """One line: ranks grouped by where they are stuck, e.g.
    `rank 0 (dlt1): all_reduce at jobs/x.py:43 — rank 1 (dlt2): barrier at jobs/x.py:45`."""
    ranked = [s for s in stacks if s.rank is not None] or stacks
    groups: dict[str, list[RankStack]] = {}
    for s in sorted(ranked, key=lambda s: (s.rank if s.rank is not None else -1, s.host)):
        groups.setdefault(s.where, []).append(s)
    parts = []
    for where, members in groups.items():
        names = list(dict.fromkeys(m.host for m in members))
        hosts = hosts_named(names)  # every host's stacks are in the run directory
        if members[0].rank is None:
            parts.append(f"torchrun ({hosts}): {where}")
            continue
        ranks = [m.rank for m in members if m.rank is not None]
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)} ({hosts}): {where}")
    return " — ".join(parts)


def save_stacks(stacks: list[RankStack], raw: dict[str, Any], summary: list[str], out_dir: Path) -> Path:
    """Write stacks/<host>-rank<r>.txt per process, the raw py-spy JSON per host, and summary.txt."""
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for stack in stacks:
        name = f"{stack.host}-rank{stack.rank}" if stack.rank is not None else f"{stack.host}-torchrun-{stack.pid}"
        write_private(out_dir / f"{name}.txt", render_stack(stack))
    for host, data in raw.items():
        write_private(out_dir / f"{host}.json", json.dumps(data, indent=2, sort_keys=True))
    write_private(out_dir / "summary.txt", "\n".join(summary) + "\n")
    return out_dir
