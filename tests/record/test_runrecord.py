"""A run's record (record/runs.py): its identity written once, read back as it was written — the
spec typed, its secrets redacted on disk — and readable where the spec's backend is not known
(a backend registered from Python in the process that ran it)."""

from __future__ import annotations

import json

import pytest

from ddplaunch.record.runs import InJob, RunRecord, list_runs, load_run
from ddplaunch.spec.load import load_spec

from tests.ssh_util import ROOT

SPEC = "name: t\nworkdir: {root}\nenv: {{TOKEN: {{value: s3cret-tok, secret: true}}}}\njob: {{script: jobs/toy_ddp.py}}\n"


def test_a_record_reads_back_as_written_with_its_secrets_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    (tmp_path / "c.yaml").write_text(SPEC.format(root=ROOT))
    spec = load_spec(tmp_path / "c.yaml")
    record = RunRecord.planned("r1", "c.yaml", spec, InJob("41", "job 41"))
    record.save()
    assert "s3cret-tok" not in (record.dir / "record.json").read_text()
    again = load_run("r1")
    assert again == record and again.backend == "local" and again.hosts == ["localhost"]
    assert again.spec.validated.base_dir == str(tmp_path) and again.spec.validated.env["TOKEN"].value == "<secret>"


def test_a_record_of_a_backend_unknown_here_still_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    run = tmp_path / "state" / "runs" / "plug-1"
    run.mkdir(parents=True)
    (run / "record.json").write_text(json.dumps({
        "run_id": "plug-1", "spec_path": "x", "hosts": ["p1"], "spec": {"backend": "plugin"}, "base_dir": "/", "started_at": 1.0,
        "placement": {"kind": "in-job", "job_id": "1", "where": "job 1"}}))
    (record,) = list_runs()
    assert record.backend == "plugin" and load_run("plug-1") == record
    with pytest.raises(ValueError, match="unknown backend 'plugin'"):
        record.spec.validated  # noqa: B018 - only a reader that needs the backend asks
