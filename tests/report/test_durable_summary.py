"""`up` returns only once the job's last checkpoint is durable, and says so: rank 0's `Durable`
payload at its exit (hostside/ckpt/injob.py) kept on the launch's progress and said by the summary
(`checkpoint step 60 durable (1.2s after the job ended)`, or why it is not)."""

from __future__ import annotations

import io

import pytest

from ddplaunch.plan.stages import UpOptions
from ddplaunch.run.begin import run_here
from ddplaunch.spec.load import load_spec
from tests.fakes import FakeScript, NodeScript, StageScript, fake_registered, fake_spec


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))


def _run(tmp_path, *rank0: str) -> str:
    job = StageScript(nodes={"f1": NodeScript(lines=('[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 60}', *rank0))})
    with fake_registered(FakeScript(stages=[job])):
        out = io.StringIO()
        report = run_here(load_spec(fake_spec(tmp_path)), "fake.yaml", UpOptions(), stream=out)
    assert report.exit_code == 0, out.getvalue()
    return out.getvalue()


def test_the_summary_says_the_last_checkpoint_is_durable(tmp_path):
    out = _run(tmp_path, '[f1:0] DDPLAUNCH_DURABLE_JSON {"rank": 0, "step": 60, "after_s": 1.234}')
    assert "checkpoint step 60 durable (1.2s after the job ended)" in out, out


def test_a_save_that_could_not_be_made_durable_is_said(tmp_path):
    out = _run(tmp_path, '[f1:0] DDPLAUNCH_DURABLE_JSON {"rank": 0, "step": 60, "after_s": 0.5, '
                         '"failed": "step 60 could not be written to /shared/ck: disk full"}')
    assert "checkpoint step 60 NOT durable: step 60 could not be written to /shared/ck: disk full" in out, out


def test_a_job_that_saved_nothing_through_the_tier_says_nothing_of_it(tmp_path):
    assert "durable" not in _run(tmp_path)
