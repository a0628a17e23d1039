"""Where a recovered run resumed from: rank 0's `Loaded` payload of a ddplaunch.checkpoint load (its
step, whose RAM held it, who saved it) kept as typed data from the relaunch's lines to its `Recovery`,
and said by the summary (`resumed after 9s at step 8 from f3's memory (f2 lost)`); a torch.load
job's recovery says what it said before, and an old log without the new fields still reads."""

from __future__ import annotations

import io

import pytest

from ddplaunch.hostside.payloads import Loaded
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.codec import from_data, to_data
from ddplaunch.record.incidents import Recovery
from ddplaunch.report.status import status_lines
from ddplaunch.run.begin import run_here
from ddplaunch.spec.load import load_spec
from tests.fakes import FakeScript, NodeScript, StageScript, fake_registered, fake_spec

RECOVER = {"max_host_failures": 1, "spares": ["f4"], "detect_timeout": 0.2}


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))  # the runs and the hosts they lost


def _recovery(checkpoint: Loaded | None, **more) -> Recovery:
    return Recovery(1, ["f2"], {"f2": "no heartbeat for 2s"}, lost_at=100.0, detected_at=102.0,
                    replaced={"f2": "f4"}, hosts_after=3, resumed_after_s=9.2, resumed_from=8, steps_before=10,
                    loaded=[checkpoint.path if checkpoint else "/ck/step_8.pt"], checkpoint=checkpoint, **more)


def _loaded(source: str, host: str = "", origin: str = "") -> Loaded:
    return Loaded(0, "/dev/shm/x/v-8", "ddplaunch.checkpoint", step=8, source=source, host=host, origin=origin)


def test_a_step_read_from_a_buddys_memory_names_it_and_the_lost_saver():
    text = _recovery(_loaded("memory", "f3", "f2")).describe()
    assert text == ("f2 lost (no heartbeat for 2s) → replaced by f4, resumed after 9s at step 8 from f3's memory "
                    "(f2 lost); at least 10 optimizer steps done before"), text


def test_a_step_read_from_the_durable_dir_or_an_own_save_says_so():
    assert "resumed after 9s at step 8 from the durable dir;" in _recovery(_loaded("durable")).describe()
    assert "resumed after 9s at step 8 from f3's memory;" in _recovery(_loaded("memory", "f3", "f3")).describe()
    alive = _recovery(_loaded("memory", "f3", "f1")).describe()
    assert "at step 8 from f3's memory (a copy of f1's save);" in alive, alive


def test_a_torch_load_jobs_recovery_says_what_it_said_before():
    text = _recovery(None).describe()
    assert text.endswith(", resumed after 9s from step 8; at least 10 optimizer steps done before; the relaunched "
                         "job loaded /ck/step_8.pt"), text


def test_a_job_s_own_load_that_named_its_step_is_said_by_its_path_as_before():
    """torch.load's dict named its step (the ledger's `redone` is exact from it): the line is the
    one a torch.load job always had, not a tier's `from <host>'s memory`."""
    own = Loaded(0, "/ck/step_8.pt", "torch.load", step=8)
    text = _recovery(own).describe()
    assert own.step == 8 and _recovery(own).loaded_from() == ""
    assert text.endswith(", resumed after 9s from step 8; at least 10 optimizer steps done before; the relaunched "
                         "job loaded /ck/step_8.pt"), text


def test_the_load_survives_the_log_and_an_old_log_still_reads():
    recovery = _recovery(_loaded("memory", "f3", "f2"))
    data = to_data(recovery)
    assert from_data(Recovery, data) == recovery
    del data["checkpoint"]  # a log written before the field existed
    old = from_data(Recovery, data)
    assert old.checkpoint is None and old.loaded_from() == "" and "from step 8" in old.describe()


def test_the_relaunchs_loaded_payload_reaches_the_recovery_and_the_summary(tmp_path):
    """f2 crashes; rank 0 of the relaunch (on the spare f4) says it loaded step 8 from f3's RAM, a
    copy of f2's save: the fold's recovery holds that payload, the summary and `status` say it."""
    crash = StageScript(nodes={"f1": NodeScript(hangs=True), "f2": NodeScript(silent=True, after=0.3),
                               "f3": NodeScript(hangs=True)})
    relaunch = StageScript(nodes={"f1": NodeScript(lines=(
        '[f1:0] DDPLAUNCH_LOADED_JSON {"rank": 0, "path": "/dev/shm/r/f3/replicas/f2/part-0/v-8", '
        '"via": "ddplaunch.checkpoint", "step": 8, "source": "memory", "host": "f3", "origin": "f2"}',
        '[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 5}'))})
    with fake_registered(FakeScript(stages=[crash, relaunch])):
        out = io.StringIO()
        report = run_here(load_spec(fake_spec(tmp_path, recovery=RECOVER)), "fake.yaml", UpOptions(), stream=out)
    assert report.exit_code == 0, out.getvalue()
    (only,) = report.recoveries
    assert only.checkpoint == Loaded(0, "/dev/shm/r/f3/replicas/f2/part-0/v-8", "ddplaunch.checkpoint", step=8,
                                     source="memory", host="f3", origin="f2")
    assert only.resumed_from == 8  # said by the load: the job printed no `resumed from` line
    assert "→ replaced by f4, resumed after" in out.getvalue()
    assert "s at step 8 from f3's memory (f2 lost)" in out.getvalue(), out.getvalue()
    assert "the relaunched job loaded" not in out.getvalue()
    assert any("s at step 8 from f3's memory (f2 lost)" in line for line in status_lines(report, "fake", None))
