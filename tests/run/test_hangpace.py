"""The hang watch at the job's pace (run/hangwatch.py): a job silent for `Pace.STEPS` of its own
steps (4 s at least) is suspect and a link test runs; a host it finds cut off is named then, not after
job.hang_timeout; a suspicion that finds nothing ends nothing and the next waits twice as long.
The rule alone, then the run loop through the scripted fake backend; on the SSH sim in
tests/run/test_recovery.py (a cut training link, and a healthy run that pauses between steps)."""

from __future__ import annotations

import io
import re

import pytest

from ddplaunch.plan.stages import UpOptions
from ddplaunch.run.hangwatch import Pace
from ddplaunch.run.begin import run_here
from ddplaunch.spec.load import load_spec
from tests.fakes import FakeScript, NodeScript, StageScript, fake_registered, fake_spec


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))


def test_a_silence_is_suspect_after_ten_of_the_jobs_steps_at_least_the_floor():
    pace = Pace()
    assert not pace.suspect(None, 1e6, last_line_at=1.0)  # no pace known yet: never
    assert not pace.suspect(2.0, 19.9, last_line_at=1.0) and pace.suspect(2.0, 20.0, last_line_at=1.0)
    assert not pace.suspect(0.1, 3.9, last_line_at=1.0) and pace.suspect(0.1, Pace.FLOOR_S, last_line_at=1.0)


def test_a_suspicion_that_found_nothing_doubles_the_wait_until_the_job_speaks_again():
    pace = Pace()
    assert pace.suspect(1.0, 10.0, last_line_at=5.0)
    pace.cleared()  # e.g. an evaluation: every link fine
    assert not pace.suspect(1.0, 19.0, last_line_at=5.0) and pace.suspect(1.0, 20.0, last_line_at=5.0)
    pace.cleared()
    assert not pace.suspect(1.0, 39.0, last_line_at=5.0)
    # it spoke (a later last line): a new silence, judged at the job's pace again
    assert pace.suspect(1.0, 10.0, last_line_at=50.0)


def _run(tmp_path, script: FakeScript, **sections):
    with fake_registered(script):
        spec = load_spec(fake_spec(tmp_path, **sections))
        out = io.StringIO()
        report = run_here(spec, "fake.yaml", UpOptions(run_id="fake-pace"), stream=out)
        return report, out.getvalue()


def test_a_host_cut_off_is_named_at_the_jobs_pace_and_replaced(tmp_path):
    """Rank 0 steps every 0.1 s, then every rank waits (a host's training link dropped): after 4 s
    (the floor) the link test runs, finds f2 cut off, and the spare takes its place — the hang
    timeout (60 s) is not waited for."""
    stepping = StageScript(nodes={"f1": NodeScript(hangs=True, step_every=0.1, steps_until=1.0),
                                  "f2": NodeScript(hangs=True), "f3": NodeScript(hangs=True)})
    script = FakeScript(stages=[stepping], cut={"f2"})
    report, out = _run(tmp_path, script, recovery={"max_host_failures": 1, "spares": ["f4"]})
    assert report.exit_code == 0, out
    (recovery,) = report.recoveries
    assert recovery.lost == ["f2"] and recovery.replaced == {"f2": "f4"}
    assert recovery.causes["f2"].startswith("its training link is broken: no TCP connection to or from f1, f3")
    assert "a link test found f2 cut off: job.hang_timeout=60 not waited for" in out, out
    assert "hang: no output for" in out and "(at the job's pace; job.hang_timeout=60)" in out
    assert script.link_tests == 1


def test_a_silence_with_every_link_fine_ends_nothing(tmp_path):
    """Rank 0 steps, then the job is silent while every link is fine (a long evaluation): the
    suspicion's link test finds nobody, nothing is stopped, and the job, done, ends ok."""
    pausing = StageScript(nodes={"f1": NodeScript(code=0, after=7.0, step_every=0.1, steps_until=1.0),
                                 "f2": NodeScript(code=0, after=7.0), "f3": NodeScript(code=0, after=7.0)})
    script = FakeScript(stages=[pausing])
    report, out = _run(tmp_path, script, recovery={"max_host_failures": 1, "spares": ["f4"]})
    assert report.exit_code == 0 and report.recoveries == [] and len(script.launched) == 1, out
    assert "hang" not in out
    # suspected after 4 s of silence, found nothing: the next suspicion would wait for 8 s of it
    # (the job ended at 6 s of silence); said in the run's log, not on the screen
    assert script.link_tests == 1
    logged = (tmp_path / "state" / "runs" / "fake-pace" / "output.log").read_text()
    assert re.search(r"^\[ddplaunch\] the job silent \d+s \(\d+ of its steps\): a link test found no host cut off; "
                     r"the next suspicion after 8s$", logged, re.M), logged[-2000:]
    assert "link test" not in out
