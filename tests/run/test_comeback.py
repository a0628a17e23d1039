"""Hosts that come back (recovery.rejoin_after), round by round, with a scripted backend: a host
the run lost is probed with the spares; once it has answered for rejoin_after seconds it is a
spare again, said as an event and on screen; a failed answer starts its wait over; an operator's
`ddplaunch hosts clear` readmits it at its next answer; a host lost twice is never taken back."""

from __future__ import annotations

import io
import time

import pytest

from ddplaunch.output.console import make_console
from ddplaunch.record.events import HostBack
from ddplaunch.record.incidents import Recovery
from ddplaunch.record.view import RunView
from ddplaunch.report.summary import summarize
from ddplaunch.run.recovery import RecoveryBudget
from ddplaunch.run.spares import SpareWatch
from ddplaunch.spec.load import load_spec
from tests.fakes import FakeBackend, FakeScript, fake_registered, fake_spec

RECOVER = {"max_host_failures": 2, "spares": ["f4"], "rejoin_after": 30}


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))


def _watch(tmp_path, cleared=lambda label: False, **recovery):
    script = FakeScript()
    with fake_registered(script):
        spec = load_spec(fake_spec(tmp_path, recovery={**RECOVER, **recovery}))
    budget = RecoveryBudget(spec.recovery, list(spec.recovery.spares))
    said: list[HostBack] = []
    out = io.StringIO()
    watch = SpareWatch(FakeBackend(spec, None, script), budget, spec.hosts[0], make_console(out, None, ["f1"]),
                       said.append, cleared=cleared)
    # f2 lost once (as RecoveryBudget._replace records it): the spare f4 took its place
    budget.lost, budget.lost_specs, budget.spares = ["f2"], {"f2": spec.hosts[1]}, []
    return script, budget, watch, said, out


def test_a_lost_host_that_answers_for_rejoin_after_is_a_spare_again(tmp_path):
    script, budget, watch, said, out = _watch(tmp_path)
    script.unreachable = {"f2"}
    watch.check()
    assert budget.comeback() and budget.spares == [] and "f2" not in budget.healthy_since
    script.unreachable = set()
    watch.check()  # the first answer: its wait starts
    assert budget.spares == [] and "f2" in budget.healthy_since
    budget.healthy_since["f2"] = time.time() - 31  # (as if 31 s of rounds had passed, each answered)
    watch.check()
    assert [h.label for h in budget.spares] == ["f2"] and budget.comeback() == []
    assert [(e.host, e.cleared) for e in said] == [("f2", False)] and said[0].healthy_s >= 30
    assert "f2 is back as a spare (healthy for 31s)" in out.getvalue()


def test_a_failed_answer_starts_the_wait_over(tmp_path):
    script, budget, watch, said, _ = _watch(tmp_path)
    watch.check()
    budget.healthy_since["f2"] = time.time() - 31
    script.unreachable = {"f2"}
    watch.check()
    script.unreachable = set()
    watch.check()
    assert budget.spares == [] and said == [] and time.time() - budget.healthy_since["f2"] < 30


def test_a_round_the_control_misses_tells_nothing(tmp_path):
    script, budget, watch, said, _ = _watch(tmp_path)
    watch.check()
    budget.healthy_since["f2"] = time.time() - 31
    script.unreachable = {"f1"}  # this machine's network, perhaps
    watch.check()
    assert budget.spares == [] and said == []


def test_an_operator_s_clear_readmits_at_the_next_answer(tmp_path):
    script, budget, watch, said, out = _watch(tmp_path, cleared=lambda label: label == "f2")
    watch.check()
    assert [h.label for h in budget.spares] == ["f2"] and said[0].cleared
    assert "f2 is back as a spare (readmitted by `ddplaunch hosts clear`)" in out.getvalue()


@pytest.mark.parametrize("recovery", [{"rejoin_after": 0}, {}])
def test_a_host_lost_twice_or_rejoin_after_0_is_not_taken_back(tmp_path, recovery):
    script, budget, watch, said, _ = _watch(tmp_path, cleared=lambda label: True, **recovery)
    if recovery.get("rejoin_after") != 0:
        budget.lost.append("f2")  # it came back once, and was lost again
    assert budget.comeback() == []
    watch.check()
    assert budget.spares == [] and said == []


def test_the_summary_says_which_host_came_back():
    view = RunView(run_id="r")
    view.add(HostBack("f2", 30.4))
    view.recoveries.append(Recovery(number=1, lost=["f3"], causes={"f3": "no heartbeat"}, lost_at=0.0, detected_at=1.0,
                                    replaced={"f3": "f2"}, hosts_after=3))
    text = summarize(view)
    assert "f2 came back as a spare (healthy for 30s)" in text and "f3 lost (no heartbeat) → replaced by f2" in text


def test_hosts_clear_during_the_run_is_what_cleared_reads(tmp_path):
    """`ddplaunch hosts clear HOST` edits the host-health file the running supervisor recorded the
    lost host in: its HostMemory then says the host was cleared (and only a host it recorded)."""
    from click.testing import CliRunner

    from ddplaunch.cli import cli
    from ddplaunch.record.events import RecoveryStarted
    from ddplaunch.run.hostmemory import HostMemory

    with fake_registered(FakeScript()):
        spec = load_spec(fake_spec(tmp_path, recovery=RECOVER))
    memory = HostMemory(spec, "r-1")
    memory.note(RecoveryStarted(Recovery(number=1, lost=["f2"], causes={"f2": "no heartbeat"}, lost_at=0.0,
                                         detected_at=1.0, replaced={"f2": "f4"}, hosts_after=3),
                                ["f1", "f4", "f3"]))
    assert not memory.cleared("f2") and not memory.cleared("f3")
    done = CliRunner().invoke(cli, ["hosts", "clear", "f2"])
    assert done.exit_code == 0 and "f2: readmitted" in done.output, done.output
    assert memory.cleared("f2") and not memory.cleared("f3")
    memory.note(HostBack("f2", 0.0, True))  # back: nothing of it is left in the file
    assert memory.cleared("f2")


def test_a_run_that_grew_back_says_so_and_counts_no_fault_for_it():
    """Growing back is a planned relaunch at a checkpoint: said in the summary, the status and the
    page's timeline, never a host failure."""
    from ddplaunch.report.page import timeline
    from ddplaunch.report.status import status_lines

    view = RunView(run_id="r")
    view.recoveries += [Recovery(number=1, lost=["f3"], causes={"f3": "no heartbeat"}, lost_at=0.0, detected_at=1.0,
                                 hosts_after=2),
                        Recovery(number=2, lost=[], causes={}, lost_at=50.0, detected_at=50.0, hosts_after=3,
                                 grown=["f3"])]
    text = summarize(view)
    assert "recovered from 1 host failure (grown back once after):" in text, text
    assert "  f3 back → the world grows from 2 to 3 hosts" in text and "after the job held at its checkpoint" in text
    assert "  grown back (relaunch 2): f3 back; 3 hosts" in status_lines(view, "ssh", False)
    view.add(HostBack("f3", 30.2))
    page = timeline(view)
    assert "f3 back as a spare (healthy for 30s)" in page and "grown back (relaunch 2): f3 back → the world" in page
