"""Which host's training link is broken: a TCP test of every link between a hung job's hosts.

When the job hangs and no host's ranks are frozen, the hosts may still answer their management
channel (sshd, slurmd) while one host's training network drops everything: every rank then waits
in a collective until the job's own timeout. `broken_links` runs hostside/links.py on every host
at once (each listens on one port and connects to every peer) and names the hosts that reach no
peer and that no peer reaches while the other hosts reach each other; the run's spares take part
as witnesses (so a run of two hosts can tell which one is cut off). Anything less clear names
nobody: the hang stays the job's failure.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from ddplaunch.backends.contract import Launcher
from ddplaunch.diagnose.hostprograms import ask_hosts
from ddplaunch.plan.hostprogram import host_program
from ddplaunch.plan.launch import derive_port, rendezvous_addr, tool_python
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: Seconds every host keeps trying its peers (a healthy link answers in milliseconds).
WINDOW_S = 4.0


def link_answers(backend: Launcher[Any], spec: ClusterSpec, hosts: list[HostSpec], port: int,
                 window: float = WINDOW_S) -> dict[str, Optional[dict[str, Any]]]:
    """Each host's answer (reached, came_from, error) to a link test on `port`, None for a host
    that gave none."""
    addrs = {h.label: rendezvous_addr(h) for h in hosts}

    def command(host: HostSpec) -> tuple[str, str]:
        args = {"port": port, "window": window, "peers": [a for label, a in addrs.items() if label != host.label]}
        return host_program("links", tool_python(spec, host), json.dumps(args, sort_keys=True))

    return {a.host.label: a.data if isinstance(a.data, dict) and not a.data.get("error") else None
            for a in ask_hosts(backend, command, hosts, window + 20)}


def judge(addrs: dict[str, str], answers: dict[str, Optional[dict[str, Any]]], port: int) -> dict[str, str]:
    """Hosts (label -> why) cut off from every peer while at least two other hosts reach each
    other. Pure: `addrs` is label -> address, `answers` what each host said."""
    if len(addrs) < 3 or any(a is None for a in answers.values()):
        return {}

    reached = {h: set((a or {}).get("reached", [])) for h, a in answers.items()}  # O(1) a lookup: 1,000 hosts

    def ok(a: str, b: str) -> bool:  # a connected to b
        return addrs[b] in reached[a]
    labels = list(addrs)
    cut = {h for h in labels if not any(ok(h, p) or ok(p, h) for p in labels if p != h)}
    rest = [h for h in labels if h not in cut]
    if not cut or len(rest) < 2 or not all(ok(a, b) for a in rest for b in rest if a != b):
        return {}
    return {h: (f"its training link is broken: no TCP connection to or from {', '.join(rest)} on port {port} "
                f"within {WINDOW_S:g}s, while they reach each other (its management channel answers)")
            for h in cut}


def judge_run(run: list[str], addrs: dict[str, str], answers: dict[str, Optional[dict[str, Any]]],
              port: int) -> dict[str, str]:
    """`judge` over the run's hosts and the witnesses (spares) that answered: a witness that gave
    no answer is left out (it may have died while it waited), and only the run's hosts are named.
    Two hosts alone cannot tell which of them is cut off; with a spare as the third, they can."""
    heard = {h: a for h, a in answers.items() if a is not None or h in run}
    named = judge({h: addrs[h] for h in heard}, heard, port)
    return {h: why for h, why in named.items() if h in run}


def broken_links(backend: Launcher[Any], spec: ClusterSpec, hosts: list[HostSpec], run_id: str,
                 witnesses: Sequence[HostSpec] = ()) -> dict[str, str]:
    """The hosts (label -> why) whose training link is broken, by a link test run now on `hosts`
    and on `witnesses` (the run's spares, which test their links too but are never named)."""
    port = derive_port(f"{run_id}-links")
    run = [h.label for h in hosts]
    tested = [*hosts, *(w for w in witnesses if w.label not in run)]
    return judge_run(run, {h.label: rendezvous_addr(h) for h in tested}, link_answers(backend, spec, tested, port),
                     port)
