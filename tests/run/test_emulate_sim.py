"""`up --emulate`: emulated ranks on real (simulated) hosts over SSH, through the real host-side
path (the node's agent, the heartbeats, the entry's reports), and each injection named as the
real fault it stands for: a slowed rank as a straggler (host and rank), a frozen rank by the hang
rule (its process stopped), a rank that exits by its exit code. A host whose agent goes quiet
while its heartbeats go on is said to be quiet, and stays in the run."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from ddplaunch.record.events import HostQuiet, HostState, RanksFrozen, RunEnded, StragglerNamed, read_events
from ddplaunch.record.results import NodeState
from tests.ssh_util import ddplaunch, popen_ddplaunch, read_until, run_processes, sim_spec
from tests.timing import no_hang

pytestmark = [pytest.mark.root, pytest.mark.slow]
#: 4 hosts x 2 emulated ranks: rank r runs on host r // 2.
RANKS = 2
#: Hang guards (3x what each takes here): a straggler is named after 15 s of slow steps (two windows).
NAMED_S, QUIET_S = 60.0, 90.0


def _spec(cluster, tmp_path: Path) -> Path:
    return sim_spec(cluster, tmp_path, n_hosts=4, stragglers={"window": 5},
                    job={"script": "jobs/train.py", "hang_timeout": 10})


def _up(run_id: str, *emulate: str) -> list[str]:
    return ["up", "--run-id", run_id, "--emulate", str(RANKS), "--emulate-step-s", "0.2", *emulate]


def test_a_slowed_rank_is_named_and_a_quiet_agent_is_said_while_its_host_stays(sim_cluster, tmp_path):
    hosts = [h.name for h in sim_cluster.hosts]
    run_id = "emu-slow"
    proc = popen_ddplaunch([*_up(run_id, "--emulate-slow", "5:3@40"), str(_spec(sim_cluster, tmp_path))], tmp_path)
    agent = None
    try:
        head = read_until(proc, "step=40 ", timeout=120)
        slowed = time.monotonic()
        named = read_until(proc, "[ddplaunch] straggler:", timeout=NAMED_S)
        no_hang(time.monotonic() - slowed, NAMED_S, "an emulated rank slowed is named from its host's agent's windows")
        agent = _agent_of(run_id, hosts[3])
        os.kill(agent, signal.SIGSTOP)  # its windows stop; the host's heartbeat goes on
        quiet = read_until(proc, f"[ddplaunch] {hosts[3]}: no step reports for steps", timeout=QUIET_S)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if agent is not None:
            _kill(agent, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    out = "".join(head + named + quiet) + rest
    assert f"[ddplaunch] straggler: {hosts[2]} (rank 5) computes" in named[-1], out[-3000:]
    events = read_events(tmp_path / "state" / "runs" / run_id)
    assert [e.straggler.host for e in events if isinstance(e, StragglerNamed)] == [hosts[2]]
    assert [e.host for e in events if isinstance(e, HostQuiet)] == [hosts[3]]
    lost = [e for e in events if isinstance(e, HostState) and e.state == NodeState.LOST]
    assert lost == [], lost  # quiet is not lost: its heartbeats came all along
    end = events[-1]
    assert isinstance(end, RunEnded) and end.exit_code == 130, out[-3000:]


def test_a_frozen_rank_is_named_by_the_hang_rule(sim_cluster, tmp_path):
    hosts = [h.name for h in sim_cluster.hosts]
    out = ddplaunch([*_up("emu-freeze", "--emulate-freeze", "6@30"), str(_spec(sim_cluster, tmp_path))], tmp_path,
                    timeout=240)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr
    assert "hang: no output for " in out.stdout
    assert re.search(rf"rank 6 \({hosts[3]}\): frozen \(process state T: stopped\)", out.stdout), out.stdout[-3000:]
    # its node's agent said so as it froze, apart from any stack dump
    said = [(e.host, e.ranks) for e in read_events(tmp_path / "state" / "runs" / "emu-freeze") if isinstance(e, RanksFrozen)]
    assert said[:1] == [(hosts[3], {"6": "T"})], said


def test_a_rank_that_exits_is_named_with_its_code(sim_cluster, tmp_path):
    hosts = [h.name for h in sim_cluster.hosts]
    out = ddplaunch([*_up("emu-exit", "--emulate-exit", "3:7@25"), str(_spec(sim_cluster, tmp_path))], tmp_path,
                    timeout=240)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr
    assert f"first failure: {hosts[1]} (node 1): failed, exit code 1; rank 3 (local rank 1) exit code 7" in out.stdout, \
        out.stdout[-3000:]


def _agent_of(run_id: str, host: str) -> int:
    """The pid of `host`'s node agent in run `run_id` (a process of the run: its environment says so)."""
    for pid, env in run_processes(run_id).items():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if env.get("DDPLAUNCH_HOST") == host and any(a.endswith(b"/agent.py") for a in argv):
            return pid
    raise AssertionError(f"no agent of run {run_id} on {host}")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
