"""What the next `up` of a spec does with the checkpoints an earlier run, killed outright, left in
the hosts' RAM (run/ckptclean.py): which runs it takes for dead (from their records alone: never a
live run's, never another spec's, back to the newest run its supervisor ended), and that it frees
them through the backend's reaper after persisting their newest sealed versions, says one line, and
that the dry run shows it. On this machine (the local backend): no namespaces, no hosts."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from ddplaunch.backends import make_backend
from ddplaunch.backends.contract import RunContext, StopEvent
from ddplaunch.hostside.ckpt import injob as ckpt, layout
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import EventLog, RunEnded, RunStarted
from ddplaunch.record.results import RunState
from ddplaunch.record.runs import Local, RunRecord, list_runs, process_start_time, run_dir
from ddplaunch.run.begin import dry_run
from ddplaunch.run.ckptclean import StaleRun, free_stale, stale_runs
from ddplaunch.spec.load import load_spec

RAM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def _spec_file(tmp_path: Path, name: str, checkpoint: bool = True) -> Path:
    data = {"name": name, "backend": "local", "workdir": str(ROOT), "job": {"script": "jobs/train.py"}}
    if checkpoint:
        data["checkpoint"] = {"path": str(tmp_path / name / "ckpt"), "tier": "memory"}
    path = tmp_path / name / "cluster.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def _dead() -> Local:
    """A supervisor that has exited (its pid no longer runs with that start time)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(proc.pid)
    proc.wait()
    return Local(proc.pid, start or 1, Local.this_process().host)


def _recorded(spec_path: Path, run_id: str, at: float, placement: Local, ended: bool = False,
              by_scheduler: bool = False) -> RunRecord:
    spec = load_spec(spec_path)
    record = dataclasses.replace(RunRecord.planned(run_id, str(spec_path), spec, placement), started_at=at)
    record.save()
    log = EventLog(record.dir)
    log.append(RunStarted(run_id, "local", ["localhost"], placement.pid, placement.host, "job"))
    if ended:
        log.append(RunEnded(RunState.FAILED if by_scheduler else RunState.OK, 0, by_scheduler=by_scheduler))
    log.close()
    return record


def test_the_dead_runs_of_the_same_spec_back_to_the_last_one_its_supervisor_ended(home, tmp_path):
    spec_a, spec_b = _spec_file(tmp_path, "a"), _spec_file(tmp_path, "b")
    plain = _spec_file(tmp_path, "plain", checkpoint=False)
    _recorded(spec_a, "a-old-killed", 1.0, _dead())  # older than a run that ended: that run freed it
    _recorded(spec_a, "a-ended", 2.0, _dead(), ended=True)
    _recorded(spec_a, "a-killed", 3.0, _dead())
    _recorded(spec_a, "a-live", 4.0, Local.this_process())  # a live run's RAM: never
    _recorded(spec_a, "a-elsewhere", 5.0, Local(1, 1, "another-machine"))  # cannot be seen from here
    _recorded(spec_a, "a-job-ended", 6.0, _dead(), ended=True, by_scheduler=True)  # its scheduler ended it
    _recorded(spec_b, "b-killed", 7.0, _dead())  # another spec's
    _recorded(plain, "plain-killed", 8.0, _dead())  # no checkpoint section: nothing in RAM
    _recorded(spec_a, "a-now", 9.0, Local.this_process())  # the run asking
    spec = load_spec(spec_a)
    got = stale_runs(spec, str(spec_a), "a-now")
    assert [s.run_id for s in got] == ["a-job-ended", "a-killed"]
    assert got[0].durable == str(tmp_path / "a" / "ckpt")
    # the same file named by a relative path (from its directory) is the same spec
    rel = dataclasses.replace(RunRecord.planned("a-rel", "cluster.yaml", spec, _dead()), started_at=10.0)
    rel.save()
    assert [s.run_id for s in stale_runs(spec, str(spec_a), "a-now")] == ["a-rel", "a-job-ended", "a-killed"]
    assert stale_runs(spec, "<python>", "a-now") == []  # a spec object: no file to match runs by
    assert len(list_runs()) == 10


def _saved(run_id: str, host: str, durable: Path, step: int) -> Path:
    """A sealed RAM version of `run_id` on `host`, saved through the tier itself, not persisted."""
    ckpt.configure(durable, run_id=run_id, host=host, ram_root=RAM)
    try:
        ckpt.save({"w": torch.arange(4.0)}, step)
        ckpt.wait(timeout=60)
    finally:
        ckpt.free(run_id, host="none-such", ram_root=RAM)  # closes this process's tier, keeps the RAM
    shutil.rmtree(durable / layout.step_name(step))  # as if the run was killed before it persisted it
    return layout.ram_part_dir(RAM, run_id, host, 0)


def test_the_next_up_frees_a_killed_runs_ram_through_its_backend_after_persisting_it(home, tmp_path):
    spec_path = _spec_file(tmp_path, "a")
    spec = load_spec(spec_path)
    stale_id, live_id = f"a-killed-{uuid.uuid4().hex[:6]}", f"a-live-{uuid.uuid4().hex[:6]}"
    durable = tmp_path / "a" / "ckpt"
    try:
        _saved(stale_id, "localhost", durable, 7)
        _saved(live_id, "localhost", tmp_path / "live", 4)
        _recorded(spec_path, stale_id, 1.0, _dead())
        _recorded(spec_path, live_id, 2.0, Local.this_process())
        dry = dry_run(spec, UpOptions(run_id="a-next"), str(spec_path))
        assert "free from RAM the checkpoints of earlier runs of this spec whose supervisors died" in dry, dry
        assert f"#   {stale_id} (durable dir {durable})" in dry and live_id not in dry
        stale = stale_runs(spec, str(spec_path), "a-next")
        assert stale == [StaleRun(stale_id, str(durable))]
        backend = make_backend(spec, RunContext("a-next", run_dir("a-next"), StopEvent()))
        lines = free_stale(spec, backend, stale)
        assert lines == [f"freed from RAM the checkpoints of earlier runs of this spec whose supervisors died "
                         f"({stale_id}), their newest sealed versions persisted to the durable dir first"], lines
        assert not (layout.ram_base(RAM) / stale_id).exists()
        assert layout.durable_steps(durable) == [7] and layout.durable_parts_complete(durable, 7)
        assert layout.ram_steps(layout.ram_part_dir(RAM, live_id, "localhost", 0)) == [4]  # a live run's: kept
        assert free_stale(spec, backend, stale) == []  # nothing left: nothing said
    finally:
        for run in (stale_id, live_id):
            shutil.rmtree(layout.ram_base(RAM) / run, ignore_errors=True)
