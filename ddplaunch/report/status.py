"""`ddplaunch status` and the state `runs` lists, rendered from the one fold of the run's events
(record/view.py): the run's state, where its supervisor runs, the stage it is in and the newest
step any rank reported, every recovery and straggler, and each stage's nodes as they ended (or,
for the stage that runs, as they are now).

Pure: a view in, lines out. What the log cannot say — that its writer died without ending it —
is the caller's `supervisor_alive` (None: not known from here, e.g. the job of a scheduler).
"""

from __future__ import annotations

import time
from typing import Optional

from ddplaunch.output.console import hosts_named, state_text
from ddplaunch.record.live import LiveSteps
from ddplaunch.record.view import Launch, RunView
from ddplaunch.report.goodput import worth_saying


def died_unended(view: RunView, supervisor_alive: Optional[bool]) -> bool:
    """Whether the run's supervisor died without ending it (its log has no end, and it is gone)."""
    return view.ended is None and view.started is not None and supervisor_alive is False


def shown_state(view: RunView, supervisor_alive: Optional[bool]) -> str:
    """The run's state in words: its log's, or that its supervisor died without ending it."""
    if died_unended(view, supervisor_alive) and view.started is not None:
        return f"supervisor died without ending the run (pid {view.started.supervisor_pid} gone)"
    return str(view.state)


#: Hosts (and ranks of each) a line of `status` names at most: 1,000 hosts' worth is for `top`.
SHOWN_HOSTS, SHOWN_RANKS = 5, 8


def _by_host(what: str, ranks: dict[str, list[str]]) -> list[str]:
    """`  frozen now (process state): dlt2 ranks 1 T, 3 T; dlt4 ranks 0 D; +3 more hosts`."""
    if not ranks:
        return []
    parts = [f"{host} ranks {', '.join(rs[:SHOWN_RANKS])}"
             + (f" +{len(rs) - SHOWN_RANKS}" if len(rs) > SHOWN_RANKS else "")
             for host, rs in list(ranks.items())[:SHOWN_HOSTS]]
    more = f"; +{len(ranks) - SHOWN_HOSTS} more hosts" if len(ranks) > SHOWN_HOSTS else ""
    return [f"  {what}: {'; '.join(parts)}{more}"]


def status_lines(view: RunView, backend: str, supervisor_alive: Optional[bool], where: str = "",
                 now: Optional[float] = None, live: Optional[LiveSteps] = None) -> list[str]:
    """What `status` prints: the first line starts with the run id and its state; `where` says
    where its supervisor runs when its log does not (yet) say so; `live`: the hosts' newest steps
    (record/live.py), else the newest window judged says how far the job is."""
    now = time.time() if now is None else now
    s = view.started
    running = f"supervisor pid {s.supervisor_pid} on {s.supervisor_host}" if s is not None else where
    hosts = s.hosts if s is not None else view.hosts  # the hosts it started with; recoveries below
    lines = [f"{view.run_id}: {shown_state(view, supervisor_alive)} ({backend}; hosts {hosts_named(hosts)}"
             + (f"; {running})" if running else ")")]
    if view.ended is not None and view.ended.by_scheduler:
        lines.append("  its job ended without its supervisor logging the end (the scheduler's word)")
    elif view.ended is None and view.running is not None:
        now_line = f"  now: stage {view.running.stage}"
        newest = newest_step(view, live)
        if newest is not None:
            now_line += f", step {newest[0]} (newest of any rank, reported {max(0.0, now - newest[1]):.0f}s ago)"
        lines.append(now_line)
    for r in view.recoveries:
        replaced = ", ".join(f"{lost} -> {spare}" for lost, spare in r.replaced.items())
        lines.append((f"  restart (relaunch {r.number}): {r.failure}" if r.failure else
                      f"  grown back (relaunch {r.number}): {', '.join(r.grown)} back; {r.hosts_after} hosts"
                      if r.grown else f"  recovery {r.number}: lost {', '.join(r.lost)}"
                      + (f"; replaced {replaced}" if replaced else f"; went on with {r.hosts_after} hosts"))
                     + (f"; resumed after {r.resumed_after_s:.0f}s {r.loaded_from()}".rstrip()
                        if r.resumed_after_s is not None else ""))
    for st in view.stragglers:
        lines.append(f"  straggler: {st.host} (ranks {', '.join(map(str, st.ranks))}) computes "
                     f"{st.slowdown:+.0%} against its peers since step {st.since_step}")
    if view.ended is None:  # what the node agents and the judge say now
        lines += _by_host("frozen now (process state)", {h: [f"{r} {st}" for r, st in ranks.items()]
                                                         for h, ranks in view.frozen.items()})
        lines += _by_host("ranks silent while the others step", {h: [str(r) for r in rs]
                                                                  for h, rs in view.silent.items()})
    for launch in view.launches:
        lines += _stage_lines(launch, view)
    spent = worth_saying(view)
    if spent is not None:
        lines.append(f"  {spent.line()}")
    return lines


def newest_step(view: RunView, live: Optional[LiveSteps]) -> Optional[tuple[int, float]]:
    """(the newest step of the job that runs, when it was reported): the hosts' live status when it
    is of this launch, else the newest window judged."""
    if live is not None and view.running is not None and live.newest is not None \
            and live.stage_started >= view.running.t:
        return live.newest
    return (view.last_window.last, view.last_window.t) if view.last_window is not None else None


def _stage_lines(launch: Launch, view: RunView) -> list[str]:
    started, result = launch.started, launch.result
    lines = [f"  stage {started.stage}:" + ("" if result is not None else " (running)")]
    for node, host in enumerate(started.hosts):
        if result is None:
            event = view.host_states.get(host)
            lines.append(f"    {host} (node {node}): {'starting' if event is None else state_text(event)}")
            continue
        outcome = next((o for o in result.outcomes if o.host == host), None)
        code = outcome.exit_code if outcome is not None else None
        lines.append(f"    {host} (node {node}): {outcome.state if outcome is not None else '?'}"
                     + ("" if code is None else f" exit {code}"))
    return lines
