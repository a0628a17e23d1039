"""The Python API (ddplaunch.up/check/load_spec) without running anything: specs as paths and
as data, dry runs that return what `up --dry-run` prints, bad input as documented exceptions.
A real run through the API is in test_habits.py (from a plain Python process)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

import ddplaunch
from ddplaunch.errors import PlanError, SpecError
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import Event, EventLog, RunEnded, RunStarted
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import Local, RunRecord, load_run
from ddplaunch.report.status import shown_state
from ddplaunch.run.begin import dry_run
from ddplaunch.supervise.commands import supervisor_alive, view_of

ROOT = Path(__file__).resolve().parents[1]


def test_load_spec_takes_a_path_or_the_data_of_one():
    from_file = ddplaunch.load_spec(ROOT / "cluster.yaml")
    data = {"backend": "local", "nproc_per_node": 1, "job": {"script": "jobs/toy_ddp.py"}}
    from_data = ddplaunch.load_spec(data, base_dir=ROOT)
    assert from_file.backend == from_data.backend == "local" and from_data.nproc_per_node == 1
    assert ddplaunch.load_spec(from_data) is from_data


def test_bad_spec_data_is_a_spec_error_naming_the_key():
    with pytest.raises(SpecError, match=r"<spec data>:\d+: nproc_per_node: must be a positive integer"):
        ddplaunch.load_spec({"backend": "local", "nproc_per_node": 0}, base_dir=ROOT)


def test_dry_run_reports_exactly_what_the_cli_prints():
    out = io.StringIO()
    report = ddplaunch.up(str(ROOT / "cluster.yaml"), dry_run=True, run_id="api-1", stream=out)
    assert report.run_id == "api-1" and report.exit_code == 0 and report.stages == []
    cli_text = dry_run(ddplaunch.load_spec(ROOT / "cluster.yaml"), UpOptions(run_id="api-1"))
    assert report.plan_text == cli_text and "torch.distributed.run" in report.plan_text


def test_unknown_option_is_a_plan_error():
    with pytest.raises(PlanError, match="unknown option skip_health; the options are"):
        ddplaunch.check(ROOT / "cluster.yaml", dry_run=True, skip_health=True)


def _recorded(run_id: str, placement: Local, *events: Event) -> None:
    """A run recorded on this machine (its supervisor `placement`) whose log holds `events`."""
    record = RunRecord.planned(run_id, "cluster.yaml", ddplaunch.load_spec(ROOT / "cluster.yaml"), placement)
    record.save()
    log = EventLog(record.dir)
    for event in events:
        log.append(event)
    log.close()


def test_a_runs_state_is_a_value_the_status_line_renders(tmp_path, monkeypatch):
    """`Run.state` is a RunState, never the words `ddplaunch status` prints; a supervisor that died
    without ending its run is UNKNOWN, the words say why."""
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path))
    here = Local.this_process()
    gone = Local(here.pid, -1, here.host)  # this pid, another start: not the supervisor any more
    started = RunStarted("r-ok", "local", ["localhost"], here.pid, here.host)
    _recorded("r-ok", here, started, RunEnded(RunState.OK, 0))
    _recorded("r-running", here, dataclasses.replace(started, run_id="r-running"))
    _recorded("r-dead", gone, dataclasses.replace(started, run_id="r-dead"))
    _recorded("r-handed", here)
    states = {run_id: ddplaunch.Run(run_id).state for run_id in ("r-ok", "r-running", "r-dead", "r-handed")}
    assert states == {"r-ok": RunState.OK, "r-running": RunState.RUNNING, "r-dead": RunState.UNKNOWN,
                      "r-handed": RunState.SUBMITTED}
    assert all(type(state) is RunState for state in states.values())
    dead = load_run("r-dead")
    assert shown_state(view_of(dead), supervisor_alive(dead)) == \
        f"supervisor died without ending the run (pid {here.pid} gone)"
