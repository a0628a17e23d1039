"""The run's event log (ddplaunch/record/events.py) on the scripted fake backend: typed events in order,
the screen's lines and the summary as they were shown; a reader that follows a log as it grows
(torn lines included); `ddplaunch.submit` and its `Run` handle through a real forked supervisor."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

import ddplaunch
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import (EVENTS_FILE, EventLog, HostState, PreflightChecked, RecoveryStarted,
                                     RecoveryUpdated, Requested, RunEnded, RunStarted, Shown, StageEnded, StageStarted,
                                     follow, from_line, read_events, to_line)
from ddplaunch.record.results import NodeState, RunState
from ddplaunch.record.runs import run_dir
from ddplaunch.record.view import RunView
from ddplaunch.report.summary import summarize, summary_json
from ddplaunch.run.begin import run_here
from ddplaunch.spec.load import load_spec
from tests.fakes import FakeScript, NodeScript, StageScript, fake_registered, fake_spec


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))


def _kinds(events) -> list[type]:
    """The run's milestones: not its lines, host states, requests or updates of a recovery."""
    return [type(e) for e in events if not isinstance(e, (Shown, HostState, Requested, RecoveryUpdated))]


def test_a_recovered_run_logs_every_stage_the_recovery_and_its_end(tmp_path):
    crashed = StageScript(nodes={"f1": NodeScript(hangs=True), "f2": NodeScript(silent=True, after=0.05),
                                 "f3": NodeScript(hangs=True)})
    with fake_registered(FakeScript(stages=[crashed])):
        spec = load_spec(fake_spec(tmp_path, recovery={"max_host_failures": 1, "spares": ["f4"],
                                                       "detect_timeout": 0.2}))
        out = io.StringIO()
        report = run_here(spec, "fake.yaml", UpOptions(run_id="ev-1"), stream=out)
    assert report.exit_code == 0, out.getvalue()
    events = read_events(run_dir("ev-1"))
    assert _kinds(events) == [RunStarted, PreflightChecked, StageStarted, StageEnded, RecoveryStarted, StageStarted,
                              StageEnded, RunEnded]
    start, first_end, recovery, end = events[0], events[_index(events, StageEnded)], \
        events[_index(events, RecoveryStarted)], events[-1]
    assert isinstance(start, RunStarted) and start.supervisor_pid == os.getpid() and start.hosts == ["f1", "f2", "f3"]
    assert isinstance(first_end, StageEnded) and first_end.result.host_failure
    assert {o.host: o.state for o in first_end.result.outcomes}["f2"] is NodeState.LOST
    assert isinstance(recovery, RecoveryStarted) and recovery.recovery.replaced == {"f2": "f4"}
    assert recovery.hosts == ["f1", "f4", "f3"]
    assert isinstance(end, RunEnded) and (end.state, end.exit_code) == ("ok", 0)
    # the screen is the log's Shown lines followed by the summary of its fold: a reader sees what it saw
    shown = [e.text for e in events if isinstance(e, Shown)]
    assert out.getvalue() == "\n".join(shown + [summarize(RunView.of(events))]) + "\n"
    assert '"exit_code": 0' in summary_json(RunView.of(events)).replace("\n", " ")
    assert all(a.mono <= b.mono for a, b in zip(events, events[1:]))


def _index(events, cls) -> int:
    return next(i for i, e in enumerate(events) if isinstance(e, cls))


def test_every_kind_of_event_reads_back_as_it_was_written():
    """The log's lines read back as the same typed values (JSON keeps dict keys as strings: a
    straggler's per-rank slowdowns are keyed by int rank)."""
    from tests.events_util import recovery_started, stage_ended, straggler_named

    named = straggler_named("h2", [2, 3], 0.4, 35, 0.5, 0.35, 0.1, t=5.0)
    named.straggler.ranks_slow = {2: 0.4, 3: 0.38}
    for event in (named, recovery_started(1, ["b"], {"b": "d"}, ["a", "d"], t=6.0),
                  stage_ended({"a": NodeState.OK, "b": NodeState.LOST}, {"a": 0}, t=7.0),
                  RunEnded(RunState.CANCELLED, 130, error="the job was cancelled", by_scheduler=True, t=8.0)):
        assert from_line(to_line(event)) == event, type(event).__name__


def test_a_line_that_is_not_an_event_is_skipped_not_fatal():
    assert from_line("not json") is None and from_line('{"kind": "from-the-future"}') is None
    assert from_line('{"kind": "shown"}') is None  # a field missing
    event = Shown("x")
    assert from_line(to_line(event)) == event


def test_follow_reads_a_growing_log_torn_lines_included(tmp_path):
    log = EventLog(tmp_path)
    log.append(Shown("first"))
    done = threading.Event()

    def writer() -> None:
        with open(tmp_path / EVENTS_FILE, "a") as f:
            line = to_line(Shown("second"))
            f.write(line[:10])
            f.flush()
            time.sleep(0.3)  # the reader meets the torn line in between
            f.write(line[10:] + "\n")
        log.append(RunEnded(RunState.OK, 0))
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    got = list(follow(tmp_path, alive=lambda: True))  # RunEnded ends it
    assert [getattr(e, "text", None) for e in got] == ["first", "second", None]
    assert isinstance(got[-1], RunEnded)


def test_follow_ends_when_the_writer_is_gone(tmp_path):
    EventLog(tmp_path).append(Shown("only"))
    assert [e.text for e in follow(tmp_path, alive=lambda: False)] == ["only"]  # type: ignore[union-attr]


def test_submit_hands_the_run_to_a_forked_supervisor_and_run_waits_for_it(tmp_path):
    """The fake backend registered in this process is there in the supervisor (a fork)."""
    slow = StageScript(nodes={h: NodeScript(after=0.5) for h in ("f1", "f2", "f3")})
    with fake_registered(FakeScript(stages=[slow])):
        run = ddplaunch.submit(fake_spec(tmp_path), run_id="sub-1")
        assert run.run_id == "sub-1"
        started = run.events()[0]
        assert isinstance(started, RunStarted) and started.supervisor_pid != os.getpid()
        assert run.wait(timeout=60) == 0
        with pytest.raises(ddplaunch.PlanError, match="a run with this id exists"):
            ddplaunch.submit(fake_spec(tmp_path), run_id="sub-1")
    assert run.state == "ok"
    assert isinstance(run.events()[-1], RunEnded)


def test_stop_ends_a_submitted_run_as_ctrl_c_does(tmp_path):
    hangs = StageScript(nodes={h: NodeScript(hangs=True) for h in ("f1", "f2", "f3")})
    with fake_registered(FakeScript(stages=[hangs])):
        run = ddplaunch.submit(fake_spec(tmp_path), run_id="sub-2")
        with pytest.raises(TimeoutError):
            run.wait(timeout=1)
        assert run.stop(grace=5) is True
        assert run.wait(timeout=5) == 130
    assert run.state == "interrupted"
