"""`up --detach` on Slurm without Slurm: the request (the allocation an attached run asks for,
its script running the supervisor; the run handed over in sbatch's environment, never in the
script, and read back whole), the script itself under fake Slurm commands and a fake python (the
run's exit code, SIGTERM passed on, the time-limit warning, a missing python named), the job's
output read back, and the refusals.
"""

import re
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplaunch.backends.contract import JobEnd, RunContext, StopEvent
from ddplaunch.backends.slurm import SlurmBackend
from ddplaunch.backends.slurm.detached import final_state, follow_output, job_active, render_detached
from ddplaunch.backends.slurm.render import allocation_request
from ddplaunch.errors import PlanError, SpecError
from ddplaunch.plan.handoff import SUPERVISE_ENV, decode_run, encode_run
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import Requested, from_line, to_line
from ddplaunch.record.results import RunState
from ddplaunch.record.view import RunView
from ddplaunch.run.begin import dry_run
from ddplaunch.spec.load import load_spec
from tests.goldens import check_golden

ROOT = Path(__file__).resolve().parents[2]
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


def request_of(spec, run_id="det-1", opts=None, python="/opt/venv/bin/python"):
    backend = SlurmBackend(spec, RunContext(run_id, Path("/home/u/.ddplaunch/runs") / run_id, StopEvent()))
    nodelist, nodes = backend.alloc.requested()
    return render_detached(spec, run_id, "det.yaml", opts or UpOptions(),
                           backend.alloc.output_path(), nodelist, nodes, os.environ, python=python)


def test_dry_run_detached_golden(tmp_path):
    text = dry_run(load(tmp_path, "separate", requeue=True), UpOptions(run_id="det-1", detach=True), "det.yaml")
    text = text.replace(sys.executable, "<python>").replace(str(tmp_path), "<tmp>")
    text = re.sub(r"<the run for its supervisor: \d+ bytes>", "<the run for its supervisor>", text)
    check_golden("slurm_detached.txt", text)
    assert "s3cret-value" not in text and "hf_secret_value" not in text
    assert "HF_TOKEN=<secret>" in text and "TEST_HF_TOKEN=<secret>" in text


def test_the_job_is_the_attached_runs_allocation_running_the_supervisor(tmp_path):
    spec = load(tmp_path, requeue=True)
    request = request_of(spec)
    held = allocation_request(spec, "det-1", "/srv/work/slurm-logs/det-1-%j.out", None, 2)
    # the same allocation (nodes, --no-kill, requeue): only the environment is handed over
    assert list(request.argv) == [o if o != "--export=NONE" else "--export=ALL" for o in held.argv]
    assert "/opt/venv/bin/python -m ddplaunch supervise &" in request.script
    assert "sleep 3600" not in request.script and "sleep 3600" in held.script
    assert subprocess.run(["bash", "-n"], input=request.script, text=True).returncode == 0


def test_the_run_is_handed_over_whole_and_no_secret_is_in_the_script(tmp_path):
    spec = load(tmp_path)
    request = request_of(spec, opts=UpOptions(job_args=["--lr", "$(id)"], verbose=True, run_id="ignored"))
    for text in (request.script, request.text(), " ".join(request.argv)):
        assert "s3cret-value" not in text and "hf_secret_value" not in text
    env = request.process_env({"PATH": "/bin", "HOME": "/h", "SECRET_OF_THE_SHELL": "no"})
    assert set(env) == {"PATH", "HOME", SUPERVISE_ENV, "TEST_HF_TOKEN"}  # nothing else of the launcher's
    assert env["TEST_HF_TOKEN"] == "hf_secret_value"  # from_env: read where the supervisor runs
    run = decode_run(env)
    got, path, opts = run.spec, run.spec_path, run.opts
    assert got.model_dump() == spec.model_dump() and got.base_dir == spec.base_dir and path == "det.yaml"
    assert run.environ == {}  # the job's environment has the from_env variables already
    assert got.model_fields_set == spec.model_fields_set  # "hosts" set or not: the same allocation
    assert got.env["WANDB_API_KEY"].value == "s3cret-value"  # inline secrets travel in the environment
    assert got.job.args == HOSTILE_ARGS and got.env["NOTE"].value == "it's $(touch /tmp/pwned)"
    assert opts == UpOptions(job_args=["--lr", "$(id)"], verbose=True, run_id="det-1")


def test_a_from_env_variable_not_set_is_named_before_anything_is_submitted(tmp_path, monkeypatch):
    spec = load(tmp_path)
    monkeypatch.delenv("TEST_HF_TOKEN")
    with pytest.raises(SpecError, match="env.HF_TOKEN: from_env TEST_HF_TOKEN is not set"):
        request_of(spec)


@pytest.mark.parametrize("value", [None, "not base64!", "e30=", "W10="])
def test_supervise_without_a_run_handed_over_says_so(value):
    env = {} if value is None else {SUPERVISE_ENV: value}
    with pytest.raises(SpecError, match=SUPERVISE_ENV):
        decode_run(env)


def test_the_supervise_command_outside_a_detached_job_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SUPERVISE_ENV}
    proc = subprocess.run([sys.executable, "-m", "ddplaunch", "supervise"], capture_output=True, text=True,
                          env=dict(env, DDPLAUNCH_HOME=str(tmp_path)), cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"sets {SUPERVISE_ENV}; it is not set here" in proc.stderr


def test_requeue_passes_the_warning_on_and_requeues(tmp_path):
    request = request_of(load(tmp_path, requeue=True))
    assert "--requeue" in request.argv and "--signal=B:USR2@120" in request.argv
    assert "trap preempt USR2" in request.script and 'scontrol requeue "$SLURM_JOB_ID"' in request.script
    assert "trap preempt" not in request_of(load(tmp_path)).script


def fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


#: The supervisor as the script sees it: logs its arguments and whether the run reached it, then
#: exits with $RC (or, on SIGTERM, 143 once it has "stopped the hosts").
FAKE_PYTHON = """echo "python $* run=${DDPLAUNCH_SUPERVISE:+yes}" >> "$FAKE_LOG"
trap 'echo "supervisor: SIGTERM" >> "$FAKE_LOG"; exit 143' TERM
[ -n "$SLOW" ] && { echo started > "$FAKE_LOG.started"; for _ in $(seq 300); do sleep 0.1; done; }
exit "${RC:-0}"
"""


def start_script(tmp_path: Path, script: str, **env: str) -> subprocess.Popen:
    """The batch script under fake Slurm commands, with the fake python of `request_of`."""
    for name in ("scancel", "scontrol", "squeue"):
        fake_bin(tmp_path, name, f'[ "$1" = -s ] || echo "{name} $*" >> "$FAKE_LOG"')
    full = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n7",
            "FAKE_LOG": str(tmp_path / "log"), SUPERVISE_ENV: "e30=", **env}
    return subprocess.Popen(["bash", "-c", script], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def log_of(tmp_path: Path) -> list[str]:
    path = tmp_path / "log"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("rc", [0, 1, 3])
def test_the_script_runs_the_supervisor_and_exits_with_the_runs_code(tmp_path, rc):
    python = fake_bin(tmp_path, "python", FAKE_PYTHON)
    proc = start_script(tmp_path, request_of(load(tmp_path), python=str(python)).script, RC=str(rc))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == rc, out
    assert log_of(tmp_path) == ["python -m ddplaunch supervise run=yes"]
    assert out.startswith("DDPLAUNCH_ALLOCATION job=41 restarts=0 nodes=n7")


def test_sigterm_to_the_script_reaches_the_supervisor_and_the_script_waits_for_it(tmp_path):
    python = fake_bin(tmp_path, "python", FAKE_PYTHON)
    proc = start_script(tmp_path, request_of(load(tmp_path), python=str(python)).script, SLOW="1")
    wait_for_file(tmp_path / "log.started")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert log_of(tmp_path) == ["python -m ddplaunch supervise run=yes", "supervisor: SIGTERM"]


def test_the_time_limit_warning_reaches_the_steps_then_the_job_requeues(tmp_path):
    """USR2 to the batch shell (Slurm's --signal=B:USR2) while the supervisor runs: passed to the
    steps (scancel --signal=USR2), and once no step is left the job requeues itself."""
    python = fake_bin(tmp_path, "python", FAKE_PYTHON)
    proc = start_script(tmp_path, request_of(load(tmp_path, requeue=True), python=str(python)).script, SLOW="1")
    wait_for_file(tmp_path / "log.started")
    proc.send_signal(signal.SIGUSR2)
    wait_for_file(tmp_path / "log", lambda text: "scontrol requeue 41" in text)
    proc.send_signal(signal.SIGTERM)  # what Slurm does to the requeued job's script
    out, _ = proc.communicate(timeout=60)
    assert log_of(tmp_path) == ["python -m ddplaunch supervise run=yes", "scancel --signal=USR2 41",
                                "scontrol requeue 41", "supervisor: SIGTERM"], out
    assert "DDPLAUNCH_PREEMPT job=41: checkpoint on every rank, then requeue" in out


def test_a_python_missing_on_the_node_is_named(tmp_path):
    proc = start_script(tmp_path, request_of(load(tmp_path), python="/nowhere/py thon").script)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and log_of(tmp_path) == [], out
    assert "ddplaunch: /nowhere/py thon is not on" in out and "install ddplaunch there" in out, out


def wait_for_file(path: Path, ready=lambda text: True, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and ready(path.read_text())):
        assert time.monotonic() < deadline, f"{path} not written within {timeout}s"
        time.sleep(0.05)


def test_a_detached_run_without_a_scheduler_executes_what_an_attached_one_does(tmp_path):
    """local/ssh have no scheduler: a supervisor takes a detached run (tests/supervise/test_supervisor.py),
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


def test_follow_reads_until_the_job_has_ended(tmp_path):
    """`logs -f` without the run's directory: the supervisor's screen in the job's output, lines
    written while the job runs and those written just before it ended."""
    out = tmp_path / "job.out"
    out.write_text("DDPLAUNCH_ALLOCATION job=41 restarts=0 nodes=n7\n")
    states = iter(["PENDING", "RUNNING", "COMPLETING", "COMPLETED"])

    def running() -> bool:
        state = next(states)
        with open(out, "a") as f:
            f.write(f"[n7:0] while {state}\n")
        return job_active(state)
    lines = list(follow_output(out, running, follow=True, poll=0))
    assert lines == ["DDPLAUNCH_ALLOCATION job=41 restarts=0 nodes=n7"] + \
        [f"[n7:0] while {s}" for s in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED")]
    assert list(follow_output(tmp_path / "none.out", lambda: False, follow=True)) == \
        [f"[ddplaunch] no job output at {tmp_path / 'none.out'} (not written yet, or not on a file system "
         "this machine sees)"]


def test_the_final_state_is_the_jobs():
    assert final_state("RUNNING", {}) is None and final_state("PENDING", {}) is None
    assert final_state(None, {"JobState": "COMPLETED"}) == JobEnd(RunState.OK, "the job ended COMPLETED")
    assert final_state(None, {"JobState": "FAILED"}) == JobEnd(RunState.FAILED, "the job ended FAILED")
    assert final_state("CANCELLED", {"JobState": "CANCELLED"}) == JobEnd(RunState.CANCELLED, "the job was cancelled")
    assert final_state(None, {}) == JobEnd(RunState.UNKNOWN, "the job is no longer known to slurmctld")


def test_detach_inside_an_allocation_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    with pytest.raises(PlanError, match=r"--detach inside an allocation \(SLURM_JOB_ID=99\)"):
        SlurmBackend(load(tmp_path), RunContext("r", tmp_path, StopEvent())).render_detached("s.yaml", UpOptions())


def test_supervise_runs_the_handed_over_run_in_the_foreground_and_takes_its_record_over(tmp_path):
    """What the batch script runs, here on the local backend: the run handed over in the
    environment runs in this process, its screen on stdout; the record `up --detach` wrote is
    taken over (what it recorded stays), and a second try (a requeued job) keeps the first
    try's event log beside its own."""
    spec = tmp_path / "local.yaml"
    spec.write_text(f"name: t\nworkdir: {ROOT}\nnproc_per_node: 2\nhealthcheck: {{enabled: false}}\n"
                    "job: {script: jobs/toy_ddp.py}\n")
    state = tmp_path / "state"
    run = state / "runs" / "sup-1"
    run.mkdir(parents=True)
    (run / "record.json").write_text(json.dumps({
        "run_id": "sup-1", "spec_path": str(spec), "backend": "local", "hosts": ["localhost"], "spec": {},
        "started_at": 1.0, "placement": {"kind": "in-job", "job_id": "41", "where": "job 41"}}))
    (run / "events.jsonl").write_text(to_line(Requested("what up --detach showed")) + "\n")
    env = dict(os.environ, DDPLAUNCH_HOME=str(state),
               **{SUPERVISE_ENV: encode_run(load_spec(spec), str(spec), UpOptions(run_id="sup-1"))})
    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "ddplaunch", "supervise"], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        assert "rank=1 mean_grad=" in proc.stdout and "stage job: ok on all 1 node(s)" in proc.stdout, proc.stdout
    record = json.loads((run / "record.json").read_text())
    assert record["placement"] == {"kind": "in-job", "job_id": "41", "where": "job 41"}  # its job runs it still
    first = RunView.of(map(from_line, (run / "events-try1.jsonl").read_text().splitlines()))  # type: ignore[arg-type]
    assert first.state == "ok" and first.plan_text.startswith("what up --detach showed# run sup-1 stage job")
    for events, head in ((run / "events.jsonl", []), (run / "events-try1.jsonl", ["requested"])):
        kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
        assert kinds[:len(head) + 1] == [*head, "run-started"] and kinds[-1] == "run-ended", kinds
