"""The rendered sbatch request (golden files) and the Slurm backend's error mapping (fake sbatch).

Refresh the golden scripts with `UPDATE_GOLDEN=1 pytest tests/test_slurm_render.py` and review
the diff. The fakes are tiny shell scripts on PATH: no Slurm is needed here.
"""

import os
import stat
import subprocess
from pathlib import Path

import pytest

from ddplaunch.backends.base import LineSink
from ddplaunch.backends.slurm import SlurmBackend, _Follower, SlurmJob, describe_sbatch_error
from ddplaunch.errors import BackendError
from ddplaunch.launch import UpOptions, dry_run, plan_run
from ddplaunch.slurm_render import SbatchOptions, render_sbatch, sbatch_lines, sbatch_options
from ddplaunch.spec import load_spec
from tests.goldens import check_golden

ROOT = Path(__file__).resolve().parents[1]

SPECS = {
    "cpu": """\
name: cpu
backend: slurm
python: /opt/venv/bin/python
workdir: /srv/work
nproc_per_node: 2
slurm: {partition: debug, nodes: 2, time: "00:30:00"}
""",
    "gpu": """\
name: gpu
backend: slurm
python: /opt/venv/bin/python
workdir: /srv/work
nproc_per_node: auto
socket_ifname: ib0
rdzv_timeout: 120
slurm: {partition: gpu, account: proj42, qos: high, nodes: 4, gpus_per_node: 8, cpus_per_task: 64}
job: {script: jobs/train.py, args: [--epochs, "2"], max_restarts: 2}
""",
    "requeue": """\
name: pre
backend: slurm
python: python3
workdir: /srv/work
env: {WANDB_API_KEY: s3cret, NOTE: "it's $(touch /tmp/pwned)"}
setup: ["module load cuda/12.4", "source /opt/venv/bin/activate"]
healthcheck: {sizes: [1K, 1M], iterations: 3}
slurm:
  nodes: 2
  output_dir: /scratch/logs
  requeue: true
  signal_seconds: 300
  time: "02:00:00"
  sbatch_extra: ["--exclusive", "#SBATCH --mem=0"]
job: {script: jobs/train.py}
""",
}


def load(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(SPECS[name])
    return load_spec(path)


@pytest.fixture(autouse=True)
def state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DDPLAUNCH_HOME", "/home/u/.ddplaunch")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_dry_run_golden(tmp_path, name):
    check_golden(f"slurm_{name}.sbatch", dry_run(load(tmp_path, name), UpOptions(run_id=f"{name}-1")))


def test_sbatch_lines_sorted_and_requeue_signal(tmp_path):
    spec = load(tmp_path, "requeue")
    lines = sbatch_lines(spec, "r", "/o/%j.out")
    assert lines == sorted(lines)
    assert "--requeue" in lines and "--signal=B:USR2@300" in lines
    assert "--exclusive" in lines and "--mem=0" in lines
    script = render_sbatch(spec, "r").script
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in script
    assert "USR1" not in script


def test_gres_and_auto_nproc(tmp_path):
    script = render_sbatch(load(tmp_path, "gpu"), "g").script
    assert "#SBATCH --gres=gpu:8\n" in script and "--nproc-per-node=8" in script
    assert "export NCCL_SOCKET_IFNAME=ib0" in script and "--rdzv-conf=timeout=120" in script
    assert "--max-restarts=2" in script and "--max-restarts=0" in script  # job / health check
    cpu = load(tmp_path, "cpu").model_copy(update={"nproc_per_node": "auto"})
    assert '--nproc-per-node="${SLURM_GPUS_ON_NODE:-1}"' in render_sbatch(cpu, "c").script


def test_secrets_masked_only_in_the_dry_run(tmp_path):
    spec = load(tmp_path, "requeue")
    request = render_sbatch(spec, "r")
    assert "s3cret" not in request.render() and "export WANDB_API_KEY=***" in request.render()
    assert "export WANDB_API_KEY=s3cret" in request.script


def test_script_parses_and_quotes_hostile_values(tmp_path):
    """bash -n accepts the script; the hostile env value stays one literal word."""
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(load(tmp_path, "requeue"), "r").script)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env_lines = [ln for ln in script.read_text().splitlines() if ln.startswith("export NOTE=")]
    out = subprocess.run(["bash", "-c", env_lines[0] + '; printf %s "$NOTE"'], capture_output=True,
                         text=True, timeout=10)
    assert out.stdout == "it's $(touch /tmp/pwned)"


def test_options_from_plans_round_trip(tmp_path):
    spec = load(tmp_path, "gpu")
    plans = plan_run(spec, "r", UpOptions(job_args=["--epochs", "9"]))
    opts = sbatch_options(plans)
    assert opts == SbatchOptions(stages=("healthcheck", "job"), job_args=("--epochs", "9"))
    assert render_sbatch(spec, "r", opts).argv[-3:] == ("/home/u/.ddplaunch/runs/r/job.sbatch", "--epochs", "9")
    assert sbatch_options(plan_run(spec, "r", UpOptions(skip_healthcheck=True))).stages == ("job",)


# ---------------------------------------------------------------------------- fake Slurm


def fake_bin(tmp_path, name, body):
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.parametrize("stderr, key", [
    ("sbatch: error: invalid partition specified: foo\n"
     "sbatch: error: Batch job submission failed: Invalid partition name specified", "slurm.partition"),
    ("sbatch: error: Batch job submission failed: Node count specification invalid", "slurm.nodes"),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available",
     "slurm.nodes"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination "
     "specified", "slurm.account"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "slurm.qos"),
    ("sbatch: error: Invalid --time specification", "slurm.time"),
    ("sbatch: error: Invalid generic resource (gres) specification", "slurm.gpus_per_node"),
    ("sbatch: fatal: Could not establish a configuration source", "slurm.conf"),
])
def test_sbatch_errors_name_the_spec_key(tmp_path, monkeypatch, stderr, key):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    fake_bin(tmp_path, "sbatch", f"cat >&2 <<'EOF'\n{stderr}\nEOF\nexit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    spec = load(tmp_path, "cpu").model_copy(update={"workdir": str(tmp_path)})
    with pytest.raises(BackendError) as err:
        SlurmBackend(spec).submit(render_sbatch(spec, "r"))
    first = stderr.splitlines()[0]
    assert str(err.value) == f"{key}: {first}"
    assert "\n" not in str(err.value)


def test_describe_unknown_error():
    assert describe_sbatch_error("sbatch: error: something odd\n") == \
        "slurm: sbatch refused the job: sbatch: error: something odd"


def test_missing_slurm_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    spec = load(tmp_path, "cpu").model_copy(update={"workdir": str(tmp_path)})
    with pytest.raises(BackendError, match="sbatch not found on PATH"):
        SlurmBackend(spec).submit(render_sbatch(spec, "r"))


def test_submit_writes_script_records_job_and_passes_slurm_conf(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    log = tmp_path / "argv"
    fake_bin(tmp_path, "sbatch", f'echo "$SLURM_CONF $*" > {log}; echo "4242;cluster"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    spec = load(tmp_path, "cpu").model_copy(update={
        "workdir": str(tmp_path), "slurm": load(tmp_path, "cpu").slurm.model_copy(update={"conf": "/etc/x.conf"})})
    request = render_sbatch(spec, "r1", SbatchOptions(job_args=("--a", "b c")))
    job = SlurmBackend(spec).submit(request)
    assert job.job_id == "4242" and SlurmJob.load("r1").job_id == "4242"
    assert log.read_text().split() == ["/etc/x.conf", "--parsable", request.script_path, "--a", "b", "c"]
    assert Path(request.script_path).read_text() == request.script
    assert (Path(request.log_dir) / "healthcheck.py").is_file()
    assert job.output_file == tmp_path / "slurm-logs" / "r1-4242.out"


def test_follower_builds_per_node_results_from_markers(tmp_path):
    """A failing rank on node 1: its node is FAILED with the rank, node 0 was ended by Slurm."""
    import io

    out = io.StringIO()
    sink = LineSink(out)
    spec = load(tmp_path, "cpu")
    plans = {p.stage: p for p in plan_run(spec, "r", UpOptions())}
    seen = []
    f = _Follower(SlurmJob("r", "7", str(tmp_path / "o-%j.out"), "s"), plans, sink,
                  lambda plan, result, sink: seen.append(result.stage), 2)
    for line in [
        "DDPLAUNCH_JOB id=7 restarts=0 master=n1:20014 nodes=n1,n2",
        "DDPLAUNCH_STAGE healthcheck begin",
        "0: [n1:0] ok", "1: [n2:2] ok",
        "0: DDPLAUNCH_NODE stage=healthcheck node=0 host=n1 rc=0 t=1.0",
        "1: DDPLAUNCH_NODE stage=healthcheck node=1 host=n2 rc=0 t=1.1",
        "DDPLAUNCH_STAGE healthcheck end rc=0",
        "DDPLAUNCH_STAGE job begin",
        "1: [n2:3] boom",
        "1: Root Cause (first observed failure):",
        "1: [0]:",
        "1:   rank      : 3 (local_rank: 1)",
        "1:   exitcode  : 3 (pid: 99)",
        "1: DDPLAUNCH_NODE stage=job node=1 host=n2 rc=1 t=2.0",
        "srun: error: n2: task 1: Exited with exit code 1",
        "DDPLAUNCH_STAGE job end rc=1",
    ]:
        f.feed(line)
    f.finish({"JobState": "FAILED", "ExitCode": "1:0"}, interrupted=False)
    assert seen == ["healthcheck", "job"]
    hc, job = f.results
    assert hc.ok and [o.host for o in hc.outcomes] == ["n1", "n2"]
    assert not job.ok and job.first_failure.host == "n2"
    assert (job.first_failure.failed_rank, job.first_failure.rank_exit_code) == (3, 3)
    assert job.outcomes[0].state == "interrupted" and "after n2 (node 1) failed" in job.outcomes[0].detail
    text = out.getvalue()
    assert "[n2:3] boom" in text and "[batch] srun: error" in text and "DDPLAUNCH_NODE" not in text


def test_follower_cancel_before_start_is_interrupted(tmp_path):
    import io

    spec = load(tmp_path, "cpu")
    plans = {p.stage: p for p in plan_run(spec, "r", UpOptions())}
    f = _Follower(SlurmJob("r", "7", "o", "s"), plans, LineSink(io.StringIO()), lambda *a: None, 2)
    f.finish({}, interrupted=True)
    (result,) = f.results
    assert result.interrupted and result.stage == "healthcheck"
    assert {o.state for o in result.outcomes} == {"interrupted"}
