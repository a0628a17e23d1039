"""Which host's training link is broken: a TCP test of every link between a hung job's hosts.

When the job hangs and no host's ranks are frozen, the hosts may still answer their management
channel (sshd, slurmd) while one host's training network drops everything: every rank then waits
in a collective until the job's own timeout. `broken_links` runs hostside/linkprobe.py on every host
at once (each listens on one port and connects to its peers: every other host up to
FULL_MESH_UP_TO hosts, beyond that the hosts at offsets 1, 2, 4, 8, ... after it in the run's
order, ~log2(hosts) each: O(hosts log hosts) links, not hosts²) and names the hosts that reach
none of their peers and that none reach, while every link tested between the other hosts works;
the run's spares take part as witnesses (so a run of two hosts can tell which one is cut off).
Anything less clear names nobody: the hang stays the job's failure.
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
#: Up to this many hosts each tests every other; beyond, ~log2(hosts) peers each (see above).
FULL_MESH_UP_TO = 16
#: Peers a verdict names at most.
NAMED_PEERS = 8


def peers_of(labels: Sequence[str]) -> dict[str, list[str]]:
    """Whom each host connects to: every other host, or past FULL_MESH_UP_TO the hosts at offsets
    1, 2, 4, ... after it (mod the count): each host has ~log2(n) links out and as many in."""
    n = len(labels)
    if n <= FULL_MESH_UP_TO:
        return {h: [p for p in labels if p != h] for h in labels}
    offsets = sorted({(1 << k) % n for k in range(n.bit_length())} - {0})
    return {h: [labels[(i + o) % n] for o in offsets] for i, h in enumerate(labels)}


def link_answers(backend: Launcher[Any], spec: ClusterSpec, hosts: list[HostSpec], port: int,
                 peers: dict[str, list[str]], window: float = WINDOW_S) -> dict[str, Optional[dict[str, Any]]]:
    """Each host's answer (reached, came_from, error) to a link test on `port` with its `peers`,
    None for a host that gave none."""
    addrs = {h.label: rendezvous_addr(h) for h in hosts}
    callers: dict[str, list[str]] = {h: [] for h in addrs}
    for h, mine in peers.items():
        for p in mine:
            callers[p].append(addrs[h])

    def command(host: HostSpec) -> tuple[str, str]:
        args = {"port": port, "window": window, "peers": [addrs[p] for p in peers[host.label]],
                "callers": callers[host.label]}
        return host_program("linkprobe", tool_python(spec, host), json.dumps(args, sort_keys=True))

    return {a.host.label: a.data if isinstance(a.data, dict) and not a.data.get("error") else None
            for a in ask_hosts(backend, command, hosts, window + 20)}


def judge(addrs: dict[str, str], answers: dict[str, Optional[dict[str, Any]]], port: int,
          peers: Optional[dict[str, list[str]]] = None) -> dict[str, str]:
    """Hosts (label -> why) cut off from every peer they tested with while every link tested
    between at least two other hosts works. Pure: `addrs` is label -> address, `answers` what each
    host said, `peers` whom each connected to (default: `peers_of` the hosts in `addrs`' order;
    links to a host not in `addrs` are left out)."""
    if len(addrs) < 3 or any(a is None for a in answers.values()):
        return {}
    tested = {h: [p for p in mine if p in addrs] for h, mine in (peers or peers_of(list(addrs))).items() if h in addrs}
    reached = {h: set((a or {}).get("reached", [])) for h, a in answers.items()}  # O(1) a lookup: 1,000 hosts
    links: dict[str, set[str]] = {h: set() for h in addrs}  # host -> the hosts it shares a tested link with
    for a, mine in tested.items():
        for b in mine:
            links[a].add(b)
            links[b].add(a)

    def ok(a: str, b: str) -> bool:  # a connected to b
        return addrs[b] in reached.get(a, ())
    cut = {h for h, mine in links.items() if mine and not any(ok(h, p) or ok(p, h) for p in mine)}
    rest = [h for h in addrs if h not in cut]
    among = [(a, b) for a in rest for b in tested.get(a, []) if b not in cut]
    if not cut or len(rest) < 2 or not among or not all(ok(a, b) for a, b in among):
        return {}
    order = {h: i for i, h in enumerate(addrs)}
    return {h: (f"its training link is broken: no TCP connection to or from "
                f"{_some(sorted(links[h] - cut, key=order.__getitem__))} on port {port} within {WINDOW_S:g}s, while "
                f"the other hosts reach each other (its management channel answers)") for h in cut}


def _some(hosts: list[str]) -> str:
    more = len(hosts) - NAMED_PEERS
    return ", ".join(hosts[:NAMED_PEERS]) + (f" and {more} more" if more > 0 else "")


def judge_run(run: list[str], addrs: dict[str, str], answers: dict[str, Optional[dict[str, Any]]],
              port: int, peers: Optional[dict[str, list[str]]] = None) -> dict[str, str]:
    """`judge` over the run's hosts and the witnesses (spares) that answered: a witness that gave
    no answer is left out (it may have died while it waited), and only the run's hosts are named.
    Two hosts alone cannot tell which of them is cut off; with a spare as the third, they can."""
    heard = {h: a for h, a in answers.items() if a is not None or h in run}
    named = judge({h: addrs[h] for h in heard}, heard, port, peers or peers_of(list(addrs)))
    return {h: why for h, why in named.items() if h in run}


def broken_links(backend: Launcher[Any], spec: ClusterSpec, hosts: list[HostSpec], run_id: str,
                 witnesses: Sequence[HostSpec] = ()) -> dict[str, str]:
    """The hosts (label -> why) whose training link is broken, by a link test run now on `hosts`
    and on `witnesses` (the run's spares, which test their links too but are never named)."""
    port = derive_port(f"{run_id}-links")
    run = [h.label for h in hosts]
    tested = [*hosts, *(w for w in witnesses if w.label not in run)]
    peers = peers_of([h.label for h in tested])
    return judge_run(run, {h.label: rendezvous_addr(h) for h in tested},
                     link_answers(backend, spec, tested, port, peers), port, peers)
