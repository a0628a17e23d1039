"""End to end on one machine through the real CLI: `ddplaunch up` on localhost runs the health
check and then the job with real torchrun; failures and Ctrl-C end cleanly."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddplaunch.record.events import read_events
from ddplaunch.record.view import RunView

from ddplaunch.hostside.procs import run_processes
from tests.doc_examples import check_doc_example
from tests.ssh_util import write_env_files
from tests.timing import no_hang

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path):
    """ddplaunch's process env: records and host run dirs inside tmp_path."""
    e = dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"), HOME=str(tmp_path))
    e.pop("DDPLAUNCH_HC_FAULT_RANK", None)
    return e


def ddplaunch(args, env, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env, **kw)


def spec_file(tmp_path, extra: str, nproc: int = 2) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(f"name: t\nworkdir: {ROOT}\nnproc_per_node: {nproc}\n" + textwrap.dedent(extra))
    return path


def test_readme_default_runs_healthcheck_then_toy_job(env, tmp_path):
    proc = ddplaunch(["up", "cluster.yaml"], env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "HEALTHCHECK OK world=2" in out
    assert "busbw" in out.lower()
    for rank in (0, 1):
        assert f"[localhost:{rank}] rank={rank} mean_grad=4.0 updated_weight=0.6" in out
    # rank 0 prints the verdict before its job's lines (ranks' streams interleave freely: torchrun
    # tails each rank's log on its own, so only one rank's order is kept)
    assert out.index("HEALTHCHECK OK") < out.index("[localhost:0] rank=0 mean_grad=")
    (run_dir,) = (tmp_path / "state" / "runs").iterdir()
    logged = RunView.of(read_events(run_dir))
    # one launch: every worker ran the health check, then the job
    assert logged.state == "ok" and [s.stage for s in logged.stages] == ["job"]
    assert len(out.splitlines()) <= 40, out  # one screen, health-check table and both ranks included
    hc = json.loads((run_dir / "healthcheck.json").read_text())
    assert hc["ok"] and hc["world_size"] == 2
    for row in hc["bandwidth"]:
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (2 - 1) / 2)


def test_up_json_is_one_schema_valid_summary_and_the_lines_go_to_stderr(env, tmp_path):
    import jsonschema

    proc = ddplaunch(["up", "cluster.yaml", "--json"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)  # stdout is the summary and nothing else
    jsonschema.validate(summary, json.loads((ROOT / "docs" / "check-schema.json").read_text()))
    assert summary["exit_code"] == 0 and summary["blocked"] is None, summary
    assert [s["stage"] for s in summary["stages"]] == ["job"]
    (stage,) = summary["stages"]
    assert [o["state"] for o in stage["outcomes"]] == ["ok"], stage
    assert summary["healthcheck"]["ok"] and summary["healthcheck"]["world_size"] == 2
    assert proc.stderr.count("updated_weight=0.6") == 2  # the ranks' lines go to stderr


def test_dry_run_prints_plan_and_runs_nothing(env, tmp_path):
    proc = ddplaunch(["up", "cluster.yaml", "--dry-run", "--run-id", "dry"], env)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    (cmd,) = [line for line in lines if not line.startswith("#")]  # one launch: health check inline
    assert "-m torch.distributed.run --nnodes 1 --node-rank 0" in cmd and "--master-addr 127.0.0.1" in cmd
    assert cmd.endswith('"$HOME"/.ddplaunch/runs/dry/healthcheck.json -- jobs/toy_ddp.py')
    assert "/entry.py --backend auto" in cmd
    assert not (tmp_path / "state").exists() and not (tmp_path / ".ddplaunch").exists()


def test_dry_run_line_is_what_runs(env, tmp_path):
    """The job line printed by --dry-run, run by hand with bash (after writing the env file it
    describes), is the job ddplaunch runs."""
    proc = ddplaunch(["up", "cluster.yaml", "--dry-run", "--run-id", "same", "--skip-healthcheck"], env)
    (line,) = [x for x in proc.stdout.splitlines() if not x.startswith("#")]
    write_env_files(proc.stdout, tmp_path)
    by_hand = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120, env=env)
    assert by_hand.returncode == 0
    assert "[localhost:1] rank=1 mean_grad=4.0 updated_weight=0.6" in by_hand.stdout


@pytest.mark.parametrize("launch", ["inline", "separate"])
def test_healthcheck_fault_names_rank_and_stops_before_job(env, tmp_path, launch):
    path = spec_file(tmp_path, "env: {DDPLAUNCH_HC_FAULT_RANK: '1'}\n"
                               f"healthcheck: {{sizes: [4K], launch: {launch}}}\n")
    proc = ddplaunch(["up", str(path)], env)
    assert proc.returncode == 1
    assert "HEALTHCHECK FAIL" in proc.stdout and "rank 1" in proc.stdout
    assert "stopped by the health check gate: no job was started" in proc.stdout
    assert "updated_weight" not in proc.stdout and "rank=0 host=" not in proc.stdout  # no user code ran
    if launch == "separate":
        assert "stage healthcheck: FAILED on 1 of 1 node(s)" in proc.stdout and "stage job" not in proc.stdout
    else:
        check_doc_example("healthcheck", proc.stdout, ["localhost", socket.gethostname()],
                          [r"\[\S+\] HEALTHCHECK FAIL", r"stage job: ", r"  first failure: ",
                           r"(\[ddplaunch\] )?stopped by the health", r"run \S+: "])


#: Rank 1 fails with exit code 3 while rank 0 still runs (as a rank blocked in a collective would).
FAILING_JOB = """import os, sys, time
if os.environ["RANK"] == "1":
    print("failing on purpose", flush=True)
    sys.exit(3)
time.sleep(120)
"""


def test_job_failure_names_rank_and_exit_code(env, tmp_path):
    (tmp_path / "failing.py").write_text(FAILING_JOB)
    path = spec_file(tmp_path, f"""\
        healthcheck: {{enabled: false}}
        job: {{script: {tmp_path / "failing.py"}}}
    """)
    proc = ddplaunch(["up", str(path)], env)
    assert proc.returncode == 1
    assert "first failure: localhost (node 0): failed, exit code 1; rank 1 (local rank 1) exit code 3" \
        in proc.stdout


def test_env_values_arrive_literally(env, tmp_path):
    marker = tmp_path / "pwned"
    script = tmp_path / "show_env.py"
    script.write_text("import os\nprint('NOTE=' + os.environ['NOTE'], flush=True)\n")
    path = spec_file(tmp_path, f"""\
        healthcheck: {{enabled: false}}
        env: {{NOTE: "$(touch {marker}); echo"}}
        job: {{script: {script}}}
    """, nproc=1)
    proc = ddplaunch(["up", str(path)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[localhost:0] NOTE=$(touch {marker}); echo" in proc.stdout
    assert not marker.exists()


def test_sigint_ends_every_process_exit_130(env, tmp_path):
    path = spec_file(tmp_path, """\
        healthcheck: {enabled: false}
        job: {script: jobs/train.py, args: [--step-sleep, "1"]}
        env: {DDPLAUNCH_CKPT_DIR: %s}
    """ % (tmp_path / "ckpt"))
    proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(path), "--run-id", "sigint-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    deadline = time.time() + 90
    seen = []
    for line in proc.stdout:  # wait until both ranks are training
        seen.append(line)
        if line.startswith(("[localhost:0]", "[localhost:1]")) or time.time() > deadline:
            break
    assert len(list(run_processes("sigint-1"))) >= 3, "".join(seen)  # torchrun + 2 workers
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, "".join(seen) + rest
    no_hang(time.monotonic() - t0, 15, "Ctrl-C stops torchrun and both ranks (not torchrun's 30 s grace)")
    assert list(run_processes("sigint-1")) == []
    assert "stage job: INTERRUPTED" in rest


GRACEFUL_JOB = """import signal, sys, time
def on_term(*_):
    print("saving", flush=True)
    time.sleep(6)
    print("saved", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("grace, saved", [(2, False), (15, True)])
def test_stop_grace_is_the_time_a_job_gets_to_save_when_stopped(env, tmp_path, grace, saved):
    """job.stop_grace: SIGTERM, then SIGKILL that many seconds later (torchrun's 30 s otherwise):
    a 6 s save is cut short by 2 s and completes within 15 s."""
    (tmp_path / "graceful.py").write_text(GRACEFUL_JOB)
    path = spec_file(tmp_path, f"""\
        healthcheck: {{enabled: false}}
        job: {{script: {tmp_path / "graceful.py"}, stop_grace: {grace}}}
    """, nproc=1)
    run_id = f"grace-{grace}"
    proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(path), "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    seen = []
    for line in proc.stdout:  # until the job has its handler in place
        seen.append(line)
        if "ready" in line:
            break
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, "".join(seen) + rest
    log = (tmp_path / "state" / "runs" / run_id / "output.log").read_text()
    # cut short (no "saved") or waited for (the 6 s save ran to its end): the behaviour is in the log
    assert "saving" in log and ("saved" in log) == saved, log
    assert took >= 6 if saved else True, took
    no_hang(took, grace + 24, f"stop_grace={grace}: the stop ends once the job saved or its grace is over")
    assert list(run_processes(run_id)) == []


def test_runs_status_logs_and_down_of_a_finished_run(env, tmp_path):
    path = spec_file(tmp_path, "healthcheck: {enabled: false}\n")
    assert ddplaunch(["up", str(path), "--run-id", "rec-1"], env).returncode == 0
    runs = ddplaunch(["runs"], env)
    assert runs.returncode == 0 and runs.stdout.splitlines()[1].split()[:4] == ["rec-1", "ok", "local", "1"]
    for args in (["status", "rec-1"], ["status"]):  # no id: the latest run
        status = ddplaunch(args, env)
        first, *stages = status.stdout.splitlines()  # from the run's event log
        assert re.fullmatch(r"rec-1: ok \(local; hosts localhost; supervisor pid \d+ on \S+\)", first), first
        assert stages[:2] == ["  stage job:", "    localhost (node 0): ok exit 0"], status.stdout
    logs = ddplaunch(["logs", "rec-1", "--host", "localhost"], env)
    assert "[localhost:1] rank=1 mean_grad=4.0 updated_weight=0.6" in logs.stdout
    assert all(line.startswith("[localhost") for line in logs.stdout.splitlines())
    down = ddplaunch(["down", "rec-1"], env)
    assert down.returncode == 0 and down.stdout.strip() == "localhost: nothing left"
    missing = ddplaunch(["status", "nope"], env)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr
