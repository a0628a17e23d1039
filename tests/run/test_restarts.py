"""`job.max_restarts`: a job that failed by itself is launched again on the same hosts, every host
together (torchrun only ever runs with --max-restarts 0); the same failure right after a restart
is not retried, nor are relaunches that make no progress. The decisions (run/recovery.py) and the
run loop that acts on them, through the scripted fake backend; on the real sim clusters in
tests/run/test_resilience.py (SSH) and tests/run/test_recovery_slurm.py."""

from __future__ import annotations

import io
import json
import re
from typing import Optional

import pytest

from ddplaunch.hostside.payloads import RankFailed
from ddplaunch.plan.launch import Stage
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.results import FAILED, OK, NodeOutcome, Progress, StageResult, job_failure
from ddplaunch.run.begin import run_here
from ddplaunch.run.recovery import NO_PROGRESS, RecoveryBudget
from ddplaunch.spec.load import load_spec
from ddplaunch.spec.model import HostSpec, RecoverySpec
from tests.fakes import FakeScript, NodeScript, StageScript, fake_registered, fake_spec


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))


def _failed(host: str = "f2", rank: int = 1, raised: Optional[RankFailed] = None, code: int = 1) -> NodeOutcome:
    return NodeOutcome(node_rank=rank, host=host, state=FAILED, exit_code=1, failed_rank=rank, failed_local_rank=0,
                       rank_exit_code=code, ended_at=100.0, failure=raised)


def _result(node: NodeOutcome, progress: bool = True) -> StageResult:
    others = [NodeOutcome(node_rank=i, host=f"f{i + 1}", state=OK) for i in range(3) if i != node.node_rank]
    steps = Progress(first_at=90.0, first_step=1, last_at=99.0, last_step=10) if progress else None
    return StageResult(Stage.JOB, sorted([node, *others], key=lambda o: o.node_rank), ended_at=101.0,
                       progress=steps)


HOSTS = [HostSpec(addr=f"f{i}") for i in (1, 2, 3)]
BOOM = RankFailed(rank=1, exc_type="ValueError", message="boom\nmore", file="/w/jobs/train.py", line=52)


def test_what_failed_is_the_exception_with_its_line_or_the_signal():
    assert job_failure(_failed(raised=BOOM)) == ("rank 1 on f2 raised ValueError: boom (train.py:52)",
                                                 "ValueError at /w/jobs/train.py:52")
    assert job_failure(_failed(code=-9)) == ("rank 1 on f2 killed by SIGKILL", "signal 9")
    # an exit code alone is not enough to call two failures the same
    assert job_failure(_failed(code=3)) == ("rank 1 on f2 exit code 3", "")


def test_a_failure_is_restarted_on_the_same_hosts_until_max_restarts_is_used_up():
    budget = RecoveryBudget(RecoverySpec(), [])
    for n in (1, 2):
        hosts, why = budget.restart(HOSTS, _result(_failed(code=3 + n)), max_restarts=2)
        assert hosts == HOSTS, why
        assert budget.done[-1].number == n and budget.done[-1].lost == [] and budget.restarts == n
        assert why.startswith(f"the job failed (rank 1 on f2 exit code {3 + n}) → restarted on the same 3 hosts")
    hosts, why = budget.restart(HOSTS, _result(_failed(code=7)), max_restarts=2)
    assert hosts is None and why == "rank 1 on f2 exit code 7: job.max_restarts=2 restarts used up"


def test_the_same_exception_right_after_a_restart_is_not_retried():
    budget = RecoveryBudget(RecoverySpec(), [])
    assert budget.restart(HOSTS, _result(_failed(raised=BOOM)), max_restarts=5)[0] == HOSTS
    # another host, another rank: the same exception at the same line is the same failure
    again = _failed(host="f3", rank=2, raised=RankFailed(2, "ValueError", "boom", "/w/jobs/train.py", 52))
    hosts, why = budget.restart(HOSTS, _result(again), max_restarts=5)
    assert hosts is None
    assert why == "the same failure again: rank 2 on f3 raised ValueError: boom (train.py:52), as before restart 1: " \
                  "not retried"


def test_a_different_failure_after_a_restart_is_restarted_again():
    budget = RecoveryBudget(RecoverySpec(), [])
    assert budget.restart(HOSTS, _result(_failed(raised=BOOM)), max_restarts=5)[0] == HOSTS
    other = RankFailed(1, "ValueError", "boom", "/w/jobs/train.py", 60)
    assert budget.restart(HOSTS, _result(_failed(raised=other)), max_restarts=5)[0] == HOSTS
    assert budget.restart(HOSTS, _result(_failed(code=-9)), max_restarts=5)[0] == HOSTS
    hosts, why = budget.restart(HOSTS, _result(_failed(code=-9)), max_restarts=5)
    assert hosts is None and why.startswith("the same failure again: rank 1 on f2 killed by SIGKILL, as before restart 3")


def test_relaunches_that_fail_before_their_first_step_stop_with_no_progress():
    budget = RecoveryBudget(RecoverySpec(), [])
    assert budget.restart(HOSTS, _result(_failed(code=3)), max_restarts=9)[0] == HOSTS  # it had stepped
    for n in range(1, NO_PROGRESS):
        assert budget.restart(HOSTS, _result(_failed(code=3), progress=False), max_restarts=9)[0] == HOSTS, n
    hosts, why = budget.restart(HOSTS, _result(_failed(code=3), progress=False), max_restarts=9)
    assert hosts is None
    assert why.startswith(f"rank 1 on f2 exit code 3: no progress — the last {NO_PROGRESS} relaunches each ended "
                          "before the job's first step (rank 1 on f2 exit code 3; rank 1 on f2 exit code 3; ")


# ----------------------------------------------------------------------------- the run loop

def _run(tmp_path, script: FakeScript, max_restarts: int, run_id: str = "fake-rs"):
    with fake_registered(script):
        spec = load_spec(fake_spec(tmp_path, job={"script": "jobs/toy_ddp.py", "max_restarts": max_restarts}))
        out = io.StringIO()
        report = run_here(spec, "fake.yaml", UpOptions(run_id=run_id), stream=out)
        return report, out.getvalue()


def _raises(host: str, rank: int, line: int = 52) -> NodeScript:
    """`host`'s one rank raises ValueError at `line` of train.py, as the entry reports it."""
    payloads = [f'DDPLAUNCH_RANKSTART_JSON {{"rank": {rank}, "pid": {100 + rank}}}',
                "DDPLAUNCH_RANKFAILED_JSON " + json.dumps({"rank": rank, "exc_type": "ValueError", "message": "boom",
                                                          "file": "/w/jobs/train.py", "line": line}),
                f'DDPLAUNCH_RANKEXIT_JSON {{"rank": {rank}, "code": 1}}']
    return NodeScript(code=1, after=0.05, lines=tuple(f"[{host}:{rank}] {p}" for p in payloads))


def _failing(line: int = 52) -> StageScript:
    """f2's rank raises; f1 and f3 wait in a collective until they are stopped."""
    return StageScript(nodes={"f1": NodeScript(hangs=True), "f2": _raises("f2", 1, line), "f3": NodeScript(hangs=True)})


def test_a_failed_job_is_launched_again_on_every_host_and_ends_ok(tmp_path):
    script = FakeScript(stages=[_failing()])
    report, out = _run(tmp_path, script, max_restarts=1)
    assert report.exit_code == 0, out
    assert [p.hosts for p in script.launched] == [["f1", "f2", "f3"]] * 2
    assert all(n.torchrun is not None and n.torchrun.words()[n.torchrun.words().index("--max-restarts") + 1] == "0"
               for p in script.launched for n in p.nodes)
    (restart,) = report.recoveries
    assert restart.failure == "rank 1 on f2 raised ValueError: boom (train.py:52)" and restart.lost == []
    assert "[ddplaunch] restart 1 of at most 1 (job.max_restarts): the job failed (rank 1 on f2 raised ValueError: " \
           "boom (train.py:52)) → restarted on the same 3 hosts; relaunching on f1, f2, f3" in out, out
    assert re.search(r"stage job: rank 1 on f2 raised ValueError: boom \(train.py:52\) after [\d.]+s: "
                     r"restarted \(relaunch 1\)", out), out
    assert ": restarted (relaunch 1)" in out and "recovered from 1 job failure:" in out
    assert "    after the job failed: named 0.0s" in out


def test_the_same_failure_after_a_restart_stops_the_run_saying_what_failed(tmp_path):
    script = FakeScript(stages=[_failing(), _failing()])
    report, out = _run(tmp_path, script, max_restarts=3)
    assert report.exit_code == 1 and len(script.launched) == 2, out
    assert report.unrecovered == "the same failure again: rank 1 on f2 raised ValueError: boom (train.py:52), as " \
                                 "before restart 1: not retried"
    assert "[ddplaunch] not restarted: the same failure again" in out
    failed = out.split("stage job: FAILED on 3 of 3 node(s)")[1]
    assert "first failure: f2 (node 1): failed" in failed and "not recovered: the same failure again" in failed


def test_a_different_failure_each_launch_spends_the_budget_then_stops(tmp_path):
    script = FakeScript(stages=[_failing(52), _failing(53), _failing(54)])
    report, out = _run(tmp_path, script, max_restarts=2)
    assert report.exit_code == 1 and len(script.launched) == 3, out
    assert report.unrecovered == "rank 1 on f2 raised ValueError: boom (train.py:54): job.max_restarts=2 restarts " \
                                 "used up"
    assert [r.failure for r in report.recoveries] == ["rank 1 on f2 raised ValueError: boom (train.py:52)",
                                                      "rank 1 on f2 raised ValueError: boom (train.py:53)"]


def test_without_max_restarts_a_failed_job_ends_the_run(tmp_path):
    script = FakeScript(stages=[_failing()])
    report, out = _run(tmp_path, script, max_restarts=0)
    assert report.exit_code == 1 and len(script.launched) == 1 and report.recoveries == [], out
    assert "job.max_restarts" not in out and "restarted" not in out and "not restarted" not in out
