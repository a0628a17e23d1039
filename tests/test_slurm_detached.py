"""`up --detach` on Slurm without Slurm: the rendered batch script (its torchrun lines are the
attached steps', no secret in it, hostile values intact) and the script itself run under fake
`srun`/`scontrol` (stage order, files staged byte for byte, the failing stage's exit code), the job
output read back as ddplaunch shows a run, and the shell backends' refusal.
"""

import hashlib
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddplaunch.backends.contract import RunContext
from ddplaunch.backends.slurm import SlurmBackend
from ddplaunch.backends.slurm.detached import (MASTER, OutputReader, final_state, follow_output, job_active,
                                               render_detached)
from ddplaunch.backends.slurm.render import step_request
from ddplaunch.errors import PlanError
from ddplaunch.launch import UpOptions, dry_run, plan_stage, stages_of
from ddplaunch.plan import ENTRY_SOURCES, HEALTHCHECK_SOURCES
from ddplaunch.results import StopEvent
from ddplaunch.specfile import load_spec
from tests.goldens import check_golden

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_ARGS = ["it's", "$(touch /tmp/pwned-arg)", "a b", "`id`", '"; exit 7; "', "\\$HOME"]
SPEC = f"""\
name: det
backend: slurm
python: python3
workdir: /srv/work
env:
  WANDB_API_KEY: {{value: s3cret-value, secret: true}}
  HF_TOKEN: {{from_env: TEST_HF_TOKEN}}
  NOTE: "it's $(touch /tmp/pwned)"
healthcheck: {{sizes: [1K], iterations: 2, launch: LAUNCH}}
slurm: {{nodes: 2, requeue: REQUEUE, time: "00:10:00"}}
job: {{script: "example:toy_ddp.py", args: {json.dumps(HOSTILE_ARGS)}}}
"""


@pytest.fixture(autouse=True)
def state_home(monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", "/home/u/.ddplaunch")
    monkeypatch.setenv("TEST_HF_TOKEN", "hf_secret_value")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def load(tmp_path, launch="inline", requeue=False):
    path = tmp_path / "det.yaml"
    path.write_text(SPEC.replace("LAUNCH", launch).replace("REQUEUE", str(requeue).lower()))
    return load_spec(path)


def request_of(spec, run_id="det-1"):
    backend = SlurmBackend(spec, RunContext(run_id, Path("/home/u/.ddplaunch/runs") / run_id, StopEvent()))
    spec = spec.model_copy(update={"hosts": backend.hosts(allocate=False)})
    plans = [plan_stage(spec, run_id, s, 23456, UpOptions()) for s in stages_of(spec, UpOptions())]
    return render_detached(spec, plans, backend.alloc.output_path(), None), plans


def srun_lines(script: str) -> list[list[str]]:
    """Every stage's srun line of the script (started in the background), as the words bash sees."""
    return [shlex.split(line.removesuffix(" &")) for line in script.splitlines()
            if line.startswith("srun ") and "--job-name=ddplaunch-upload" not in line]


def test_dry_run_detached_golden(tmp_path):
    text = dry_run(load(tmp_path, "separate", requeue=True), UpOptions(run_id="det-1", detach=True))
    # the staged files' sizes and hashes change with them: the golden keeps their names only
    check_golden("slurm_detached.txt", re.sub(r"(<base64 of \S+): \d+ bytes, sha256 [0-9a-f]{16}>", r"\1>", text))
    assert "s3cret-value" not in text and "hf_secret_value" not in text
    assert "WANDB_API_KEY=<secret>" in text and "HF_TOKEN=<secret>" in text


@pytest.mark.parametrize("launch", ["inline", "separate"])
def test_each_stage_runs_the_attached_torchrun_line(tmp_path, launch):
    spec = load(tmp_path, launch)
    request, plans = request_of(spec)
    lines = srun_lines(request.script)
    assert len(lines) == len(plans) == (2 if launch == "separate" else 1)
    for plan, words in zip(plans, lines):
        attached = step_request(plan, "77", heartbeat=False)  # no launcher listens for a detached run's
        assert f"--job-name=ddplaunch-{plan.stage}" in words
        body = words.pop()
        # the same torchrun invocation; only the master is the allocation's first node
        assert body == attached.argv[-1].replace(f"--master-addr {shlex.quote(plan.master_addr)}",
                                                 f"--master-addr {MASTER}")
        assert f"--master-addr {MASTER}" in body and '--node-rank "$SLURM_NODEID"' in body
        # srun: the attached options minus those naming the job from outside; a failing node ends the step
        outside = [a for a in attached.argv[:-1] if not a.startswith(("--jobid=", "--nodelist="))]
        assert words == [a.replace("--kill-on-bad-exit=0", "--kill-on-bad-exit=1") for a in outside]


def test_no_secret_in_the_script_and_hostile_values_stay_byte_for_byte(tmp_path):
    request, plans = request_of(load(tmp_path))
    for text in (request.script, request.text(), " ".join(request.argv)):
        assert "s3cret-value" not in text and "hf_secret_value" not in text
    assert "pwned)" not in request.script  # NOTE is in the environment, not the script
    env = request.process_env({"PATH": "/bin", "HOME": "/h", "SECRET_OF_THE_SHELL": "no"})
    assert env["WANDB_API_KEY"] == "s3cret-value" and env["HF_TOKEN"] == "hf_secret_value"
    assert env["NOTE"] == "it's $(touch /tmp/pwned)" and "SECRET_OF_THE_SHELL" not in env
    assert "--export=ALL" in request.argv and "--export=NONE" not in request.argv
    body = srun_lines(request.script)[-1][-1]
    assert shlex.split(body.rsplit(" && ", 1)[1])[-len(HOSTILE_ARGS):] == HOSTILE_ARGS
    assert subprocess.run(["bash", "-n"], input=request.script, text=True).returncode == 0


def test_requeue_passes_the_warning_on_and_requeues(tmp_path):
    request, _ = request_of(load(tmp_path, requeue=True))
    assert "--requeue" in request.argv and "--signal=B:USR2@120" in request.argv
    assert "trap preempt USR2" in request.script and 'scontrol requeue "$SLURM_JOB_ID"' in request.script
    assert "trap preempt" not in request_of(load(tmp_path))[0].script


def fake_bin(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_script(tmp_path: Path, script: str, rcs: dict[str, int], stage_body: str = "") -> tuple[int, str, list[str]]:
    """The batch script under fake Slurm commands: upload steps run their command (files land
    under $HOME), stage steps log their stage and master, run `stage_body` and exit with rcs[stage]."""
    fake_bin(tmp_path, "scontrol", '[ "$1" = hostnames ] || [ "$2" = hostnames ] && printf "n7\\nn8\\n" || '
             'echo "scontrol $*" >> "$FAKE_LOG"')
    fake_bin(tmp_path, "srun", '''for a in "$@"; do case "$a" in --job-name=ddplaunch-upload) exec bash -c "${@: -1}";; esac; done
echo "$DDPLAUNCH_STAGE $DDPLAUNCH_MASTER_ADDR" >> "$FAKE_LOG"
''' + stage_body + '''rc_var=RC_$DDPLAUNCH_STAGE
exit "${!rc_var:-0}"''')
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path / "home"),
           "SLURM_JOB_NODELIST": "n[7-8]", "SLURM_JOB_ID": "41", "FAKE_LOG": str(tmp_path / "srun.log"),
           **{f"RC_{k}": str(v) for k, v in rcs.items()}}
    proc = subprocess.run(["bash", "-s"], input=script, text=True, capture_output=True, env=env, timeout=60)
    log = (tmp_path / "srun.log").read_text().splitlines() if (tmp_path / "srun.log").exists() else []
    return proc.returncode, proc.stdout + proc.stderr, log


def test_the_script_stages_files_and_runs_stages_in_order(tmp_path):
    request, _ = request_of(load(tmp_path, "separate"))
    rc, out, log = run_script(tmp_path, request.script, {})
    assert rc == 0, out
    assert log == ["healthcheck n7", "job n7"]
    run_dir = tmp_path / "home" / ".ddplaunch" / "runs" / "det-1"
    for src in (*ENTRY_SOURCES, *HEALTHCHECK_SOURCES, ROOT / "jobs" / "toy_ddp.py"):
        assert hashlib.sha256((run_dir / src.name).read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert out.splitlines()[0] == "DDPLAUNCH_DETACHED job=41 restarts=0 nodes=n7,n8"
    assert out.splitlines()[-1] == "DDPLAUNCH_DETACHED_END rc=0"


def test_a_failed_health_check_stops_the_script_with_its_code(tmp_path):
    request, _ = request_of(load(tmp_path, "separate"))
    rc, out, log = run_script(tmp_path, request.script, {"healthcheck": 3})
    assert (rc, log) == (3, ["healthcheck n7"]), out
    assert "DDPLAUNCH_DETACHED_END rc=3 stage healthcheck failed" in out
    (tmp_path / "again").mkdir()
    rc, out, log = run_script(tmp_path / "again", request.script, {"job": 5})
    assert (rc, log) == (5, ["healthcheck n7", "job n7"]), out


def test_output_read_back_with_hosts_and_markers(tmp_path):
    out = tmp_path / "job.out"
    long = "y" * 1500
    out.write_bytes(b"DDPLAUNCH_DETACHED job=41 restarts=0 nodes=n7,n8\nDDPLAUNCH_STAGE job begin\n"
                    b"1: [n8:3] rank=3 updated_weight=0.6\n0: torchrun says hi\n"
                    + f"0: {long[:1024]}\n1: DDPLAUNCH_HEALTHCHECK_JSON {{}}\n0: {long[1024:]}\n".encode()
                    + b"srun: error: n8: task 1: Exited with exit code 3\nDDPLAUNCH_STAGE job end rc=3\n"
                    b"DDPLAUNCH_DETACHED_END rc=3 stage job failed\n")
    lines = OutputReader(out).read(final=True)
    assert lines == ["[ddplaunch] job 41 on n7, n8; master n7", "[ddplaunch] stage job: begins",
                     "[n8:3] rank=3 updated_weight=0.6", "[n7] torchrun says hi", f"[n7] {long}",
                     "[srun] srun: error: n8: task 1: Exited with exit code 3", "[ddplaunch] stage job: ended, exit 3",
                     "[ddplaunch] run ended: exit 3 (stage job failed)"]
    assert final_state(str(out), None, {"JobState": "FAILED"}) == "failed"
    assert final_state(str(out), "RUNNING", {}) is None
    assert final_state(str(out), "CANCELLED", {"JobState": "CANCELLED"}) == "cancelled"
    out.write_text("DDPLAUNCH_DETACHED_END rc=0\n")
    assert final_state(str(out), None, {}) == "ok"


def test_a_detached_run_without_a_scheduler_executes_what_an_attached_one_does(tmp_path):
    """local/ssh have no scheduler: a supervisor takes a detached run (tests/test_supervisor.py),
    and it runs the same requests, so the dry runs agree."""
    spec = tmp_path / "local.yaml"
    spec.write_text(f"name: t\nworkdir: {ROOT}\nnproc_per_node: 1\n")
    env = dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"))
    shown = [subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), "--dry-run", "--run-id", "d", *extra],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60) for extra in ([], ["--detach"])]
    assert shown[0].returncode == shown[1].returncode == 0 and shown[0].stdout == shown[1].stdout, shown[1].stderr
    assert "torch.distributed.run" in shown[0].stdout
    assert not (tmp_path / "state" / "runs").exists()  # a dry run records nothing
    assert dry_run(load_spec(spec), UpOptions(detach=True, run_id="d")) == shown[0].stdout


def test_the_time_limit_warning_reaches_the_steps_then_the_job_requeues(tmp_path):
    """USR2 to the batch shell (Slurm's --signal=B:USR2) during a stage: passed to the steps
    (scancel --signal=USR2), and once the step has ended the job requeues itself; no later stage."""
    request, _ = request_of(load(tmp_path, "separate", requeue=True))
    fake_bin(tmp_path, "scancel", 'echo "scancel $*" >> "$FAKE_LOG"')
    rc, out, log = run_script(tmp_path, request.script, {"healthcheck": 143},
                              stage_body='kill -USR2 "$PPID"\n')
    assert rc == 0, out
    assert log == ["healthcheck n7", "scancel --signal=USR2 41", "scontrol requeue 41"], out
    assert "DDPLAUNCH_PREEMPTED requeueing job 41" in out and "DDPLAUNCH_DETACHED_END" not in out


def test_follow_reads_until_the_job_has_ended(tmp_path):
    """`logs -f`: lines written while the job runs, and those written just before it ended."""
    out = tmp_path / "job.out"
    out.write_text("DDPLAUNCH_DETACHED job=41 restarts=0 nodes=n7\n")
    states = iter(["PENDING", "RUNNING", "COMPLETING", "COMPLETED"])

    def running() -> bool:
        state = next(states)
        with open(out, "a") as f:
            f.write(f"0: [n7:0] while {state}\n")
        return job_active(state)
    lines = list(follow_output(out, running, follow=True, poll=0))
    assert lines == ["[ddplaunch] job 41 on n7; master n7"] + \
        [f"[n7:0] while {s}" for s in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED")]
    assert list(follow_output(tmp_path / "none.out", lambda: False, follow=True)) == \
        [f"[ddplaunch] no job output at {tmp_path / 'none.out'} (not written yet, or not on a file system "
         "this machine sees)"]


def test_detach_inside_an_allocation_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    with pytest.raises(PlanError, match=r"--detach inside an allocation \(SLURM_JOB_ID=99\)"):
        SlurmBackend(load(tmp_path), RunContext("r", tmp_path, StopEvent())).render_detached([])
