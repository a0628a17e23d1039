"""`ddplaunch top [RUN_ID]`: a run's hosts, live: their state, their ranks' newest steps.

`table` renders the fold of the run's events (record/view.py: states, stragglers, recoveries) and
the hosts' live status (record/live.py, as their agents last said it): per host its state, its
ranks' newest step, the median step time and the share of it spent waiting at the collectives,
its straggler score (how much longer its ranks compute than the median host's), its slowest rank,
when it last reported. At most MAX_ROWS hosts are rows — the ones to look at first — so a
refresh costs O(hosts) at any size. Pure: the loop that reads the run and refreshes the table
each second is supervise/follow.py's `top`.
"""

from __future__ import annotations

import statistics
from typing import Optional

from rich.table import Table

from ddplaunch.output.console import state_text
from ddplaunch.record.live import LiveSteps
from ddplaunch.record.results import NodeState
from ddplaunch.record.view import RunView
from ddplaunch.report.goodput import worth_saying

#: Hosts shown one row each; beyond, the hosts not running and the slowest come first, this many.
MAX_ROWS = 30


def scores(live: Optional[LiveSteps]) -> dict[str, float]:
    """Each host's straggler score: how much longer its ranks compute (step time minus wait) than
    the median host's (0.4: 40 % longer). Computed once per refresh: O(hosts)."""
    if live is None or len(live.hosts) < 2:
        return {}
    compute = {h: max(0.0, n.step_s - n.wait_s) for h, n in live.hosts.items()}
    median = statistics.median(compute.values())
    return {h: c / median - 1 for h, c in compute.items()} if median > 0 else {}


def table(view: RunView, live: Optional[LiveSteps], now: float) -> Table:
    """The table: a row per host (its ranks' newest status, the rank that computes longest); at
    most MAX_ROWS of them — the hosts not running and the slowest first — and a line for the rest."""
    stage = view.running.stage if view.running is not None else view.launches[-1].started.stage \
        if view.launches else None
    title = f"run {view.run_id}: {view.ended.state if view.ended else stage or 'starting'}"
    n = len(view.recoveries)
    title += f", {n} recover{'y' if n == 1 else 'ies'}" if n else ""
    hosts_now = live.hosts if live is not None else {}
    hosts = list(dict.fromkeys([*view.hosts, *view.host_states, *hosts_now]))
    score = scores(live)
    named = {s.host: s.slowdown for s in view.stragglers}
    shown = hosts
    if len(hosts) > MAX_ROWS:
        def urgency(host: str) -> tuple[int, float]:
            event = view.host_states.get(host)
            trouble = host in named or (event is not None and event.state not in (NodeState.RUNNING, NodeState.OK))
            return (0 if trouble else 1, -score.get(host, 0.0))
        shown = sorted(hosts, key=urgency)[:MAX_ROWS]
        title += f"; {len(hosts)} hosts, the {MAX_ROWS} to look at first"
    spent = worth_saying(view)  # an ended run's goodput ledger, under the table
    out = Table(title=title, title_justify="left", caption=spent.line() if spent is not None else None,
                caption_justify="left")
    for name in ("host", "state", "ranks", "step", "step time", "wait", "straggler score", "slowest rank",
                 "last report"):
        out.add_column(name, justify="left" if name in ("host", "state") else "right")
    for host in shown:
        event = view.host_states.get(host)
        state = state_text(event) if event is not None else ""
        if host in named:
            state = f"{state}; STRAGGLER {named[host]:+.0%}".lstrip("; ")
        row = hosts_now.get(host)
        if row is None:
            out.add_row(host, state, "", "", "", "", "", "", "")
            continue
        out.add_row(host, state, str(row.ranks), str(row.step), f"{row.step_s * 1e3:.0f} ms",
                    f"{100 * row.wait_s / row.step_s:.0f}%" if row.step_s > 0 else "-",
                    f"{score[host]:+.0%}" if host in score else "-",
                    f"{row.worst_rank} ({row.worst_compute_s * 1e3:.0f} ms)", f"{max(0.0, now - row.at):.0f}s ago")
    if len(shown) < len(hosts):
        out.add_row(f"+{len(hosts) - len(shown)} more", "", "", "", "", "", "", "", "")
    return out
