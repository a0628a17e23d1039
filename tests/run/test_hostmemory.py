"""Bad hosts remembered across runs: the host-health file (record/hosthealth.py) read, written by
concurrent processes, expired and cleared; what a run records from its events; what the next
`up` does with a recorded host (run/hostmemory.py): a spare in its place, left out where
`recovery.min_hosts` allows, refused otherwise, excluded from a Slurm allocation by count."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import yaml

from ddplaunch.errors import PlanError
from ddplaunch.record.diagnosis import Gate, Localization
from ddplaunch.record.events import HostsExcluded, Localized, RecoveryStarted, StageEnded
from ddplaunch.record.hosthealth import clear, recorded, remember
from ddplaunch.record.incidents import Recovery
from ddplaunch.record.results import NodeOutcome, NodeState, StageResult
from ddplaunch.run.hostmemory import HostMemory, skip_recorded
from ddplaunch.spec.load import load_spec

DAY = 86400.0


def _spec(tmp_path: Path, backend: str = "ssh", hosts: object = ("h1", "h2", "h3"), **recovery: object):
    data = {"name": "mem", "backend": backend, "job": {"script": "jobs/train.py"},
            "recovery": {"host_health_file": str(tmp_path / "health.json"), **recovery}}
    if hosts is not None:
        data["hosts"] = list(hosts)  # type: ignore[call-overload]
    if backend == "slurm":
        data["slurm"] = {"nodes": 3}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def test_remembered_hosts_read_back_expire_and_clear(tmp_path):
    file = tmp_path / "health.json"
    remember(file, {"h2": "lost (its ranks are frozen)", "localhost": "lost"}, "r1", "ssh", now=1000.0)
    remember(file, {"h3": "failed the health check"}, "r2", "ssh", now=5000.0)
    got = recorded(file, ttl=DAY, now=6000.0)
    assert sorted(got) == ["h2", "h3"]  # the launcher's own machine is never recorded
    assert (got["h2"].cause, got["h2"].run_id, got["h2"].at) == ("lost (its ranks are frozen)", "r1", 1000.0)
    assert sorted(recorded(file, ttl=4500.0, now=6000.0)) == ["h3"]  # h2's entry expired
    assert clear(file, ["h2", "h9"]) == ["h2"]
    assert sorted(recorded(file, ttl=DAY, now=6000.0)) == ["h3"]
    file.write_text("{torn")
    assert recorded(file, ttl=DAY) == {}  # a torn file never stops a run


def _writer(args: tuple[str, int]) -> None:
    path, i = args
    for j in range(20):
        remember(Path(path), {f"w{i}-{j}": "lost"}, f"run{i}", "ssh")


def test_concurrent_writers_lose_no_entry(tmp_path):
    file = tmp_path / "shared" / "health.json"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(str(file), i) for i in range(4)])
    assert sorted(recorded(file, ttl=DAY)) == sorted(f"w{i}-{j}" for i in range(4) for j in range(20))


def test_a_run_records_the_hosts_its_events_name_bad(tmp_path):
    spec = _spec(tmp_path)
    memory = HostMemory(spec, "r1")
    memory.note(RecoveryStarted(Recovery(1, ["h1"], {"h1": "no heartbeat for 3s"}, 1.0, 2.0), ["h4", "h2", "h3"]))
    memory.note(Localized(Localization(bad_hosts=["h2"], reasons={"h2": "slow"})))
    memory.note(HostsExcluded(["h9"], Gate.HOST_HEALTH))  # left out because recorded: not recorded again
    lost = StageResult(stage="job", outcomes=[NodeOutcome(0, "h3", NodeState.LOST, detail="no heartbeat for 4s"),
                                              NodeOutcome(1, "h5", NodeState.FAILED, exit_code=1),
                                              NodeOutcome(2, "h6", NodeState.FAILED, exit_code=1,
                                                          oom_killed=["rank 2 (pid 77)"])])
    memory.note(StageEnded(lost))
    got = recorded(tmp_path / "health.json", ttl=DAY)
    assert {h: e.cause for h, e in got.items()} == {"h1": "no heartbeat for 3s", "h2": "failed the health check: slow",
                                                    "h3": "no heartbeat for 4s",
                                                    "h6": "its kernel's OOM killer ended rank 2 (pid 77)"}


def test_a_recorded_host_gets_a_spare_in_its_place_and_a_recorded_spare_is_dropped(tmp_path):
    remember(tmp_path / "health.json", {"h2": "lost (frozen)", "s1": "lost"}, "r0", "ssh")
    spec = _spec(tmp_path, spares=["s1", "s2"], max_host_failures=1)
    skipped = skip_recorded(spec)
    assert [h.label for h in skipped.spec.hosts] == ["h1", "s2", "h3"]  # the spare at its node rank
    assert skipped.spec.recovery.spares == []
    assert skipped.hosts() == ["h2"] and skipped.replaced_by == {"h2": "s2"}
    assert skipped.lines()[0].startswith("skipped h2: lost (frozen) (run r0, ")
    assert skipped.lines()[0].endswith(": s2 in its place")
    assert skip_recorded(spec, check=True).spec is spec  # a check runs on it: passing readmits it


def test_a_recorded_host_is_left_out_where_min_hosts_allows_and_refused_otherwise(tmp_path):
    remember(tmp_path / "health.json", {"h2": "lost (frozen)"}, "r0", "ssh")
    shrunk = skip_recorded(_spec(tmp_path, min_hosts=2))
    assert [h.label for h in shrunk.spec.hosts] == ["h1", "h3"] and "left out" in shrunk.lines()[0]
    with pytest.raises(PlanError) as refused:
        skip_recorded(_spec(tmp_path))
    text = str(refused.value)
    assert "h2: lost (frozen) (run r0, " in text and "ddplaunch hosts clear HOST" in text and "health.json" in text
    with pytest.raises(PlanError, match="master.addr h2 is recorded as bad"):
        skip_recorded(_spec(tmp_path, spares=["s1"]).model_copy(
            update={"master": _spec(tmp_path).master.model_copy(update={"addr": "h2"})}))
    assert skip_recorded(_spec(tmp_path, remember_bad_hosts=0)).hosts() == []  # remembering off


def test_slurm_picking_the_nodes_excludes_the_recorded_slurm_nodes(tmp_path):
    file = tmp_path / "health.json"
    remember(file, {"n7": "lost"}, "r0", "slurm")
    remember(file, {"gpu1": "lost"}, "r1", "ssh")  # another cluster's host: not a Slurm node name
    skipped = skip_recorded(_spec(tmp_path, backend="slurm", hosts=None))
    assert skipped.spec.slurm.exclude == ["n7"] and skipped.hosts() == ["n7"]
    from ddplaunch.backends.slurm.render import sbatch_options
    assert "--exclude=n7" in sbatch_options(skipped.spec, "r2", "out", None)


def test_an_entry_older_than_remember_bad_hosts_is_not_used(tmp_path):
    remember(tmp_path / "health.json", {"h2": "lost"}, "r0", "ssh", now=time.time() - 7200)
    assert skip_recorded(_spec(tmp_path, remember_bad_hosts=3600)).hosts() == []
    assert skip_recorded(_spec(tmp_path, remember_bad_hosts=3600, min_hosts=1)).hosts() == []
    assert skip_recorded(_spec(tmp_path, min_hosts=1)).hosts() == ["h2"]
