"""The goodput ledger (report/goodput.py): a run's wall time cut into causes along one timeline,
from the events a run logs. The parts add up to the wall time, whatever the order and overlap of
the times the launcher and the hosts said; a real crash's ledger is checked in test_recovery.py."""

from __future__ import annotations

import io
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddplaunch.record.events import (RecoveryStarted, RecoveryUpdated, RunEnded, RunStarted, StageEnded,
                                     StageStarted)
from ddplaunch.record.incidents import Recovery
from ddplaunch.record.results import Progress, RunState, StageResult
from ddplaunch.record.view import RunView
from ddplaunch.report.goodput import CAUSES, ledger
from ddplaunch.report.summary import summarize

T0 = 1_000_000.0


def launch(started: float, progress: Progress | None, ended: float) -> list:
    result = StageResult(stage="job", outcomes=[], started_at=started, ended_at=ended, progress=progress)
    return [StageStarted("job", "m", 1, ["a", "b"], t=started), StageEnded(result, t=ended)]


def run_of(*events, end: float) -> RunView:
    return RunView.of([RunStarted("r", "ssh", ["a", "b"], 1, "here", t=T0), *events,
                       RunEnded(RunState.OK, 0, t=end)])


def test_a_healthy_run_is_startup_training_and_its_end():
    view = run_of(*launch(T0 + 2, Progress(T0 + 10, 1, T0 + 90, 81, optimizer_steps=81), T0 + 92), end=T0 + 100)
    spent = ledger(view)
    assert spent is not None and spent.parts == {"startup": 10, "training": 80, "checkpoint": 0, "redone": 0, "slow": 0,
                                                 "detection": 0, "recovery": 0, "other": 10}
    assert spent.goodput == 0.8 and spent.faults == 0
    assert "goodput 80% of 1m40s wall: training 1m20s; lost to startup 10s, other 10s" in summarize(view)


def test_a_crash_is_detection_recovery_and_the_steps_trained_again():
    """Steps 1-40 at 1 s a step, checkpoint at 30, host lost: named 3 s after the last step,
    the relaunch's first step (resumed from 30) 12 s after that; steps 31-40 are trained again."""
    lost = Progress(T0 + 10, 1, T0 + 49, 40, optimizer_steps=40)
    recovery = Recovery(1, ["b"], {"b": "no heartbeat"}, lost_at=T0 + 50, detected_at=T0 + 52)
    relaunched = Progress(T0 + 64, 31, T0 + 133, 100, resumed_from=30, optimizer_steps=70)
    recovery.resumed(relaunched)
    view = run_of(*launch(T0 + 2, lost, T0 + 53), RecoveryStarted(recovery, ["a", "c"], t=T0 + 53),
                  *launch(T0 + 54, relaunched, T0 + 134), RecoveryUpdated(recovery, t=T0 + 64), end=T0 + 135)
    spent = ledger(view)
    assert spent is not None and spent.faults == 1
    assert spent.parts == pytest.approx({"startup": 10, "training": 39 + 69 - 10, "checkpoint": 0, "redone": 10, "slow": 0,
                                         "detection": 3, "recovery": 12, "other": 2})
    assert math.isclose(sum(spent.parts.values()), spent.wall_s) and spent.wall_s == 135
    assert spent.line() == ("goodput 73% of 2m15s wall: training 1m38s; lost to startup 10s, redone 10s, detection 3s, "
                            "recovery 12s (1 fault), other 2s")


def _crash_resumed(relaunched: Progress) -> RunView:
    """Steps 1-40 at 1 s a step, a host lost, the relaunch's progress `relaunched` (the fold's)."""
    lost = Progress(T0 + 10, 1, T0 + 49, 40, optimizer_steps=40)
    recovery = Recovery(1, ["b"], {"b": "no heartbeat"}, lost_at=T0 + 50, detected_at=T0 + 52)
    recovery.resumed(relaunched)
    return run_of(*launch(T0 + 2, lost, T0 + 53), RecoveryStarted(recovery, ["a", "c"], t=T0 + 53),
                  *launch(T0 + 54, relaunched, T0 + 134), RecoveryUpdated(recovery, t=T0 + 64), end=T0 + 135)


def test_redone_is_said_to_be_a_lower_bound_where_the_resumed_step_is_unknown():
    """A job that loaded its checkpoint with torch.load and said no step: its redone steps are
    unknown, and the line says so instead of a plain 0 s; from scratch, every step is redone."""
    unknown = ledger(_crash_resumed(Progress(T0 + 64, 1, T0 + 133, 70, optimizer_steps=70, loaded=["/ck/last.pt"])))
    assert unknown is not None and unknown.unknown_resumes == 1 and unknown.parts["redone"] == 0
    assert "redone 0s + ? (1 resume's step unknown)" in unknown.line()
    assert unknown.to_dict()["unknown_resumes"] == 1
    scratch = ledger(_crash_resumed(Progress(T0 + 64, 1, T0 + 133, 70, optimizer_steps=70)))
    assert scratch is not None and scratch.unknown_resumes == 0 and scratch.parts["redone"] == pytest.approx(39)  # all it trained
    exact = ledger(_crash_resumed(Progress(T0 + 64, 37, T0 + 133, 106, resumed_from=36, optimizer_steps=70)))
    assert exact is not None and exact.unknown_resumes == 0 and exact.parts["redone"] == pytest.approx(4)
    assert "?" not in exact.line()


def test_the_time_inside_checkpoint_saves_is_the_checkpoints_not_trainings():
    """Rank 0 spent 12 s inside its saves between its first and last step (the entry's hooks)."""
    saved = Progress(T0 + 10, 1, T0 + 90, 81, optimizer_steps=81, saving_s=12.0)
    spent = ledger(run_of(*launch(T0 + 2, saved, T0 + 92), end=T0 + 100))
    assert spent is not None and spent.parts["checkpoint"] == 12 and spent.parts["training"] == 80 - 12
    assert math.isclose(sum(spent.parts.values()), spent.wall_s)
    assert spent.line() == "goodput 68% of 1m40s wall: training 1m08s; lost to startup 10s, checkpoint 12s, other 10s"


def test_a_run_that_never_stepped_spent_its_wall_time_starting():
    view = run_of(*launch(T0 + 2, None, T0 + 30), end=T0 + 31)
    spent = ledger(view)
    assert spent is not None and spent.parts["startup"] == 31 and spent.goodput == 0
    assert "goodput" not in summarize(view)  # no training to speak of: the stage lines say what happened


def test_no_ledger_before_the_end():
    view = RunView.of([RunStarted("r", "ssh", ["a"], 1, "here", t=T0)])
    assert ledger(view) is None


times = st.floats(min_value=T0 - 50, max_value=T0 + 500, allow_nan=False)


@given(st.lists(st.tuples(times, times), min_size=1, max_size=4), times, times, st.integers(0, 50))
def test_the_parts_add_up_to_the_wall_time_whatever_the_clocks_say(spans, detected, end, resumed):
    """Hosts' clocks and the launcher's disagree; steps are reported late: the parts still add up
    and none is negative."""
    events: list = []
    progresses = []
    for first, last in spans:
        progress = Progress(first, 1, last, 20, optimizer_steps=20)
        progresses.append(progress)
        events += launch(first - 1, progress, last + 1)
    if len(progresses) > 1:
        recovery = Recovery(1, ["b"], {}, lost_at=detected - 1, detected_at=detected)
        progresses[1].resumed_from = resumed
        recovery.resumed(progresses[1])
        events.insert(2, RecoveryStarted(recovery, ["a"]))
    spent = ledger(run_of(*events, end=end))
    assert spent is not None and set(spent.parts) == set(CAUSES)
    assert all(s >= 0 for s in spent.parts.values())
    assert math.isclose(sum(spent.parts.values()), spent.wall_s, abs_tol=1e-6)
    assert spent.wall_s == max(0.0, end - T0)


def test_status_of_an_ended_run_says_its_ledger_and_runs_add_up_to_their_total():
    from ddplaunch.report.goodput import total
    from ddplaunch.report.status import status_lines

    healthy = run_of(*launch(T0 + 2, Progress(T0 + 10, 1, T0 + 90, 81, optimizer_steps=81), T0 + 92), end=T0 + 100)
    assert "  goodput 80% of 1m40s wall: training 1m20s; lost to startup 10s, other 10s" in \
        status_lines(healthy, "ssh", None)
    never = run_of(*launch(T0 + 2, None, T0 + 30), end=T0 + 31)
    both = total([ledger(healthy), ledger(never)])
    assert (both.wall_s, both.parts["startup"], both.parts["training"]) == (131, 41, 80)
    assert math.isclose(sum(both.parts.values()), both.wall_s)


def test_runs_goodput_lists_each_ended_run_and_their_total(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ddplaunch.cli import cli
    from ddplaunch.plan.stages import UpOptions
    from ddplaunch.run.begin import run_here
    from ddplaunch.spec.load import load_spec
    from tests.fakes import FakeScript, fake_registered, fake_spec

    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    for run_id in ("g1", "g2"):
        with fake_registered(FakeScript()):
            run_here(load_spec(fake_spec(tmp_path)), "fake.yaml", UpOptions(run_id=run_id), stream=io.StringIO())
    out = CliRunner().invoke(cli, ["runs", "--goodput", "--since", "1d"])
    assert out.exit_code == 0, out.output
    rows = [line.split()[0] for line in out.output.splitlines()[1:]]
    assert rows == ["g2", "g1", "total"], out.output
    assert "startup" in out.output.splitlines()[0] and "faults" in out.output.splitlines()[0]
    assert CliRunner().invoke(cli, ["runs", "--goodput", "--since", "0s"]).output.splitlines()[1:] == []
    bad = CliRunner().invoke(cli, ["runs", "--since", "soon"])
    assert bad.exit_code == 2 and "'soon': give an age like 7d, 12h, 30m or 90 (seconds)" in bad.output


def test_the_run_page_draws_the_ledger_as_one_bar_whose_parts_are_the_causes():
    from html.parser import HTMLParser

    from ddplaunch.report.page import W, PAD, render

    view = run_of(*launch(T0 + 2, Progress(T0 + 10, 1, T0 + 90, 81, optimizer_steps=81), T0 + 92), end=T0 + 100)
    rects: list[dict] = []

    class Rects(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "rect" and dict(attrs).get("class") == "cause":
                rects.append(dict(attrs))
    Rects().feed(render(view))
    assert [r["data-cause"] for r in rects] == ["startup", "training", "other"]  # the causes it had, in order
    widths = [float(r["width"]) for r in rects]
    assert math.isclose(sum(widths), W - PAD - 10, rel_tol=1e-3) and math.isclose(widths[1] / sum(widths), 0.8,
                                                                                  rel_tol=1e-2)
    assert "goodput 80% of 1m40s wall" in render(view)
    running = RunView.of([RunStarted("r", "ssh", ["a", "b"], 1, "here", t=T0), *launch(T0 + 2, None, T0 + 30)])
    assert "no ledger yet: the run has not ended" in render(running)


def test_a_straggler_costs_its_excess_compute_on_every_step_it_held_the_run():
    """Steps 1-81 at 1 s a step; a host named at step 41's time computing 0.25 s a step more than
    its peers since step 31: steps 31-81 (51) each cost 0.25 s -> 12.75 s of slow steps, taken
    from training; the parts still add up to the wall time. A straggler named in no launch of
    this run's costs nothing."""
    from ddplaunch.record.events import StragglerNamed
    from ddplaunch.record.incidents import Straggler

    def slow(named_at: float) -> StragglerNamed:
        return StragglerNamed(Straggler("b", [1], 0.5, 31, named_at, 0.75, 0.5, 0.25), t=named_at)
    progress = Progress(T0 + 10, 1, T0 + 90, 81, optimizer_steps=81)
    spent = ledger(run_of(*launch(T0 + 2, progress, T0 + 92), slow(T0 + 50), end=T0 + 100))
    assert spent is not None and spent.parts["slow"] == pytest.approx(12.75)
    assert spent.parts["training"] == pytest.approx(80 - 12.75)
    assert math.isclose(sum(spent.parts.values()), spent.wall_s)
    assert "slow 13s" in spent.line()
    elsewhere = ledger(run_of(*launch(T0 + 2, progress, T0 + 92), slow(T0 + 95), end=T0 + 100))
    assert elsewhere is not None and elsewhere.parts["slow"] == 0 and "slow" not in elsewhere.line()


def test_the_summary_gives_the_save_stall_and_the_interval_that_maximises_goodput():
    """3 saves of 0.5 s each over 108 s of training, 1 host failure in 135 s: Young/Daly's interval
    is sqrt(2 x 0.5 x 135) = 12 s, the job saved every 36 s: said with its inputs."""
    lost = Progress(T0 + 10, 1, T0 + 49, 40, optimizer_steps=40, saving_s=1.0, saves=2)
    recovery = Recovery(1, ["b"], {"b": "no heartbeat"}, lost_at=T0 + 50, detected_at=T0 + 52)
    relaunched = Progress(T0 + 64, 31, T0 + 133, 100, resumed_from=30, optimizer_steps=70, saving_s=0.5, saves=1)
    recovery.resumed(relaunched)
    view = run_of(*launch(T0 + 2, lost, T0 + 53), RecoveryStarted(recovery, ["a", "c"], t=T0 + 53),
                  *launch(T0 + 54, relaunched, T0 + 134), RecoveryUpdated(recovery, t=T0 + 64), end=T0 + 135)
    text = summarize(view)
    assert "checkpoint saves: 3, each stalled training 0.50s" in text, text
    assert ("saving every 12s instead of every 36s would maximise goodput (Young/Daly: sqrt(2 x 0.50s stall x 2m15s "
            "between failures, this run's 1 in 2m15s))") in text, text
    healthy = run_of(*launch(T0 + 2, Progress(T0 + 10, 1, T0 + 90, 81, optimizer_steps=81, saving_s=0.4, saves=2),
                            T0 + 92), end=T0 + 100)
    said = summarize(healthy)
    assert "checkpoint saves: 2, each stalled training 0.20s" in said and "Young/Daly" not in said  # no failure: no MTBF
    assert "checkpoint saves" not in summarize(run_of(*launch(T0 + 2, Progress(T0 + 10, 1, T0 + 90, 81), T0 + 92),
                                                      end=T0 + 100))


def test_no_advice_where_the_optimum_is_a_stall_of_milliseconds_and_two_hosts_lost_at_once_are_two():
    """The memory tier's stall is milliseconds: 'save every 0s' is no advice. A recovery that lost
    two hosts together is two host failures in the summary's words."""
    lost = Progress(T0 + 10, 1, T0 + 49, 40, optimizer_steps=40, saving_s=0.004, saves=2)
    recovery = Recovery(1, ["b", "c"], {"b": "no heartbeat", "c": "no heartbeat"}, lost_at=T0 + 50,
                        detected_at=T0 + 52)
    relaunched = Progress(T0 + 64, 31, T0 + 133, 100, resumed_from=30, optimizer_steps=70, saving_s=0.002, saves=1)
    recovery.resumed(relaunched)
    text = summarize(run_of(*launch(T0 + 2, lost, T0 + 53), RecoveryStarted(recovery, ["a", "d"], t=T0 + 53),
                            *launch(T0 + 54, relaunched, T0 + 134), RecoveryUpdated(recovery, t=T0 + 64),
                            end=T0 + 135))
    assert "checkpoint saves: 3, each stalled training 0.00s" in text and "Young/Daly" not in text, text
    assert "recovered from 2 host failures:" in text, text
