"""The Slurm job a run uses (backends/slurm/client.py `SlurmJob`), read back the way `status`,
`logs` and `down` read it: a detached run's is its record's placement (never a second file), an
attached run's allocation is the one its backend saved."""

from __future__ import annotations

from ddplaunch.backends.slurm.client import SlurmJob
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


def test_an_attached_runs_allocation_is_the_one_its_backend_saved(tmp_path, monkeypatch):
    record = _record(tmp_path, monkeypatch, Local.this_process())
    assert SlurmJob.load(record.dir) is None
    saved = SlurmJob("7", owned=False, slurm_conf=None)
    saved.save(record.dir)
    assert SlurmJob.load(record.dir) == saved
    assert oct((record.dir / "slurm.json").stat().st_mode & 0o777) == "0o600"
