"""The run loop without the world: a scripted backend (tests/fakes.py) registered for the test
drives `up` through the real pre-flight gate, health gate, exclusion, reschedules, restart counts
and the fail-fast watcher, in milliseconds. The backend is added with one registration: no file
of ddplaunch names it."""

from __future__ import annotations

import io
import json
import re
import time

import pytest
from click.testing import CliRunner

from ddplaunch.cli import cli
from ddplaunch.errors import PlanError, SpecError
from ddplaunch.plan.stages import UpOptions
from ddplaunch.run.begin import run_here
from ddplaunch.spec.load import load_spec
from ddplaunch.backends.contract import Admitted
from ddplaunch.record.diagnosis import Gate
from ddplaunch.output.console import Console
from ddplaunch.record.events import EventLog, HostsExcluded, read_events
from ddplaunch.record.view import RunView
from ddplaunch.run.runsession import RunSession
from ddplaunch.record.hosthealth import health_file, recorded, remember
from tests.fakes import FakeScript, NodeScript, StageScript, fake_registered, fake_spec
from tests.ssh_util import run_view
from tests.timing import no_hang


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))


def run(tmp_path, script: FakeScript, opts: UpOptions | None = None, **sections):
    with fake_registered(script):
        spec = load_spec(fake_spec(tmp_path, **sections))
        out = io.StringIO()
        t0 = time.monotonic()
        report = run_here(spec, "fake.yaml", opts or UpOptions(), stream=out)
        return report, out.getvalue(), time.monotonic() - t0


def _session(tmp_path, spec, backend, stop) -> RunSession:
    """A run's context around `backend`, for a part of the loop tested alone."""
    return RunSession(spec, backend, UpOptions(), Console(io.StringIO()), stop, "t-1", tmp_path, EventLog(tmp_path),
                      RunView())


def bad_pair_verdict(host: str) -> dict:
    pairs = {"singles": [], "pairs": [{"hosts": ["f1", host], "ok": False, "busbw_gbps": 0.1, "detail": ""}],
             "repairs": [], "median_busbw_gbps": 1.0, "bad_hosts": [host], "reasons": {host: "slow"}}
    return {"ok": False, "world_size": 3, "failures": [{"rank": 1, "host": host, "check": "pair",
                                                        "message": f"host {host} is bad"}], "pairs": pairs}


def failed_rank(rank: int, code: int, error: str) -> tuple[str, ...]:
    """A rank's traceback, then its node's torchrun agent naming it as the root cause."""
    return (f"[f{rank + 1}:{rank}] Traceback (most recent call last):", f"[f{rank + 1}:{rank}] {error}",
            "Root Cause (first observed failure):", f"  rank      : {rank} (local_rank: 0)",
            f"  exitcode  : {code} (pid: 1)")


def test_healthy_run_is_one_launch_with_the_health_check_inline(tmp_path):
    script = FakeScript()
    report, out, took = run(tmp_path, script)
    assert report.exit_code == 0 and [p.stage for p in script.launched] == ["job"]
    assert script.launched[0].healthcheck and report.healthcheck is not None
    assert (report.healthcheck.ok, report.healthcheck.world_size, report.healthcheck.failures) == (True, 3, [])
    assert script.probes >= 1  # the pre-flight ran (remote hosts)
    assert "stage job: ok on all 3 node(s)" in out
    no_hang(took, 5, "a healthy scripted run waits out none of the run loop's timers")


def test_preflight_gate_stops_before_anything_is_launched(tmp_path):
    script = FakeScript(unreachable={"f2"})
    report, out, _ = run(tmp_path, script)
    assert report.exit_code == 1 and report.blocked == "pre-flight" and script.launched == []
    assert "f2: reach: no answer -> fix: plug it in" in out
    assert "stopped by the pre-flight gate: no job was started" in out


def test_preflight_does_not_wait_for_a_host_it_cannot_reach(tmp_path):
    """The master's port probe waits for the hosts that answered `reach`, not for a dead one
    (which would cost the whole preflight.timeout)."""
    script = FakeScript(unreachable={"f2"})
    run(tmp_path, script)
    assert set(script.commands) == {"f1", "f3"}  # f2 was never sent the probe
    assert '"expect": 2' in script.commands["f1"] and '"listen": true' in script.commands["f1"]


def test_preflight_exclude_goes_on_without_the_unreachable_host(tmp_path):
    script = FakeScript(unreachable={"f2"})
    report, out, _ = run(tmp_path, script, healthcheck={"on_fail": "exclude"})
    assert report.exit_code == 0 and [p.hosts for p in script.launched] == [["f1", "f3"]]


def test_preflight_rides_in_the_first_launchs_sessions(tmp_path):
    """A backend that can (SSH) probes in the stage's own sessions: one round per host, the same
    verdict, and the interface every host reaches the master through handed to the ranks."""
    script = FakeScript(in_session=True)
    report, out, _ = run(tmp_path, script)
    assert report.exit_code == 0 and [p.stage for p in script.launched] == ["job"]
    assert script.probes == 0 and len(script.gated) == 1  # no separate round of sessions
    assert sorted(script.gated[0]) == ["f1", "f2", "f3"] and '"listen": true' in script.gated[0]["f1"]
    assert script.admitted == [Admitted("eth0")] and "using it for Gloo/NCCL" in out
    view = run_view(tmp_path, report.run_id)
    assert view.preflight is not None and view.preflight.ok
    assert out.index("pre-flight") < out.index("stage job: master")


def test_preflight_in_the_sessions_stops_before_anything_starts(tmp_path):
    script = FakeScript(in_session=True, no_script={"f2"})
    report, out, _ = run(tmp_path, script)
    assert report.exit_code == 1 and report.blocked == "pre-flight" and script.launched == []
    assert script.admitted == [None] and "stopped by the pre-flight gate: no job was started" in out


def test_preflight_in_the_sessions_excludes_and_launches_on_the_others(tmp_path):
    script = FakeScript(in_session=True, no_script={"f2"})
    report, out, _ = run(tmp_path, script, healthcheck={"on_fail": "exclude"})
    assert report.exit_code == 0 and [p.hosts for p in script.launched] == [["f1", "f3"]]
    assert script.launched[0].nodes[0].env_dict()["GLOO_SOCKET_IFNAME"] == "eth0"  # the spec carries it on


def test_preflight_is_its_own_round_when_a_host_cannot_be_reached(tmp_path):
    """The master's probe would wait for a host that never comes: the separate pre-flight names it."""
    script = FakeScript(in_session=True, unreachable={"f2"})
    report, out, _ = run(tmp_path, script)
    assert script.gated == [] and script.probes == 1 and report.blocked == "pre-flight"


def test_health_gate_stops_on_a_bad_host(tmp_path):
    script = FakeScript(stages=[StageScript(healthcheck=bad_pair_verdict("f2"),
                                            nodes={h: NodeScript(code=1) for h in ("f1", "f2", "f3")})])
    report, out, _ = run(tmp_path, script)
    assert report.exit_code == 1 and report.blocked == "health check" and len(script.launched) == 1
    assert "the health check failed on f2: stopping" in out
    # remembered: the next `up` refuses to start on it (no spare), a `check` that passes readmits it
    with pytest.raises(PlanError, match=r"f2: failed the health check: slow \(run "):
        run(tmp_path, FakeScript())
    report, _, _ = run(tmp_path, FakeScript(), UpOptions(healthcheck_only=True))
    assert report.exit_code == 0
    report, _, _ = run(tmp_path, FakeScript())
    assert report.exit_code == 0 and report.excluded == []


def test_health_gate_excludes_the_bad_host_and_launches_again(tmp_path):
    script = FakeScript(stages=[StageScript(healthcheck=bad_pair_verdict("f2"),
                                            nodes={h: NodeScript(code=1) for h in ("f1", "f2", "f3")})])
    report, out, _ = run(tmp_path, script, healthcheck={"on_fail": "exclude"})
    assert report.exit_code == 0 and report.excluded == ["f2"]
    assert [p.hosts for p in script.launched] == [["f1", "f2", "f3"], ["f1", "f3"]]
    assert [p.nnodes for p in script.launched] == [3, 2]
    assert "EXCLUDED them (healthcheck.on_fail: exclude)" in out


@pytest.mark.parametrize("in_session", [True, False], ids=["probe-in-the-sessions", "own-round"])
def test_a_check_does_not_readmit_a_host_its_own_preflight_excluded(tmp_path, in_session):
    """A host recorded bad by an earlier run fails this check's pre-flight and is excluded; the
    check passes on the others and readmits those it passed, never the one it excluded."""
    health = health_file()
    remember(health, {"f2": "lost"}, "earlier", "fake")
    script = FakeScript(in_session=True, no_script={"f2"}) if in_session else FakeScript(unreachable={"f2"})
    report, out, _ = run(tmp_path, script, UpOptions(healthcheck_only=True), healthcheck={"on_fail": "exclude"})
    assert report.exit_code == 0 and [p.hosts for p in script.launched] == [["f1", "f3"]], out
    assert report.excluded == ["f2"] and report.passed == ["f1", "f3"]
    excluded = [e for e in read_events(tmp_path / "state" / "runs" / report.run_id) if isinstance(e, HostsExcluded)]
    assert [(e.hosts, e.gate) for e in excluded] == [(["f2"], Gate.PREFLIGHT)]
    assert list(recorded(health, 3600)) == ["f2"]  # still bad: the next `up` leaves it out


def test_separate_health_check_is_its_own_launch_and_gates_the_job(tmp_path):
    script = FakeScript(stages=[StageScript(healthcheck={"ok": False, "failures": []},
                                            nodes={"f1": NodeScript(code=1)})])
    report, _, _ = run(tmp_path, script, healthcheck={"launch": "separate"})
    assert [p.stage for p in script.launched][0] == "healthcheck" and report.exit_code == 1
    assert all(p.stage != "job" for p in script.launched)  # the job never started


def test_rescheduled_hosts_run_every_stage_again(tmp_path):
    script = FakeScript(stages=[StageScript(rescheduled=True, nodes={"f1": NodeScript(code=143)})],
                        host_sets=[["f1", "f2", "f3"], ["f4", "f5", "f6"]])
    report, out, _ = run(tmp_path, script)
    assert report.exit_code == 0 and len(script.launched) == 2
    assert script.launched[1].hosts == ["f4", "f5", "f6"] and len(report.stages) == 1
    assert "allocation requeued (restart 1): every stage runs again" in out and "hosts: f4, f5, f6" in out


def test_restart_counts_come_from_the_ranks_own_lines(tmp_path):
    script = FakeScript(stages=[StageScript(nodes={"f2": NodeScript(restarts=2)})])
    report, out, _ = run(tmp_path, script)
    assert [o.restarts for o in report.stages[0].outcomes] == [0, 2, 0]
    assert "workers restarted: f2 2x" in out


def test_first_failure_is_the_node_that_failed_by_itself_and_the_rest_are_stopped(tmp_path):
    script = FakeScript(stages=[StageScript(nodes={
        "f1": NodeScript(code=1, after=0.01, lines=failed_rank(0, 1, "RuntimeError: Connection closed by peer")),
        "f2": NodeScript(code=3, after=0.02, lines=failed_rank(1, 3, "ValueError: boom")),
        "f3": NodeScript(hangs=True)})])
    report, out, _ = run(tmp_path, script, healthcheck={"enabled": False})
    stage = report.stages[0]
    assert report.exit_code == 1
    assert [o.state for o in stage.outcomes] == ["failed", "failed", "interrupted"]
    assert stage.first_failure is not None and stage.first_failure.host == "f2"  # f1 only saw its peer die
    assert "f1 (node 0) exited with 1: stopping every other node" in out
    assert "stopped by ddplaunch: f1 (node 0) failed" in stage.outcomes[2].detail


def test_a_node_that_never_started_is_failed_and_named(tmp_path):
    script = FakeScript(stages=[StageScript(nodes={"f1": NodeScript(code=1), "f3": NodeScript(hangs=True,
                                                                                          never_started=True)})])
    report, out, _ = run(tmp_path, script, healthcheck={"enabled": False})
    f3 = report.stages[0].outcomes[2]
    assert f3.state == "failed" and f3.never_started
    assert "missing host: f3 (node 2): torchrun never started (blocked before launch)" in out


def test_lost_host_is_lost_not_failed(tmp_path):
    script = FakeScript(stages=[StageScript(nodes={"f2": NodeScript(code=None, after=0.01),
                                                   "f1": NodeScript(hangs=True), "f3": NodeScript(hangs=True)})])
    report, out, _ = run(tmp_path, script, healthcheck={"enabled": False})
    stage = report.stages[0]
    assert [o.state for o in stage.outcomes] == ["interrupted", "lost", "interrupted"]
    assert [o.host for o in stage.lost_hosts] == ["f2"] and report.exit_code == 1
    assert "f2 (node 1) lost (host lost): stopping every other node" in out


def test_an_end_without_status_on_a_host_that_answers_is_the_jobs_failure(tmp_path):
    """A torchrun killed by a signal (SSH: exit-signal, no status; srun: "Killed") on a live host:
    the probe decides, so it is not a lost host, and recovery does not replace it."""
    script = FakeScript(stages=[StageScript(nodes={"f2": NodeScript(code=None, answers=True, after=0.01),
                                                   "f1": NodeScript(hangs=True), "f3": NodeScript(hangs=True)})])
    report, out, _ = run(tmp_path, script, healthcheck={"enabled": False}, recovery=RECOVER)
    stage = report.stages[0]
    assert [o.state for o in stage.outcomes] == ["interrupted", "failed", "interrupted"], out
    assert stage.outcomes[1].detail == "Killed; its host answers"
    assert stage.lost_hosts == [] and report.recoveries == [] and report.exit_code == 1
    assert len(script.launched) == 1


def test_user_interrupt_stops_every_node_and_exits_130(tmp_path):
    script = FakeScript(stages=[StageScript(nodes={h: NodeScript(hangs=True) for h in ("f1", "f2", "f3")})],
                        interrupt_in=0)
    report, out, _ = run(tmp_path, script)
    assert report.exit_code == 130 and report.stages[0].interrupted
    assert {o.state for o in report.stages[0].outcomes} == {"interrupted"}
    assert "interrupted by the user: stopping every node" in out


def test_run_record_and_healthcheck_json_come_from_the_result(tmp_path):
    script = FakeScript()
    report, _, _ = run(tmp_path, script, opts=UpOptions(run_id="fake-rec"))
    run_dir = tmp_path / "state" / "runs" / "fake-rec"
    logged = run_view(tmp_path, "fake-rec")
    assert logged.state == "ok" and logged.stages[0].healthcheck is not None and logged.stages[0].healthcheck.ok
    assert json.loads((run_dir / "healthcheck.json").read_text())["world_size"] == 3


def test_a_backend_is_one_registration_away(tmp_path):
    """Registered in this test only: the spec accepts it, the CLI runs it; unregistered, it is an
    unknown backend again."""
    path = fake_spec(tmp_path)
    with fake_registered(FakeScript()):
        validated = CliRunner().invoke(cli, ["validate", str(path)])
        assert validated.exit_code == 0 and "ok (fake, 3 host(s)" in validated.output
        launched = CliRunner().invoke(cli, ["up", str(path), "--run-id", "fake-cli"])
        assert launched.exit_code == 0, launched.output
        assert "run fake-cli: ok (exit 0)" in launched.output
    with pytest.raises(SpecError, match="unknown backend 'fake'"):
        load_spec(path)


# ----------------------------------------------------------------------------- recovery

RECOVER = {"max_host_failures": 1, "spares": ["f4"], "detect_timeout": 0.2}


def crashed(host: str, after: float = 0.05) -> StageScript:
    """A launch in which `host` goes silent and does not answer; the others wait in a collective."""
    return StageScript(nodes={h: NodeScript(silent=True, after=after) if h == host else NodeScript(hangs=True)
                              for h in ("f1", "f2", "f3", "f4")})


def test_a_spare_that_died_while_it_waited_is_skipped_at_no_cost_to_the_budget(tmp_path):
    """The relaunch cannot reach the first spare (it crashed after the pre-flight): it is named, the
    second spare takes the lost host's node rank, and max_host_failures=1 still holds."""
    script = FakeScript(stages=[crashed("f2"), StageScript(unreachable={"f4": "SSH session failed: timeout"})])
    recovery = {**RECOVER, "spares": ["f4", "f5"]}
    report, out, _ = run(tmp_path, script, recovery=recovery)
    assert report.exit_code == 0, out
    assert [p.hosts for p in script.launched] == [["f1", "f2", "f3"], ["f1", "f4", "f3"], ["f1", "f5", "f3"]]
    (only,) = report.recoveries
    assert only.lost == ["f2"] and only.replaced == {"f2": "f5"}
    assert only.dead_spares == {"f4": "SSH session failed: timeout"}
    assert "spare f4 cannot be reached (SSH session failed: timeout): skipped, at no cost to " \
           "recovery.max_host_failures" in out
    assert "f2 lost (" in only.describe() and "replaced by f5" in only.describe()


def test_relaunches_that_lose_a_host_before_the_first_step_three_times_stop_with_no_progress(tmp_path):
    """A failure that will happen again (each relaunch loses a host before the job's first step)
    stops the run after three relaunches, not after the whole budget."""
    hosts = [f"f{i}" for i in range(1, 9)]

    def lost(host: str) -> StageScript:
        return StageScript(nodes={h: NodeScript(silent=True, after=0.05) if h == host else NodeScript(hangs=True)
                                  for h in hosts})
    script = FakeScript(stages=[lost("f2"), lost("f4"), lost("f5"), lost("f6"), lost("f7")])
    recovery = {**RECOVER, "max_host_failures": 5, "spares": ["f4", "f5", "f6", "f7", "f8"]}
    report, out, _ = run(tmp_path, script, recovery=recovery)
    assert report.exit_code == 1 and len(script.launched) == 4, out  # the first launch and three relaunches
    assert "f6 lost: no progress — the last 3 relaunches each ended before the job's first step " \
        "(f4 lost; f5 lost; f6 lost)" in out, out


def test_a_spare_that_stops_answering_while_it_waits_is_dropped_after_two_rounds(tmp_path):
    """The spare watch (sparewatch.py), round by round: a spare that fails two rounds in a row
    while the control host answers is dropped at no cost; a round in which the control fails
    too counts for nothing (this machine's network may be what failed)."""
    from ddplaunch.output.console import make_console
    from ddplaunch.run.recovery import RecoveryBudget
    from ddplaunch.run.spares import SpareWatch
    from tests.fakes import FakeBackend

    script = FakeScript()
    with fake_registered(script):
        spec = load_spec(fake_spec(tmp_path, recovery={**RECOVER, "spares": ["f4", "f5"]}))
    budget = RecoveryBudget(spec.recovery, list(spec.recovery.spares))
    out = io.StringIO()
    watch = SpareWatch(FakeBackend(spec, None, script), budget, spec.hosts[0], make_console(out, None, ["f1"]))
    assert watch.check() == []
    script.unreachable = {"f4", "f1"}  # the control fails too: nothing counts
    assert watch.check() == [] and watch.check() == [] and set(watch.strikes.values()) == {0}
    script.unreachable = {"f4"}
    assert watch.check() == []  # one strike
    script.unreachable = set()
    assert watch.check() == [] and watch.strikes["f4"] == 0  # answered again: strikes cleared
    script.unreachable = {"f4"}
    assert watch.check() == [] and watch.check() == ["f4"]
    assert [h.label for h in budget.spares] == ["f5"] and budget.lost == []
    assert list(budget.dropped) == ["f4"] and budget.dropped["f4"].startswith("f4 (f4): no answer"), budget.dropped
    assert "spare f4 does not answer (" in out.getvalue() and "dropped while it waited, at no cost to " \
        "recovery.max_host_failures (1 spare left)" in out.getvalue()
    with watch:
        pass
    script.unreachable = {"f5"}
    assert watch.check() == [] and watch.check() == []  # after the launch: the budget is the run loop's
    assert [h.label for h in budget.spares] == ["f5"]


def test_a_dead_spare_with_no_spare_left_ends_the_run_naming_it(tmp_path):
    script = FakeScript(stages=[crashed("f2"), StageScript(unreachable={"f4": "no answer"})])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code != 0 and len(script.launched) == 2, out
    assert report.unrecovered == "spare f4 cannot be reached (no answer) and no spare is left to take its place"


def test_a_spare_takes_the_lost_hosts_process_count(tmp_path):
    script = FakeScript(stages=[crashed("f2")])
    hosts = [{"addr": "f1"}, {"addr": "f2", "nproc": 3}, {"addr": "f3"}]
    report, out, _ = run(tmp_path, script, recovery=RECOVER, hosts=hosts)
    assert report.exit_code == 0, out
    assert [[n.nproc for n in p.nodes] for p in script.launched] == [[1, 3, 1], [1, 3, 1]]
    assert script.launched[1].hosts == ["f1", "f4", "f3"]


def test_a_separate_health_check_runs_again_on_the_new_set(tmp_path):
    script = FakeScript(stages=[StageScript(), crashed("f2")])
    report, out, _ = run(tmp_path, script, recovery=RECOVER, healthcheck={"launch": "separate"})
    assert report.exit_code == 0, out
    assert [(p.stage, p.hosts) for p in script.launched] == [
        ("healthcheck", ["f1", "f2", "f3"]), ("job", ["f1", "f2", "f3"]),
        ("healthcheck", ["f1", "f4", "f3"]), ("job", ["f1", "f4", "f3"])]


def test_a_lost_host_is_replaced_by_the_spare_at_its_node_rank(tmp_path):
    script = FakeScript(stages=[crashed("f2")])
    report, out, took = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 0, out
    assert [p.hosts for p in script.launched] == [["f1", "f2", "f3"], ["f1", "f4", "f3"]]
    env = dict(script.launched[1].nodes[1].env)
    assert env["DDPLAUNCH_RECOVERY"] == "1" and "DDPLAUNCH_RECOVERY" not in dict(script.launched[0].nodes[0].env)
    assert script.launched[0].master_port != script.launched[1].master_port  # a fresh port
    (recovery,) = report.recoveries
    assert recovery.lost == ["f2"] and recovery.replaced == {"f2": "f4"}
    assert "no heartbeat for 0s and the fake says so" in recovery.causes["f2"]
    first = report.stages[0]
    assert first.recovered == 1 and [o.state for o in first.outcomes] == ["interrupted", "lost", "interrupted"]
    assert "f2 (node 1) lost (no heartbeat" in out and "recovery 1 of at most 1: f2 lost" in out
    assert "stage job: lost f2 (node 1)" in out and "recovered from 1 host failure:" in out
    no_hang(took, 5, "a scripted recovery waits out none of the run loop's timers")


def test_a_lost_master_moves_the_master_to_the_spare(tmp_path):
    script = FakeScript(stages=[crashed("f1")])
    report, _, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 0 and script.launched[1].hosts == ["f4", "f2", "f3"]
    assert script.launched[1].master_addr == "f4"


def test_a_job_that_fails_by_itself_is_never_recovered(tmp_path):
    script = FakeScript(stages=[StageScript(nodes={"f2": NodeScript(code=3, after=0.01,
                                                                   lines=failed_rank(1, 3, "ValueError: boom")),
                                                   "f1": NodeScript(hangs=True), "f3": NodeScript(hangs=True)})])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 1 and len(script.launched) == 1 and report.recoveries == []
    assert "recovery" not in out.split("run fake-")[0].lower().replace("recovery:", "")


def test_a_second_failure_beyond_the_budget_names_both_hosts(tmp_path):
    script = FakeScript(stages=[crashed("f2"), crashed("f3")])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 1 and len(script.launched) == 2
    assert report.unrecovered == "f3 lost after f2 earlier: more host failures than recovery.max_host_failures=1"
    assert "not recovered: f3 lost after f2 earlier" in out


def test_without_a_spare_the_survivors_go_on_while_min_hosts_remain(tmp_path):
    script = FakeScript(stages=[crashed("f3")])
    report, out, _ = run(tmp_path, script, recovery={"max_host_failures": 1, "min_hosts": 2, "detect_timeout": 0.2})
    assert report.exit_code == 0 and script.launched[1].hosts == ["f1", "f2"]
    assert "f3 lost (" in out and "left out (2 hosts go on)" in out


def test_without_a_spare_or_min_hosts_the_run_ends_saying_what_would_help(tmp_path):
    script = FakeScript(stages=[crashed("f3")])
    report, out, _ = run(tmp_path, script, recovery={"max_host_failures": 1, "detect_timeout": 0.2})
    assert report.exit_code == 1 and len(script.launched) == 1
    assert "no spare left to replace it (add recovery.spares, or set recovery.min_hosts" in out


def test_a_spare_that_fails_the_preflight_is_named_and_dropped(tmp_path):
    script = FakeScript(unreachable={"f4"})
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 0 and script.launched[0].hosts == ["f1", "f2", "f3"]
    assert "spare f4 failed the pre-flight: dropped (the run goes on without it)" in out


def test_recovery_is_in_the_record_and_the_json_summary(tmp_path):
    from ddplaunch.report.summary import summary_json

    script = FakeScript(stages=[crashed("f2")])
    report, _, _ = run(tmp_path, script, opts=UpOptions(run_id="fake-rec2"), recovery=RECOVER)
    logged = run_view(tmp_path, "fake-rec2")
    assert logged.recoveries[0].replaced == {"f2": "f4"} and logged.hosts == ["f1", "f4", "f3"]
    summary = json.loads(summary_json(report))
    assert summary["recoveries"][0]["lost"] == ["f2"] and summary["unrecovered"] is None
    from ddplaunch.report.status import status_lines

    assert "  recovery 1: lost f2; replaced f2 -> f4" in status_lines(logged, "fake", None)


def test_a_worker_torchrun_stopped_itself_is_not_the_culprit():
    """torchrun SIGTERMs a node's other workers once one failed: the node's culprit is the rank
    that failed (here only a victim of a peer elsewhere), not the one it stopped."""
    from ddplaunch.output.torchrun import culprit

    failures = [(4, 0, 1), (5, 1, -15)]  # torchrun's order: root cause first
    own = {4: ["RuntimeError: Read error [10.0.0.2]:1: Connection reset by peer"], 5: ["step=7 loss=0.1"]}
    assert culprit(failures, own.__getitem__) == (4, 0, 1)
    alone = [(5, 1, -15)]
    assert culprit(alone, own.__getitem__) == (5, 1, -15)  # SIGTERM from outside: the one failure there is
    assert culprit([(2, 0, 1), (3, 1, -9)], {2: ["Connection reset by peer"], 3: ["step=7"]}.__getitem__) == (3, 1, -9)


def test_the_json_schema_knows_every_check_state_and_stage_the_code_writes(tmp_path):
    """docs/check-schema.json is a contract: a check, state or stage added to the code without it
    fails here, not in a user's validator."""
    import jsonschema

    from ddplaunch.plan.launch import STAGES
    from ddplaunch.diagnose.preflight import CHECKS
    from ddplaunch.report.goodput import CAUSES
    from ddplaunch.report.summary import summary_json
    from ddplaunch.record.results import STATE_ORDER
    from tests.ssh_util import ROOT

    schema = json.loads((ROOT / "docs" / "check-schema.json").read_text())
    preflight = schema["properties"]["preflight"]["oneOf"][1]
    assert preflight["properties"]["checks"]["items"]["enum"] == list(CHECKS)
    outcome = schema["properties"]["stages"]["items"]["properties"]["outcomes"]["items"]
    assert sorted(outcome["properties"]["state"]["enum"]) == sorted(STATE_ORDER)
    assert schema["properties"]["stages"]["items"]["properties"]["stage"]["enum"] == list(STAGES)
    parts = schema["properties"]["goodput"]["oneOf"][1]["properties"]["parts_s"]
    assert parts["required"] == list(CAUSES) and sorted(parts["properties"]) == sorted(CAUSES)
    report, _, _ = run(tmp_path, FakeScript(unreachable={"f2"}), recovery=RECOVER)
    summary = json.loads(summary_json(report))
    jsonschema.validate(summary["preflight"], preflight)  # the real pre-flight's cells, from scripted facts
    jsonschema.validate(summary["stages"], schema["properties"]["stages"])


# ----------------------------------------------------------------------------- the launcher suspects itself

def _quiet(**node) -> StageScript:
    """Every host heard, then silent for a second (and not answering the probe), then heard again;
    the job ends ok at 1.6 s."""
    return StageScript(nodes={h: NodeScript(after=1.6, quiet_from=0.1, quiet_for=1.0, **node) for h in ("f1", "f2", "f3")})


@pytest.mark.parametrize("spares", [[], ["f4"]], ids=["no-spare", "spare"])
def test_every_host_silent_at_once_is_the_launchers_network_not_lost_hosts(tmp_path, spares):
    """The launcher's own network drops: every host goes silent together and no probe is answered.
    No host is called lost, with or without a spare; the run ends ok when they are heard again."""
    script = FakeScript(stages=[_quiet()])
    report, out, _ = run(tmp_path, script, recovery={**RECOVER, "spares": spares})
    assert report.exit_code == 0, out
    assert len(script.launched) == 1 and not report.recoveries
    assert "3 of 3 hosts went silent at once and this machine cannot reach them (fake:22 gave no answer): " \
           "its own network is suspect; no host is called lost for up to 120s" in out
    assert re.search(r"every host is heard from again after \d+s: none was lost", out), out
    assert " lost (" not in out


def test_a_probe_failing_with_this_machines_own_error_loses_no_host(tmp_path):
    """One silent host, but its probe failed before it left this machine (EPERM from a firewall
    rule): that says nothing of the host."""
    script = FakeScript(stages=[StageScript(nodes={"f2": NodeScript(after=1.6, quiet_from=0.1, quiet_for=1.0,
                                                                    local=True),
                                                   "f1": NodeScript(after=1.6), "f3": NodeScript(after=1.6)})])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 0 and not report.recoveries, out
    assert "1 of 3 hosts went silent at once and this machine cannot reach them (fake:22 refused or unreachable " \
           "(Operation not permitted))" in out


def test_one_silent_host_among_heard_ones_is_still_lost(tmp_path):
    """The rule is for the launcher's own silence: one quiet host whose probe times out, while the
    others are heard, is lost and replaced as before."""
    script = FakeScript(stages=[StageScript(nodes={"f2": NodeScript(after=3.0, quiet_from=0.1, quiet_for=2.5),
                                                   "f1": NodeScript(hangs=True), "f3": NodeScript(hangs=True)})])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert "went silent at once" not in out
    assert [r.lost for r in report.recoveries] == [["f2"]], out


def test_the_launcher_suspects_itself_for_a_bounded_time(tmp_path, monkeypatch):
    """Hosts that stay silent and unreachable count as lost once SELF_SUSPECT_S has passed."""
    from ddplaunch.backends import failfast as watch

    monkeypatch.setattr(watch, "SELF_SUSPECT_S", 0.5)
    script = FakeScript(stages=[StageScript(nodes={h: NodeScript(silent=True, after=0.05) for h in ("f1", "f2", "f3")})])
    report, out, took = run(tmp_path, script)
    assert report.exit_code == 1, out
    assert "this machine has reached none of the silent hosts for 0s: they count as lost" in out
    assert sorted(o.host for o in report.stages[-1].outcomes if o.state == "lost") == ["f1", "f2", "f3"]
    no_hang(took, 30, "the suspicion ends after SELF_SUSPECT_S")


# ----------------------------------------------------------------------------- frozen ranks

def _all_hang() -> StageScript:
    return StageScript(nodes={h: NodeScript(hangs=True) for h in ("f1", "f2", "f3")})


def test_a_host_whose_ranks_froze_is_named_by_the_hang_watchdog_and_replaced(tmp_path):
    """Every rank silent (a collective waits for the frozen host); the watchdog's stack program finds
    f2's ranks stopped (state T) while the others can run: f2 counts as lost and the spare replaces it."""
    script = FakeScript(stages=[_all_hang()], frozen={"f2"})
    report, out, _ = run(tmp_path, script, recovery=RECOVER, rdzv_timeout=1, job={"hang_timeout": 0.3})
    assert report.exit_code == 0, out
    assert [p.hosts for p in script.launched] == [["f1", "f2", "f3"], ["f1", "f4", "f3"]]
    (only,) = report.recoveries
    assert only.lost == ["f2"] and only.replaced == {"f2": "f4"}
    assert only.causes["f2"].startswith("its ranks are frozen (process state T: pid 100) while the host answers")
    assert "[ddplaunch] f2: its ranks are frozen" in out


def test_a_hang_the_evidence_does_not_pin_on_a_host_is_the_jobs_failure(tmp_path):
    for frozen in (set(), {"f1", "f2", "f3"}):  # nobody frozen; everybody frozen alike
        script = FakeScript(stages=[_all_hang()], frozen=frozen)
        (tmp_path / str(len(frozen))).mkdir()
        report, out, _ = run(tmp_path / str(len(frozen)), script, recovery=RECOVER, rdzv_timeout=1,
                             job={"hang_timeout": 0.3})
        assert report.exit_code == 1 and len(script.launched) == 1 and not report.recoveries, out
        # each rank's state is said where it is stuck, but no host is blamed for the hang
        assert "hang: no output" in out and "ranks are frozen" not in out and "replaced" not in out


def test_recovery_turns_the_hang_watchdog_on(tmp_path, monkeypatch):
    """With recovery on and no job.hang_timeout, the watchdog runs with RECOVERY_HANG_S."""
    from ddplaunch.run import loop as runloop

    monkeypatch.setattr(runloop, "RECOVERY_HANG_S", 0.3)
    script = FakeScript(stages=[_all_hang()], frozen={"f3"})
    report, out, _ = run(tmp_path, script, recovery=RECOVER, rdzv_timeout=1)
    assert report.exit_code == 0 and [r.lost for r in report.recoveries] == [["f3"]], out
    script = FakeScript(stages=[StageScript(nodes={h: NodeScript(after=1.0) for h in ("f1", "f2", "f3")})])
    (tmp_path / "off").mkdir()
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "off" / "state"))  # f3 is not remembered there
    report, out, _ = run(tmp_path / "off", script, rdzv_timeout=1)  # no recovery: no default watchdog
    assert report.exit_code == 0 and "hang:" not in out, out


# ----------------------------------------------------------------------------- the job's own progress

def _relaunch(*lines: str) -> StageScript:
    return StageScript(nodes={"f1": NodeScript(lines=lines)})


def test_the_summary_says_what_the_relaunched_job_loaded_and_how_far_it_had_come(tmp_path):
    crash = StageScript(nodes={"f1": NodeScript(hangs=True, lines=()), "f2": NodeScript(silent=True, after=0.3),
                               "f3": NodeScript(hangs=True)})
    crash.nodes["f1"] = NodeScript(hangs=True)
    script = FakeScript(stages=[crash, _relaunch('[f1:0] DDPLAUNCH_LOADED_JSON {"rank": 0, "path": "/ck/step_8.pt", '
                                                 '"via": "torch.load"}',
                                                 '[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 5}')])
    report, out, _ = run(tmp_path, script, recovery=RECOVER, job={"resume_args": ["--init_from=resume"]})
    assert report.exit_code == 0, out
    (only,) = report.recoveries
    assert only.loaded == ["/ck/step_8.pt"] and not only.from_scratch
    assert "; the relaunched job loaded /ck/step_8.pt" in only.describe()
    # every phase of the recovery, in order, from when the host was last heard from
    assert re.search(r"\n    after f2 was last heard from: named (\S+)s, stopped (\S+)s, relaunched (\S+)s, "
                     r"first step (\S+)s\n", out), out
    assert only.detected_at <= only.stopped_at <= only.relaunched_at <= only.first_step_at
    assert "restarted from scratch" not in out
    # job.resume_args: only the relaunch is told to resume
    first, again = (p.nodes[0].argv() for p in script.launched)
    assert "--init_from=resume" not in first and again[-1] == "--init_from=resume"


def test_a_relaunched_job_that_steps_once_before_it_loads_its_checkpoint_resumed(tmp_path):
    """An FSDP2 job builds its optimizer's state with a step before DCP loads into it: its first
    step comes before its load and its word of resuming; it resumed (the Slurm FSDP2 eviction test
    was told "restarted from scratch" before)."""
    crash = StageScript(nodes={"f1": NodeScript(after=0.05, lines=('[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, '
                                                                    '"steps": 125}',)),
                               "f2": NodeScript(silent=True, after=0.3), "f3": NodeScript(hangs=True)})
    script = FakeScript(stages=[crash, _relaunch(
        '[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 1}',
        '[f1:0] DDPLAUNCH_LOADED_JSON {"rank": 0, "path": "SafeFileSystemReader", '
        '"via": "torch.distributed.checkpoint.load"}',
        '[f1:0] resumed from /ck/step_125 at step 125 (written by 3 ranks with fsdp, now 3 with fsdp)',
        '[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 6}')])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 0, out
    (only,) = report.recoveries
    assert not only.from_scratch and only.loaded == ["SafeFileSystemReader"] and only.resumed_from == 125, only
    assert "[ddplaunch] training resumed at step 125 (it loaded SafeFileSystemReader)" in out, out
    assert "restarted from scratch" not in out


def test_a_relaunched_job_that_loads_nothing_is_said_to_have_restarted_from_scratch(tmp_path):
    """Rank 0 said 14 optimizer steps before f2 was lost; the relaunch trained (40 steps) but
    loaded nothing and said nothing of resuming: it started again from scratch, and the summary
    says so (the live note too)."""
    crash = StageScript(nodes={"f1": NodeScript(after=0.05, lines=('[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, '
                                                                    '"steps": 14}',)),
                               "f2": NodeScript(silent=True, after=0.3), "f3": NodeScript(hangs=True)})
    script = FakeScript(stages=[crash, _relaunch('[f1:0] DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 40}')])
    report, out, _ = run(tmp_path, script, recovery=RECOVER)
    assert report.exit_code == 0, out
    (only,) = report.recoveries
    assert only.from_scratch and only.loaded == [] and only.steps_before == 14
    assert only.describe().endswith("; at least 14 optimizer steps done before; training restarted from scratch: the job "
                                    "did not resume (see job.resume_args)"), only.describe()
    assert "[ddplaunch] training restarted from scratch" in out


# ----------------------------------------------------------------------------- after a confirmed loss

class _OneLost:
    """Node 0's host is gone (confirmed); node 1 waits in a collective until it is stopped."""

    def __init__(self) -> None:
        self.polled, self.stopped_at, self.settle_timeout = False, None, None

    def poll(self):
        from ddplaunch.backends.failfast import NodeEnd

        if self.polled:
            return []
        self.polled = True
        return [NodeEnd(0, None, how="host gone", lost=True, confirmed=True)]

    def stop(self, nodes):
        self.stopped_at = time.monotonic()

    def settle(self, nodes, timeout):
        from ddplaunch.backends.failfast import NodeEnd

        self.settle_timeout = timeout
        return [NodeEnd(n, -9) for n in nodes]

    def never_started(self, nodes):
        return set()

    def confirm_lost(self, node):
        return None

    def lost(self, node):
        pass

    def close(self):
        pass


def test_after_a_confirmed_loss_the_others_are_stopped_at_once_with_the_short_grace(tmp_path):
    """No report grace (the lost host will report nothing) and LOST_STOP_GRACE, not job.stop_grace:
    survivors blocked in a collective with a dead peer never act on SIGTERM."""
    from ddplaunch.backends.failfast import LOST_STOP_GRACE, REPORT_GRACE, follow
    from ddplaunch.output.console import Console
    from ddplaunch.plan.launch import PlanContext, Stage, make_plan
    from ddplaunch.backends.contract import StopEvent
    from ddplaunch.output.stagelines import StageLines

    with fake_registered(FakeScript()):
        spec = load_spec(fake_spec(tmp_path, hosts=2))
    plan = make_plan(PlanContext(spec, "loss-1"), Stage.JOB, 29500)
    stage = _OneLost()
    t0 = time.monotonic()
    result = follow(stage, plan, StageLines(Console(io.StringIO())), StopEvent(), stop_grace=30)
    assert stage.stopped_at is not None and stage.stopped_at - t0 < REPORT_GRACE
    assert stage.settle_timeout == LOST_STOP_GRACE  # then killed (the backend's close): no slack, no second grace
    assert [o.state for o in result.outcomes] == ["lost", "interrupted"]


class Silent:
    """A backend no host answers (a stack dump that times out everywhere)."""

    max_parallel = 64

    def probe(self, command, timeout=30, hosts=None):
        from ddplaunch.backends.contract import HostResult
        from ddplaunch.errors import BackendError

        return [HostResult(h, None, BackendError(f"{h.label}: no answer within {timeout:g}s")) for h in hosts]


def test_stack_dumps_that_fail_alike_are_one_line_naming_eight_hosts(tmp_path):
    """At 1,000 hosts a dump that times out everywhere is one line, not a thousand."""
    from ddplaunch.diagnose.stacks import collect_stacks
    from ddplaunch.spec.model import HostSpec

    hosts = [HostSpec(addr=f"h{i}", name=f"h{i}") for i in range(1, 21)]

    with fake_registered(FakeScript()):
        spec = load_spec(fake_spec(tmp_path, hosts=20))
    stacks, problems, raw = collect_stacks(Silent(), spec, "r", hosts)
    assert (stacks, raw) == ([], {})
    assert problems == ["h1, h2, h3, h4, h5, h6, h7, h8, ... (20 hosts): no stack dump: no answer within 30s"]


def test_a_hang_names_the_ranks_the_agents_saw_frozen_when_no_stack_dump_answers(tmp_path):
    """At 1,024 ranks the stack dumps may not answer in time: the ranks the node agents said are
    frozen are named all the same, and a host whose every rank froze is the one lost."""
    from ddplaunch.backends.contract import StopEvent
    from ddplaunch.hostside.payloads import HostFrozen
    from ddplaunch.output.console import Console
    from ddplaunch.output.stagelines import StageLines
    from ddplaunch.plan.launch import PlanContext, Stage, make_plan
    from ddplaunch.run.hangwatch import HangWatchdog

    with fake_registered(FakeScript()):
        spec = load_spec(fake_spec(tmp_path, hosts=4))
    plan = make_plan(PlanContext(spec, "frozen-1"), Stage.JOB, 29500)
    labels = [n.host_label for n in plan.nodes]
    said = {labels[3]: HostFrozen({"6": ["T", 4242]}, of=2),
            labels[1]: HostFrozen({"2": ["T", 11], "3": ["D", 12]}, of=2)}
    lines, stop = StageLines(Console(io.StringIO())), StopEvent()
    watchdog = HangWatchdog(_session(tmp_path, spec, Silent(), stop), spec, plan, lines, timeout=0.2, poll=0.05,
                            frozen=lambda: said)
    with watchdog:
        lines.emit(0, labels[0], f"[{labels[0]}:0] started")  # a rank spoke: the hang timeout alone counts
        assert stop.wait(timeout=60), "the hang watchdog never fired"
    headline = watchdog.diagnosis[0]
    assert f"ranks 2,6 ({labels[1]}, {labels[3]}): frozen (process state T: stopped)" in headline, watchdog.diagnosis
    assert f"rank 3 ({labels[1]}): frozen (process state D: in an uninterruptible wait)" in headline
    assert list(stop.lost) == [labels[1]], stop.lost  # every rank of it frozen; labels[3] has one that runs
    assert (tmp_path / "stacks" / f"{labels[3]}-rank6.txt").exists()


def test_a_host_whose_every_rank_its_agent_saw_frozen_is_not_waited_for_until_the_hang_timeout(tmp_path, monkeypatch):
    """The hang rule's evidence is there once the job is silent: EVIDENT_S, not job.hang_timeout
    (for stopped ranks; a host's ranks in an uninterruptible wait get the whole timeout)."""
    from ddplaunch.backends.contract import StopEvent
    from ddplaunch.hostside.payloads import HostFrozen
    from ddplaunch.output.console import Console
    from ddplaunch.output.stagelines import StageLines
    from ddplaunch.plan.launch import PlanContext, Stage, make_plan
    from ddplaunch.run import hangwatch

    with fake_registered(FakeScript()):
        spec = load_spec(fake_spec(tmp_path, hosts=3))
    plan = make_plan(PlanContext(spec, "evident-1"), Stage.JOB, 29500)
    labels = [n.host_label for n in plan.nodes]
    said: dict = {labels[2]: HostFrozen({"4": ["T", 7]}, of=2)}  # one of its two ranks: not pinned yet
    monkeypatch.setattr(hangwatch, "EVIDENT_S", 0.3)
    lines, stop = StageLines(Console(io.StringIO())), StopEvent()
    with hangwatch.HangWatchdog(_session(tmp_path, spec, Silent(), stop), spec, plan, lines, timeout=600, poll=0.05,
                                frozen=lambda: dict(said)) as watchdog:
        lines.emit(0, labels[0], f"[{labels[0]}:0] started")
        assert not stop.wait(timeout=1.0)  # silent, but no host pinned: the hang timeout (600 s) holds
        said[labels[2]] = HostFrozen({"4": ["T", 7], "5": ["D", 8]}, of=2)
        assert not stop.wait(timeout=1.0)  # a wait in the kernel may be a slow checkpoint write: not early
        said[labels[2]] = HostFrozen({"4": ["T", 7], "5": ["T", 8]}, of=2)
        assert stop.wait(timeout=30), "a host frozen whole was waited for"
    assert list(stop.lost) == [labels[2]] and watchdog.diagnosis[0].startswith("hang: no output for ")
