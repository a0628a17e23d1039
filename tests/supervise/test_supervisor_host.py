"""`supervisor.host` on the sim: the run's supervisor runs on another host (a head node), handed
the run over SSH; `up` SIGKILLed mid-training leaves it going there and `attach` from a new process
shows it to the end, final weights bitwise equal to an undisturbed run's; the supervisor's host
crashed stops every rank within its lease; a host without ddplaunch is named with the fix before
anything runs.

Needs root (network namespaces, sshd). The supervisor runs as the sim's ssh user on the sim host
(its own home: ~/.ddplaunch); every wait has a deadline.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from ddplaunch.sim.faults import sim_fault
from tests.ssh_util import (ROOT, ddplaunch, popen_ddplaunch, read_until, run_processes, submit_and_wait,
                            wait_for)
from tests.supervise.test_supervisor import SHA_RE, _spec as local_spec
from tests.timing import no_hang

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _spec(cluster, tmp_path: Path, name: str, lease: float = 120, python: str | None = None) -> Path:
    """train.py of tests/supervise/test_supervisor.py (world 2) on hosts 0 and 1; host 3 supervises."""
    data = yaml.safe_load(cluster.spec_path.read_text())
    ref = yaml.safe_load(local_spec(tmp_path, name).read_text())
    head = dict(data["hosts"][3]) if isinstance(data["hosts"][3], dict) else {"addr": data["hosts"][3]}
    if python:
        head["python"] = python
    data.update(hosts=data["hosts"][:2], nproc_per_node=1, workdir=str(ROOT), job=ref["job"], env=ref["env"],
                healthcheck={"enabled": False}, supervisor={"lease": lease, "host": head},
                stragglers={"window": 5})  # its 32 steps: windows after the 20 of warmup
    path = tmp_path / name / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The same training, undisturbed, on this machine (world 2)."""
    tmp_path = tmp_path_factory.mktemp("ref")
    out = ddplaunch(["up", str(local_spec(tmp_path, "ref")), "--run-id", "suph-ref"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    (sha,) = SHA_RE.findall(out.stdout)
    return sha


@pytest.fixture
def run_id(request) -> Iterator[str]:
    """A run id of this test alone (the supervisor's host keeps its runs in its own home, which on
    the sim is this machine's: a leftover of an earlier session must not collide); the run's
    directory there removed afterwards."""
    rid = f"suph-{request.node.name[5:20].strip('_')}-{secrets.token_hex(3)}"
    yield rid
    shutil.rmtree(Path.home() / ".ddplaunch" / "runs" / rid, ignore_errors=True)


def _local_record(tmp_path: Path, run_id: str) -> dict:
    return json.loads((tmp_path / "state" / "runs" / run_id / "record.json").read_text())


def test_the_run_lives_on_the_supervisor_host_and_outlives_a_killed_up(sim_cluster, tmp_path, reference, run_id):
    head = sim_cluster.hosts[3]
    proc = popen_ddplaunch(["up", str(_spec(sim_cluster, tmp_path, "run")), "--run-id", run_id], tmp_path)
    head_lines = read_until(proc, "step=3 ", timeout=180)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    record = _local_record(tmp_path, run_id)
    assert (record["placement"]["kind"], record["placement"]["host"]) == ("on-host", head.name), record
    assert not (tmp_path / "state" / "runs" / run_id / "events.jsonl").exists()  # its log is kept there
    assert run_processes(run_id), "the run's ranks ended with its `up`"

    attached = ddplaunch(["attach", run_id], tmp_path, timeout=300)  # a new process, as from another shell
    text = attached.stdout + attached.stderr
    assert attached.returncode == 0, "".join(head_lines)[-2000:] + text[-3000:]
    assert SHA_RE.findall(text) == [reference], text[-3000:]  # bitwise equal to an undisturbed run
    assert "step=1 " in text  # attach replays the run from its first line
    status = ddplaunch(["status", run_id], tmp_path)
    assert status.returncode == 0 and status.stdout.startswith(f"{run_id}: ok (ssh"), status.stdout + status.stderr
    logs = ddplaunch(["logs", run_id, "--rank", "0"], tmp_path)  # train.py prints on rank 0
    ranks = re.findall(r"^\[\S+:(\d+)\]", logs.stdout, re.M)
    assert ranks and set(ranks) == {"0"} and "step=1 " in logs.stdout, logs.stdout[-2000:] + logs.stderr
    runs = ddplaunch(["runs"], tmp_path)
    assert f"supervised on {head.name}" in runs.stdout, runs.stdout
    assert wait_for(lambda: not run_processes(run_id), timeout=60) is True


def test_the_python_api_hands_the_run_there_and_follows_it(sim_cluster, tmp_path, reference, run_id):
    """`ddplaunch.submit` with supervisor.host: the run goes to that host as `up --detach` sends it;
    the `Run` handle reads its event log there (state, events, wait) over SSH."""
    got = submit_and_wait(_spec(sim_cluster, tmp_path, "api"), run_id, tmp_path, timeout=300)
    assert got["first"] in ("running", "ok") and got["exit"] == 0 and got["state"] == "ok", got
    assert got["kinds"][0] == "run-started" and got["kinds"][-1] == "run-ended" and "step-window" in got["kinds"]
    assert SHA_RE.findall("\n".join(got["shown"])) == [reference]  # bitwise equal to an undisturbed run
    record = _local_record(tmp_path, run_id)
    assert (record["placement"]["kind"], record["placement"]["host"]) == ("on-host", sim_cluster.hosts[3].name), record
    assert wait_for(lambda: not run_processes(run_id), timeout=60) is True


def test_the_supervisors_host_crashed_stops_every_rank_within_its_lease(sim_cluster, tmp_path, run_id):
    lease = 8.0
    head = sim_cluster.hosts[3]
    proc = popen_ddplaunch(["up", str(_spec(sim_cluster, tmp_path, "crash", lease=lease)), "--run-id", run_id],
                           tmp_path)
    try:
        read_until(proc, "step=3 ", timeout=180)
        crashed = time.monotonic()
        sim_fault(sim_cluster, head.name, crash=True)
        assert wait_for(lambda: not run_processes(run_id), timeout=lease + 60, interval=0.2) is True
        took = time.monotonic() - crashed
        no_hang(took, lease + 10, "every rank stops itself once its lease has not been renewed")
        assert took >= lease - 1, f"ranks stopped {took:.1f}s after the crash, before the lease ran out"
        proc.wait(timeout=60)  # `up` notices its supervisor's host is gone
        assert proc.returncode != 0
        down = ddplaunch(["down", run_id], tmp_path, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"its supervisor's host {head.name} did not answer" in down.stdout, down.stdout
        assert not run_processes(run_id)
        print(f"\nsupervisor's host crashed -> every rank stopped after {took:.1f}s (lease {lease:.0f}s)")
    finally:
        if proc.poll() is None:
            proc.kill()
        sim_fault(sim_cluster, head.name, clear=True)


def test_a_supervisor_host_without_ddplaunch_is_named_with_the_fix(sim_cluster, tmp_path, run_id):
    spec = _spec(sim_cluster, tmp_path, "nodd", python="/usr/bin/python3")
    out = ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text, text
    assert f"supervisor.host {sim_cluster.hosts[3].name}: /usr/bin/python3 cannot run ddplaunch there" in text, text
    assert "install ddplaunch for /usr/bin/python3" in text, text
    assert not (tmp_path / "state" / "runs" / run_id).exists()
    assert not run_processes(run_id)
