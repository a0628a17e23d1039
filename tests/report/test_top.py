"""`ddplaunch top`'s table (report/top.py) from the fold of a run's events and the hosts' live
status: a row per host with its ranks, newest step, step time, wait share, straggler score and
slowest rank; a host named a straggler says so; the recoveries count; a relaunch starts the
hosts' rows again; at 2,000 hosts the rows are the ones to look at first. The real run is in
test_supervisor.py."""

from __future__ import annotations

import io

from rich.console import Console

from ddplaunch.plan.launch import Stage
from ddplaunch.record.events import HostState, RunEnded, RunStarted, StageStarted
from ddplaunch.record.live import HostNow, LiveSteps
from ddplaunch.record.results import NodeState, RunState
from ddplaunch.record.view import RunView
from ddplaunch.report.top import MAX_ROWS, table
from tests.events_util import recovery_started, straggler_named

LIVE = LiveSteps(stage_started=1.0, hosts={"h1": HostNow(40, 0.200, 0.150, 2, 1, 0.060, 998.0),
                                           "h2": HostNow(39, 0.200, 0.010, 2, 2, 0.190, 990.0),
                                           "h3": HostNow(40, 0.200, 0.145, 2, 4, 0.055, 999.0)})


def _text(view: RunView, live: LiveSteps | None = LIVE, now: float = 1000.0) -> str:
    out = io.StringIO()
    Console(file=out, width=160, highlight=False).print(table(view, live, now))
    return out.getvalue()


def _view() -> RunView:
    view = RunView()
    for event in [RunStarted("r1", "ssh", ["h1", "h2", "h3"], 1, "me"),
                  *[HostState(h, Stage.JOB, NodeState.RUNNING) for h in ("h1", "h2", "h3")],
                  StageStarted(Stage.JOB, "h1", 1, ["h1", "h2", "h3"]),
                  straggler_named("h2", [2, 3], 2.6, 20, 0.19, 0.05, 0.15)]:
        view.add(event)
    return view


def test_every_host_is_a_row_with_its_score_and_slowest_rank():
    text = _text(_view())
    assert "STRAGGLER +260%" in text
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.count("│") == 10]
    (cells,) = [c for c in rows if c[0] == "h2"]
    # compute shares 50, 190, 55 ms: the median host computes 55 ms, h2 245 % longer
    assert cells[2:] == ["2", "39", "200 ms", "5%", "+245%", "2 (190 ms)", "10s ago"], cells
    assert [c[0] for c in rows] == ["h1", "h2", "h3"], rows
    assert "run r1: job" in text


def test_a_recovery_is_counted_and_the_relaunch_starts_the_rows_again():
    view = _view()
    view.add(recovery_started(1, ["h2"], {"h2": "h4"}, ["h1", "h4", "h3"]))
    view.add(StageStarted(Stage.JOB, "h1", 2, ["h1", "h4", "h3"]))
    text = _text(view, live=None)
    assert "1 recovery" in text and "h4" in text
    assert " ms " not in text  # no host reported since the relaunch
    view.add(RunEnded(RunState.OK, 0))
    assert "run r1: ok, 1 recovery" in _text(view, live=None)


def test_at_two_thousand_hosts_the_rows_are_the_ones_to_look_at_first():
    """A failed host and the slowest come first, MAX_ROWS rows and a line for the rest."""
    hosts = [f"n{i:04d}" for i in range(2048)]
    view = RunView()
    view.add(RunStarted("big", "ssh", hosts, 1, "me"))
    view.add(StageStarted(Stage.JOB, hosts[0], 1, hosts))
    view.add(HostState("n0777", Stage.JOB, NodeState.FAILED, 1))
    live = LiveSteps(stage_started=1.0, hosts={h: HostNow(500, 1.0, 0.5 if h != "n1234" else 0.1, 8, 0, 0.5, 999.0)
                                               for h in hosts})
    text = _text(view, live)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.count("│") == 10]
    assert [c[0] for c in rows[:2]] == ["n0777", "n1234"] and len(rows) == MAX_ROWS + 1, [c[0] for c in rows[:3]]
    assert rows[-1][0] == f"+{2048 - MAX_ROWS} more" and "2048 hosts" in text


def test_an_ended_run_shows_its_goodput_ledger_under_the_table():
    from ddplaunch.record.events import StageEnded
    from ddplaunch.record.results import Progress, StageResult

    view = RunView()
    result = StageResult(Stage.JOB, [], started_at=102.0, ended_at=192.0,
                         progress=Progress(110.0, 1, 190.0, 81, optimizer_steps=81))
    for event in [RunStarted("r1", "ssh", ["h1"], 1, "me", t=100.0), StageStarted(Stage.JOB, "h1", 1, ["h1"], t=102.0)]:
        view.add(event)
    assert "goodput" not in _text(view, live=None)  # running: no ledger yet
    view.add(StageEnded(result, t=192.0))
    view.add(RunEnded(RunState.OK, 0, t=200.0))
    assert "goodput 80% of 1m40s wall: training 1m20s; lost to startup 10s, other 10s" in _text(view, live=None)


def test_top_refreshes_the_table_until_the_run_ends_and_once_prints_it_once(tmp_path):
    """The loop (supervise/follow.py) around the pure table: the run's log read in its own
    thread; the table printed at each refresh and once more at the end."""
    from ddplaunch.record.events import EventLog
    from ddplaunch.supervise.follow import top

    log = EventLog(tmp_path)
    for event in [RunStarted("r1", "ssh", ["h1", "h2"], 1, "me"), StageStarted(Stage.JOB, "h1", 1, ["h1", "h2"]),
                  HostState("h1", Stage.JOB, NodeState.OK, 0), RunEnded(RunState.OK, 0)]:
        log.append(event)
    log.close()
    for once in (True, False):
        out = io.StringIO()
        assert top(tmp_path, lambda: True, out, once=once) == 0
        text = out.getvalue()
        assert text.count("run r1: ok") >= 1 and "h2" in text, text
        if once:
            assert text.count("run r1:") == 1
