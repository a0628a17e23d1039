"""The kernel's OOM killer, named: a rank or torchrun that died by SIGKILL on a host that answers.

A SIGKILL says nothing of who sent it. When a failed node's rank was killed by signal 9, or the
node's session or step ended by a signal (torchrun itself killed), the host's kernel log is read
(hostside/oomlog.py, all such hosts at once, with a short timeout) for the OOM killer's line about
those pids: every rank of the node that started (each said its pid, entry.py's `RankStart`) and
never said it exited, and torchrun's (its pid file). A script that bypasses the entry says no pid:
then torchrun's failure report is read for them. Found, it goes into the node's outcome and the
stage's diagnosis in the kernel's own words; not found or not readable, nothing is said beyond
the signal.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ddplaunch.backends.contract import Launcher
from ddplaunch.diagnose.hostprograms import ask_hosts
from ddplaunch.plan.hostprogram import host_program
from ddplaunch.plan.launch import LaunchPlan, in_run_dir, tool_python
from ddplaunch.record.results import FAILED, NodeOutcome, StageResult
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: Seconds the kernel-log read may take on every host at once.
PROBE_TIMEOUT = 15.0
_RANK_RE = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)")
_KILLED_RE = re.compile(r"\bexitcode\s*:\s*-9\s*\(pid:\s*(\d+)\)")


def killed_ranks(lines: list[str]) -> dict[int, int]:
    """pid -> global rank of every rank torchrun's failure report says signal 9 ended."""
    out: dict[int, int] = {}
    rank = None
    for line in lines:
        if (m := _RANK_RE.search(line)):
            rank = int(m.group(1))
        elif (m := _KILLED_RE.search(line)) and rank is not None:
            out[int(m.group(1))] = rank
            rank = None
    return out


def _suspects(result: StageResult) -> list[NodeOutcome]:
    """Failed nodes whose rank or torchrun died by SIGKILL (on a host that answered: not lost)."""
    return [o for o in result.outcomes if o.state == FAILED and not o.never_started
            and (o.rank_exit_code == -9 or killed_ranks(o.tail) or o.signalled)]


def unfinished_ranks(result: StageResult, host: str) -> dict[int, int]:
    """pid -> global rank of `host`'s ranks that said they started and never said they exited."""
    exited = {e.rank for e in result.rank_exits}
    return {s.pid: s.rank for s in result.rank_starts if s.host == host and s.rank not in exited and s.pid}


def name_oom_kills(backend: Launcher[Any], spec: ClusterSpec, plan: LaunchPlan, result: StageResult) -> list[str]:
    """Diagnosis lines for the stage's SIGKILLs that the kernel's OOM killer sent (each node's
    outcome says it too); nothing when there is none, or no kernel log could be read."""
    suspects = _suspects(result)
    if not suspects:
        return []
    by_host = {o.host: o for o in suspects}
    hosts = [n.host for n in plan.nodes if n.host is not None and n.host_label in by_host]
    ranks = {o.host: unfinished_ranks(result, o.host) or killed_ranks(o.tail) for o in suspects}

    def command(host: HostSpec) -> tuple[str, str]:
        args = {"pids": sorted(ranks[host.label]), "since": result.started_at,
                "pid_files": [str(in_run_dir(plan.run_id, f"node{by_host[host.label].node_rank}.pid"))]}
        return host_program("oomlog", tool_python(spec, host), json.dumps(args, sort_keys=True))

    lines = []
    for answer in ask_hosts(backend, command, hosts, PROBE_TIMEOUT):
        killed = answer.data.get("killed") if isinstance(answer.data, dict) else None
        if not killed:
            continue
        outcome = by_host[answer.host.label]
        for pid, said in sorted(killed.items()):
            rank = ranks[answer.host.label].get(int(pid))
            who = f"rank {rank} (pid {pid})" if rank is not None else f"torchrun (pid {pid})"
            lines.append(f"{answer.host.label}: {who} was killed by the kernel's OOM killer: {said}")
            outcome.detail = "; ".join(x for x in (outcome.detail, f"{who} killed by the OOM killer") if x)
            outcome.oom_killed.append(who)
    return lines
