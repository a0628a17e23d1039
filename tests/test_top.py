"""`ddplaunch top`'s table (report/top.py) from the fold of a run's events: a row per rank under its host with
its step, step time, wait share and straggler score; a host named a straggler says so; the
recoveries count; a relaunch starts the ranks' rows again. The real run is in test_supervisor.py."""

from __future__ import annotations

import io

from rich.console import Console

from ddplaunch.plan.launch import Stage
from ddplaunch.record.events import HostState, RankSteps, RunEnded, RunStarted, StageStarted
from ddplaunch.record.results import NodeState, RunState
from ddplaunch.record.view import RunView
from ddplaunch.report.top import table
from tests.events_util import recovery_started, straggler_named


def _text(view: RunView, now: float = 1000.0) -> str:
    out = io.StringIO()
    Console(file=out, width=140, highlight=False).print(table(view, now))
    return out.getvalue()


def _view() -> RunView:
    view = RunView()
    for event in [RunStarted("r1", "ssh", ["h1", "h2"], 1, "me"), HostState("h1", Stage.JOB, NodeState.RUNNING),
                  HostState("h2", Stage.JOB, NodeState.RUNNING), StageStarted(Stage.JOB, "h1", 1, ["h1", "h2"]),
                  RankSteps("h1", 0, 40, 0.200, 0.150, t=998.0), RankSteps("h1", 1, 40, 0.200, 0.140, t=998.0),
                  RankSteps("h2", 2, 39, 0.200, 0.010, t=990.0), RankSteps("h2", 3, 40, 0.200, 0.145, t=999.0),
                  straggler_named("h2", [2], 2.6, 20, 0.19, 0.05, 0.15)]:
        view.add(event)
    return view


def test_every_rank_is_a_row_under_its_host_with_its_score():
    text = _text(_view())
    assert "h2" in text and "STRAGGLER +260%" in text
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.count("│") == 9]
    (cells,) = [c for c in rows if c[2] == "2"]
    # compute shares 50, 60, 190, 55 ms: the median rank computes 57.5 ms, rank 2 230 % longer
    assert cells[2:] == ["2", "39", "200 ms", "5%", "+230%", "10s ago"], cells
    assert [c[0] for c in rows] == ["h1", "", "h2", ""], rows
    assert "run r1: job" in text


def test_a_recovery_is_counted_and_the_relaunch_starts_the_rows_again():
    view = _view()
    view.add(recovery_started(1, ["h2"], {"h2": "h3"}, ["h1", "h3"]))
    view.add(StageStarted(Stage.JOB, "h1", 2, ["h1", "h3"]))
    text = _text(view)
    assert "1 recovery" in text and "h3" in text
    assert " ms " not in text  # no rank reported since the relaunch
    view.add(RunEnded(RunState.OK, 0))
    assert "run r1: ok, 1 recovery" in _text(view)
