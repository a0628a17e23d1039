"""`ddplaunch up --detach` on a real (simulated) Slurm cluster: the run's supervisor runs inside
its own allocation, with every feature of an attached run; `attach` from a new process follows it
to its end, the allocation ends with the run, `status` says how it ended, `down` cancels it; a
node crashed mid-training is replaced by the allocation's spare with no launcher at all; secrets
reach the ranks through sbatch's environment and nowhere else.

Needs root, munge and the Slurm daemons (`slurm_cluster` skips with the reason otherwise). Every
wait has a deadline; the run's processes are found by their DDPLAUNCH_RUN_ID tag.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from ddplaunch.sim.faults import sim_fault
from tests.simfixture import slurm_cluster  # noqa: F401  (session fixture)
from tests.ssh_util import ddplaunch, run_processes, run_view, submit_and_wait, wait_for
from tests.run.test_recovery import SHA_RE
from tests.run.test_recovery_slurm import _spec as recovery_spec, undisturbed_sha
from tests.backends.test_slurm import in_queue, job_of, slurm_env, slurm_spec

pytestmark = [pytest.mark.root, pytest.mark.slow]
SECRET = "det-s3cret-9f2c"


def _record(tmp_path: Path, run_id: str) -> dict:
    return json.loads((tmp_path / "state" / "runs" / run_id / "record.json").read_text())


def _gone_within(cluster, job: str, seconds: float) -> float:
    """Seconds until `job` left the queue (it must within `seconds`)."""
    started = time.monotonic()
    wait_for(lambda: not in_queue(cluster, job), timeout=seconds, interval=0.2)
    return time.monotonic() - started


def test_detached_run_is_attached_to_its_end_and_its_allocation_ends_with_it(slurm_cluster, tmp_path):
    spec = slurm_spec(slurm_cluster, tmp_path)
    dry = ddplaunch(["up", str(spec), "--dry-run", "--detach", "--run-id", "det-ok"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    started = time.monotonic()
    out = ddplaunch(["up", str(spec), "--detach", "--run-id", "det-ok"], tmp_path, timeout=60)
    detach_s = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_of(tmp_path, "det-ok")
    assert f"run det-ok: submitted Slurm job {job}" in out.stdout
    # what was submitted is exactly what the dry run printed (the supervisor adds what it runs)
    assert run_view(tmp_path, "det-ok").plan_text.startswith(dry.stdout)

    started = time.monotonic()
    attached = ddplaunch(["attach", "det-ok"], tmp_path, timeout=240)  # a new process, as from another shell
    follow_s = time.monotonic() - started
    text = attached.stdout + attached.stderr
    assert attached.returncode == 0, text
    gone_s = _gone_within(slurm_cluster, job, 10)  # the allocation ends with the run
    for rank in range(4):
        assert re.search(rf"\[\S+:{rank}\] rank={rank} mean_grad=4\.0 updated_weight=0\.6", text), text
    assert len(set(re.findall(r"\[(\S+):\d\] rank=", text))) == 2, text  # two nodes, two ranks each
    # the attached run's own pre-flight and health gate ran inside the allocation
    assert "stage job: ok on all 2 node(s)" in text and "HEALTHCHECK OK world=4" in text, text
    assert (tmp_path / "state" / "runs" / "det-ok" / "healthcheck.json").is_file()  # its gate ran inside
    logged = run_view(tmp_path, "det-ok")
    assert logged.state == "ok" and logged.started is not None, logged
    assert logged.started.supervisor_host in [h.name for h in slurm_cluster.hosts], logged.started

    status = ddplaunch(["status", "det-ok"], tmp_path)
    assert status.stdout.startswith("det-ok: ok (slurm"), status.stdout
    assert f"slurm job {job} (detached" in status.stdout, status.stdout
    logs = ddplaunch(["logs", "det-ok", "--rank", "3"], tmp_path)
    assert "rank=3 mean_grad=4.0" in logs.stdout and "rank=2 " not in logs.stdout, logs.stdout
    print(f"\nup --detach returned in {detach_s:.1f}s; attach ended with the run after {follow_s:.1f}s; "
          f"the allocation left the queue {gone_s:.1f}s later")


JOB = """\
import hashlib, os, sys, time
secret = os.environ.get("DDPL_SECRET", "")
print(f"rank={os.environ['RANK']} secret_sha={hashlib.sha256(secret.encode()).hexdigest()[:16]}", flush=True)
time.sleep(600)
"""


def test_down_cancels_a_detached_run_and_the_secret_stays_in_the_environment(slurm_cluster, tmp_path,
                                                                              monkeypatch):
    script = tmp_path / "sleeper.py"
    script.write_text(JOB)
    spec = slurm_spec(slurm_cluster, tmp_path, script=str(script))
    data = yaml.safe_load(spec.read_text())
    data["env"] = {"DDPL_SECRET": {"from_env": "DDPL_TEST_SECRET"}}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("DDPL_TEST_SECRET", SECRET)
    monkeypatch.setenv("DDPL_NOT_FOR_THE_JOB", "launcher-only")
    out = ddplaunch(["up", str(spec), "--detach", "--skip-healthcheck", "--run-id", "det-down"], tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_of(tmp_path, "det-down")
    want = f"secret_sha={hashlib.sha256(SECRET.encode()).hexdigest()[:16]}"

    seen = {"logs": ""}

    def every_rank_says_it() -> bool:
        seen["logs"] = ddplaunch(["logs", "det-down"], tmp_path).stdout
        return sum(want in line for line in seen["logs"].splitlines()) == 4
    try:
        wait_for(every_rank_says_it, timeout=120, interval=1.0)
    except TimeoutError:
        raise AssertionError(f"not every rank printed {want}:\n{seen['logs'][-3000:]}") from None

    procs = run_processes("det-down")
    ranks = [env for env in procs.values() if "RANK" in env and "LOCAL_RANK" in env]
    assert len(ranks) == 4 and all(env.get("DDPL_SECRET") == SECRET for env in ranks), procs.keys()
    assert not any("DDPL_NOT_FOR_THE_JOB" in env for env in procs.values())  # only the job's environment
    for pid in procs:
        assert SECRET not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    for argv in (["scontrol", "show", "job", "-dd", job], ["scontrol", "write", "batch_script", job, "-"]):
        shown = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=slurm_env(slurm_cluster))
        assert shown.returncode == 0 and shown.stdout.strip(), shown.stderr
        assert SECRET not in shown.stdout + shown.stderr
    for path in (tmp_path / "state").rglob("*"):
        assert not path.is_file() or SECRET not in path.read_text(errors="replace"), path

    down = ddplaunch(["down", "det-down"], tmp_path, timeout=180)
    assert down.returncode == 0 and f"job {job}: was RUNNING, cancelled" in down.stdout, down.stdout + down.stderr
    wait_for(lambda: not in_queue(slurm_cluster, job), timeout=60)
    wait_for(lambda: not run_processes("det-down"), timeout=30)
    status = ddplaunch(["status", "det-down"], tmp_path)
    # the supervisor, told to stop by the cancel, stopped every step and ended the record itself
    assert status.stdout.startswith(("det-down: interrupted (slurm", "det-down: cancelled (slurm")), status.stdout


def test_the_python_api_submits_to_slurm_and_waits_for_the_run(slurm_cluster, tmp_path):
    """`ddplaunch.submit` on Slurm hands the run to a batch job as `up --detach` does; the `Run`
    handle follows the event log its supervisor writes there, to the run's end."""
    got = submit_and_wait(slurm_spec(slurm_cluster, tmp_path), "det-api", tmp_path)
    assert got["first"] in ("submitted", "running", "ok") and got["exit"] == 0 and got["state"] == "ok", got
    # the request handed to Slurm first (what `up --detach` executed), then what its supervisor logged
    assert got["kinds"][:2] == ["requested", "run-started"] and got["kinds"][-1] == "run-ended", got["kinds"]
    text = "\n".join(got["shown"])
    assert "HEALTHCHECK OK world=4" in text and "stage job: ok on all 2 node(s)" in got["summary"], got
    job = job_of(tmp_path, "det-api")
    placement = _record(tmp_path, "det-api")["placement"]
    assert placement["kind"] == "in-job" and placement["where"].startswith(f"submitted Slurm job {job}"), placement
    _gone_within(slurm_cluster, job, 10)  # the allocation ends with the run


def test_a_node_crashed_mid_training_is_replaced_with_no_launcher_at_all(slurm_cluster, tmp_path):
    """`up --detach` returns; the supervisor inside the allocation names the crashed node and
    moves its node rank to the allocation's spare; `attach`, started only afterwards, shows the
    whole run and exits 0; the job's final parameters equal an undisturbed run's."""
    nodes = [h.name for h in slurm_cluster.hosts]
    spec = recovery_spec(slurm_cluster, tmp_path, "det-crash")
    out = ddplaunch(["up", str(spec), "--detach", "--run-id", "det-crash"], tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    log = tmp_path / "state" / "runs" / "det-crash" / "output.log"
    try:
        wait_for(lambda: log.exists() and "step=6 " in log.read_text(errors="replace"), timeout=240, interval=0.2)
        sim_fault(slurm_cluster, nodes[2], crash=True)
        attached = ddplaunch(["attach", "det-crash"], tmp_path, timeout=300)
    finally:
        sim_fault(slurm_cluster, nodes[2], clear=True)
    text = attached.stdout + attached.stderr
    assert attached.returncode == 0, text[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {nodes[2]} lost \(no heartbeat for \d+s and "
                     rf".*\) → replaced by {nodes[0]}", text), text[-3000:]
    logged = run_view(tmp_path, "det-crash")
    assert logged.state == "ok" and logged.recoveries[0].replaced == {nodes[2]: nodes[0]}
    (got,) = SHA_RE.findall(text)
    assert undisturbed_sha(tmp_path) == got  # the replicas end bitwise equal to an undisturbed run's
    from ddplaunch.sim.slurm import wait_nodes_idle

    wait_nodes_idle(slurm_cluster.slurm, nodes, timeout=120)
