"""`ddplaunch up --detach` on a real (simulated) Slurm cluster: one batch job runs every stage by
itself; `logs -f` follows it to its end, `status` says how it ended, `down` cancels it; secrets
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

from tests.simfixture import slurm_cluster  # noqa: F401  (session fixture)
from tests.ssh_util import ddplaunch, run_processes, wait_for
from tests.test_slurm import in_queue, job_of, queue_state, slurm_env, slurm_spec

pytestmark = [pytest.mark.root, pytest.mark.slow]
SECRET = "det-s3cret-9f2c"


def _record(tmp_path: Path, run_id: str) -> dict:
    return json.loads((tmp_path / "state" / "runs" / run_id / "record.json").read_text())


def test_detached_run_is_followed_to_its_end(slurm_cluster, tmp_path):
    spec = slurm_spec(slurm_cluster, tmp_path)
    dry = ddplaunch(["up", str(spec), "--dry-run", "--detach", "--run-id", "det-ok"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    started = time.monotonic()
    out = ddplaunch(["up", str(spec), "--detach", "--run-id", "det-ok"], tmp_path, timeout=60)
    detach_s = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_of(tmp_path, "det-ok")
    assert f"run det-ok: submitted Slurm job {job}; follow it with `ddplaunch logs det-ok -f`" in out.stdout
    # what was submitted is exactly what the dry run printed
    assert _record(tmp_path, "det-ok")["plan_text"] == dry.stdout

    started = time.monotonic()
    logs = ddplaunch(["logs", "det-ok", "-f"], tmp_path, timeout=240)
    follow_s = time.monotonic() - started
    text = logs.stdout + logs.stderr
    assert logs.returncode == 0, text
    assert queue_state(slurm_cluster, job) in ("", "COMPLETED"), "logs -f returned while the job still ran"
    for rank in range(4):
        assert re.search(rf"\[\S+:{rank}\] rank={rank} mean_grad=4\.0 updated_weight=0\.6", text), text
    assert len(set(re.findall(r"\[(\S+):\d\] rank=", text))) == 2, text  # two nodes, two ranks each
    assert "HEALTHCHECK OK world=4" in text and "[ddplaunch] run ended: exit 0" in text, text
    assert "DDPLAUNCH_" not in text, text

    status = ddplaunch(["status", "det-ok"], tmp_path)
    assert status.stdout.startswith("det-ok: ok (slurm"), status.stdout
    assert f"slurm job {job} (detached" in status.stdout and "COMPLETED" in status.stdout, status.stdout
    assert _record(tmp_path, "det-ok")["state"] == "ok"
    print(f"\nup --detach returned in {detach_s:.1f}s; logs -f ended with the job after {follow_s:.1f}s")


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
    assert status.stdout.startswith("det-down: cancelled (slurm"), status.stdout
