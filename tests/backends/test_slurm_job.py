"""The Slurm job a run uses (backends/slurm/client.py `SlurmJob`), read back the way `status`,
`logs` and `down` read it, from the run's memory alone: a detached run's is its record's
placement, an attached run's allocation the one its backend said in the event log; no file of
its own."""

from __future__ import annotations

from ddplaunch.backends.slurm.client import SlurmJob
from ddplaunch.record.events import Allocated, EventLog
from ddplaunch.record.runs import InJob, Local, RunRecord
from ddplaunch.spec.load import load_spec

from tests.ssh_util import ROOT

SPEC = "name: t\nbackend: slurm\nworkdir: {root}\nslurm: {{conf: conf/slurm.conf, output_dir: out}}\n" \
       "job: {{script: jobs/toy_ddp.py}}\n"


def _record(tmp_path, monkeypatch, placement):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    (tmp_path / "c.yaml").write_text(SPEC.format(root=ROOT))
    record = RunRecord.planned("r1", str(tmp_path / "c.yaml"), load_spec(tmp_path / "c.yaml"), placement)
    record.save()
    return record


def test_a_detached_runs_job_is_its_records(tmp_path, monkeypatch):
    record = _record(tmp_path, monkeypatch, InJob("41", "submitted Slurm job 41"))
    job = SlurmJob.load(record.dir)
    assert job == SlurmJob("41", owned=True, slurm_conf=str(tmp_path / "conf" / "slurm.conf"),
                           output_path=f"{ROOT}/out/r1-41.out")
    assert not (record.dir / "slurm.json").exists()


def test_a_job_the_scheduler_refused_is_none(tmp_path, monkeypatch):
    record = _record(tmp_path, monkeypatch, InJob("", "refused by the scheduler: no"))
    assert SlurmJob.load(record.dir) is None


def test_an_attached_runs_allocation_is_the_one_its_backend_said(tmp_path, monkeypatch):
    record = _record(tmp_path, monkeypatch, Local.this_process())
    assert SlurmJob.load(record.dir) is None
    log = EventLog(record.dir)
    log.append(Allocated("7", owned=True, output_path="/out/r1-7.out"))
    log.close()
    assert SlurmJob.load(record.dir) == SlurmJob("7", owned=True, slurm_conf=str(tmp_path / "conf" / "slurm.conf"),
                                                 output_path="/out/r1-7.out")
    assert sorted(p.name for p in record.dir.iterdir()) == ["events.jsonl", "record.json"]
