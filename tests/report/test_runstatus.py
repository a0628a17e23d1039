"""`status` from the event log alone (report/status.py): pure, from the fold of typed events."""

from __future__ import annotations

from ddplaunch.record.events import RunEnded, RunStarted, StageStarted, StepWindow, from_line, to_line
from ddplaunch.record.live import HostNow, LiveSteps
from ddplaunch.record.results import NodeState, RunState
from ddplaunch.record.view import RunView
from ddplaunch.report.status import status_lines
from tests.events_util import recovery_started, stage_ended, straggler_named

STARTED = RunStarted("r1", "ssh", ["a", "b", "c"], 4242, "laptop", t=100.0)


def _job(hosts: list[str], t: float) -> StageStarted:
    return StageStarted("job", hosts[0], 29500, hosts, t=t)


def test_a_running_run_says_its_stage_and_newest_step():
    """The newest step is the hosts' live status (record/live.py: their agents' lines), of this launch."""
    events = [STARTED, _job(["a", "b", "c"], 101.0)]
    live = LiveSteps(stage_started=101.5, hosts={"a": HostNow(12, 0.3, 0.1, 1, 0, 0.2, 110.0),
                                                 "b": HostNow(14, 0.3, 0.1, 1, 1, 0.2, 111.0),
                                                 "c": HostNow(13, 0.3, 0.1, 1, 2, 0.2, 112.0)})
    lines = status_lines(RunView.of(events), "ssh", supervisor_alive=True, now=115.0, live=live)
    assert lines[:2] == ["r1: running (ssh; hosts a, b, c; supervisor pid 4242 on laptop)",
                         "  now: stage job, step 14 (newest of any rank, reported 4s ago)"]
    assert lines[2:] == ["  stage job: (running)", "    a (node 0): starting", "    b (node 1): starting",
                         "    c (node 2): starting"]


def test_a_recovery_a_straggler_and_the_stages_as_they_ended():
    ended = stage_ended({"a": NodeState.OK, "b": NodeState.LOST, "c": NodeState.INTERRUPTED},
                        {"a": 0, "b": None, "c": 143})
    events = [STARTED, _job(["a", "b", "c"], 101.0), StepWindow(21, 40, {"a": [0.2, 0.1, 0.3]}, t=110.0), ended,
              recovery_started(1, ["b"], {"b": "d"}, ["a", "d", "c"]), _job(["a", "d", "c"], 120.0),
              straggler_named("c", [2], 0.4, 35, 0.5, 0.35, 0.1),
              stage_ended({h: NodeState.OK for h in "adc"}, {h: 0 for h in "adc"}),
              RunEnded(RunState.OK, 0)]
    # the log read back from its lines, as `status` reads it
    lines = status_lines(RunView.of(from_line(to_line(e)) for e in events), "ssh",  # type: ignore[misc]
                         supervisor_alive=False)
    assert lines == ["r1: ok (ssh; hosts a, b, c; supervisor pid 4242 on laptop)",
                     "  recovery 1: lost b; replaced b -> d",
                     "  straggler: c (ranks 2) computes +40% against its peers since step 35",
                     "  stage job:", "    a (node 0): ok exit 0", "    b (node 1): lost", "    c (node 2): interrupted exit 143",
                     "  stage job:", "    a (node 0): ok exit 0", "    d (node 1): ok exit 0", "    c (node 2): ok exit 0"]


def test_a_relaunch_counts_steps_again_and_a_dead_supervisor_is_said():
    events = [STARTED, _job(["a", "b", "c"], 101.0), StepWindow(21, 40, {"a": [0.2, 0.1, 0.3]}, t=110.0),
              stage_ended({h: NodeState.LOST for h in "abc"}), _job(["a", "b", "c"], 120.0)]
    lines = status_lines(RunView.of(events), "ssh", supervisor_alive=False, now=130.0)
    assert lines[:2] == ["r1: supervisor died without ending the run (pid 4242 gone) (ssh; hosts a, b, c; "
                         "supervisor pid 4242 on laptop)", "  now: stage job"]
    # a lost node has no exit code
    assert "    a (node 0): lost" in lines


def test_without_a_live_status_the_newest_window_judged_says_how_far_the_job_is():
    """A live status of an earlier launch (its relaunch has not reported yet) is not taken."""
    events = [STARTED, _job(["a", "b", "c"], 101.0), StepWindow(21, 40, {"a": [0.2, 0.1, 0.3]}, t=110.0)]
    old = LiveSteps(stage_started=50.0, hosts={"a": HostNow(99, 0.3, 0.1, 1, 0, 0.2, 60.0)})
    lines = status_lines(RunView.of(events), "ssh", supervisor_alive=True, now=115.0, live=old)
    assert lines[1] == "  now: stage job, step 40 (newest of any rank, reported 5s ago)"


def test_a_job_ended_by_its_scheduler_takes_the_schedulers_state():
    events = [STARTED, _job(["a", "b", "c"], 101.0), RunEnded(RunState.CANCELLED, 130, by_scheduler=True)]
    lines = status_lines(RunView.of(events), "ssh", supervisor_alive=None)
    assert lines[:2] == ["r1: cancelled (ssh; hosts a, b, c; supervisor pid 4242 on laptop)",
                         "  its job ended without its supervisor logging the end (the scheduler's word)"]


def test_a_run_whose_supervisor_has_not_started_is_submitted_and_says_where_it_went():
    view = RunView(run_id="r2", hosts=["a", "b"])
    assert status_lines(view, "slurm", supervisor_alive=True, where="submitted Slurm job 7") == \
        ["r2: submitted (slurm; hosts a, b; submitted Slurm job 7)"]


def test_a_running_run_says_its_frozen_and_silent_ranks_and_stops_saying_them_once_they_run():
    from ddplaunch.record.events import RanksFrozen, RanksSilent

    events = [STARTED, _job(["a", "b", "c"], 101.0), RanksFrozen("b", {"3": "T", "4": "D"}), RanksSilent("c", [7])]
    lines = status_lines(RunView.of(events), "ssh", supervisor_alive=True, now=115.0)
    assert "  frozen now (process state): b ranks 3 T, 4 D" in lines
    assert "  ranks silent while the others step: c ranks 7" in lines
    lines = status_lines(RunView.of([*events, RanksFrozen("b", {})]), "ssh", supervisor_alive=True, now=115.0)
    assert not any(line.startswith("  frozen now") for line in lines)
    # at 1,000 hosts: a line, not a page (`top` shows them all)
    many = [STARTED, _job(["a"], 101.0), *[RanksFrozen(f"h{i}", {str(r): "T" for r in range(8 * i, 8 * i + 8)})
                                           for i in range(1000)]]
    (line,) = [x for x in status_lines(RunView.of(many), "ssh", supervisor_alive=True, now=115.0)
               if x.startswith("  frozen now")]
    assert line.endswith("; h4 ranks 32 T, 33 T, 34 T, 35 T, 36 T, 37 T, 38 T, 39 T; +995 more hosts"), line
