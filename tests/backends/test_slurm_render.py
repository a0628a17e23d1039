"""The rendered Slurm requests (golden dry runs: the allocation and one srun step per stage), the
sbatch error mapping, and srun output handling, with fake Slurm commands on PATH (no Slurm needed).

Refresh the golden files with `UPDATE_GOLDEN=1 pytest tests/backends/test_slurm_render.py` and review
the diff.
"""

import os
import stat
import subprocess
from pathlib import Path

import pytest

from ddplaunch.backends.contract import RunContext, StopEvent
from ddplaunch.backends.slurm import SlurmBackend
from ddplaunch.backends.slurm.client import SlurmClient, describe_sbatch_error
from ddplaunch.backends.slurm.render import allocation_request, sbatch_options, step_request
from ddplaunch.backends.slurm.step import SrunStep
from ddplaunch.errors import BackendError
from ddplaunch.output.console import Console
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.launch import PlanContext, Stage, make_plan
from ddplaunch.plan.stages import UpOptions
from ddplaunch.run.begin import dry_run
from ddplaunch.spec.hostlist import expand_hostlist
from ddplaunch.spec.load import load_spec
from tests.goldens import check_golden

ROOT = Path(__file__).resolve().parents[2]

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
hosts: [gpu01, gpu02, gpu03, gpu07]
slurm: {partition: gpu, account: proj42, qos: high, gpus_per_node: 8, cpus_per_task: 64}
job: {script: jobs/train.py, args: [--epochs, "2"], max_restarts: 2}
""",
    "requeue": """\
name: pre
backend: slurm
python: python3
workdir: /srv/work
env: {WANDB_API_KEY: s3cret, NOTE: "it's $(touch /tmp/pwned)", HF_TOKEN: {from_env: TEST_HF_TOKEN}}
setup: ["module load cuda/12.4", "source /opt/venv/bin/activate"]
healthcheck: {sizes: [1K, 1M], iterations: 3}
slurm:
  nodes: 2
  output_dir: /scratch/logs
  requeue: true
  signal_seconds: 300
  time: "02:00:00"
  sbatch_extra: ["--exclusive", "--mem=0"]
job: {script: jobs/train.py}
""",
    "pyxis": """\
name: pyxis
backend: slurm
python: /usr/bin/python
workdir: /lustre/proj/work
nproc_per_node: auto
hosts: ["dgx[01-02]"]
env: {NCCL_DEBUG: WARN}
container: {image: "nvcr.io#nvidia/pytorch:24.10-py3", runtime: pyxis, mounts: [/lustre/data:/data:ro]}
job: {script: jobs/train.py}
""",
    "podman": """\
name: pod
backend: slurm
python: /opt/venv/bin/python
workdir: /srv/work
nproc_per_node: 2
slurm: {nodes: 2}
container: {image: localhost/train:1, runtime: podman, options: [--shm-size=8g]}
job: {script: jobs/train.py}
""",
}

#: The run a backend is made for, in tests that start nothing.
RUN = RunContext("r", Path("/nonexistent/run"), StopEvent())


def load(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(SPECS[name])
    return load_spec(path)


@pytest.fixture(autouse=True)
def state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DDPLAUNCH_HOME", "/home/u/.ddplaunch")
    monkeypatch.setenv("TEST_HF_TOKEN", "hf_secret_value")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_dry_run_golden(tmp_path, name):
    text = dry_run(load(tmp_path, name), UpOptions(run_id=f"{name}-1"))
    check_golden(f"slurm_{name}.txt", text)
    assert "s3cret" not in text and "hf_secret_value" not in text


def test_sbatch_options_sorted_requeue_signal_and_no_user_value_in_the_script(tmp_path):
    spec = load(tmp_path, "requeue")
    opts = sbatch_options(spec, "r", "/o/%j.out", None)
    assert opts == sorted(opts)
    assert "--requeue" in opts and "--signal=B:USR2@300" in opts
    assert "--exclusive" in opts and "--mem=0" in opts
    request = allocation_request(spec, "r", "/o/%j.out", None)
    assert "scancel --signal=USR2" in request.script and "scontrol requeue" in request.script
    assert "USR1" not in request.script and "s3cret" not in request.script and "pwned" not in request.script
    assert subprocess.run(["bash", "-n"], input=request.script, text=True).returncode == 0


def test_hosts_are_the_node_list_and_hostlists_expand(tmp_path):
    assert expand_hostlist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    spec = load(tmp_path, "gpu")
    backend = SlurmBackend(spec, RUN)
    assert [h.label for h in backend.hosts(allocate=False)] == ["gpu01", "gpu02", "gpu03", "gpu07"]
    assert "--nodelist=gpu01,gpu02,gpu03,gpu07" in backend.allocation_text()
    bad = spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"nodes": 2})})
    with pytest.raises(Exception, match="slurm.nodes is 2 but hosts lists 4"):
        SlurmBackend(bad, RUN).hosts(allocate=False)


def test_step_carries_the_env_outside_the_command_line(tmp_path):
    spec = load(tmp_path, "requeue").model_copy(update={"hosts": SlurmBackend(load(tmp_path, "requeue"), RUN).hosts(False)})
    plan = make_plan(PlanContext(spec, "r"), Stage.JOB, 25000)
    step = step_request(plan, "77")
    argv = " ".join(step.argv)
    assert "s3cret" not in argv and "hf_secret_value" not in argv and "pwned" not in argv
    env = dict(step.env)
    assert env["WANDB_API_KEY"] == "s3cret" and env["HF_TOKEN"] == "hf_secret_value"
    assert env["NOTE"] == "it's $(touch /tmp/pwned)"
    assert "--jobid=77" in step.argv and '--node-rank "$SLURM_NODEID"' in step.argv[-1]
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in step.argv[-1]


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
    ("sbatch: error: Batch job submission failed: Node count specification invalid", "slurm.nodes (or hosts)"),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available",
     "slurm.nodes (or hosts)"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination "
     "specified", "slurm.account"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "slurm.qos"),
    ("sbatch: error: Invalid --time specification", "slurm.time"),
    ("sbatch: error: Invalid generic resource (gres) specification", "slurm.gpus_per_node"),
    ("sbatch: fatal: Could not establish a configuration source", "slurm.conf"),
])
def test_sbatch_errors_name_the_spec_key(tmp_path, monkeypatch, stderr, key):
    fake_bin(tmp_path, "sbatch", f"cat >&2 <<'EOF'\n{stderr}\nEOF\nexit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    spec = load(tmp_path, "cpu").model_copy(update={"workdir": str(tmp_path)})
    backend = SlurmBackend(spec, RunContext("r", tmp_path / "run", StopEvent()))
    with pytest.raises(BackendError) as err:
        backend.hosts()
    first = stderr.splitlines()[0]
    assert str(err.value) == f"{key}: {first}"
    assert "\n" not in str(err.value)


def test_describe_unknown_error():
    assert describe_sbatch_error("sbatch: error: something odd\n") == \
        "slurm: sbatch refused the job: sbatch: error: something odd"


def test_missing_slurm_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BackendError, match="sbatch not found on PATH"):
        SlurmClient(None).run(["sbatch", "--parsable"])


def test_srun_pieces_rejoined_and_node_ends_parsed(tmp_path, monkeypatch):
    """srun cuts long lines into 1024-byte labelled pieces; its error lines say how nodes ended."""
    long = "x" * 1500
    fake_bin(tmp_path, "srun", f"""printf '0: %s\\n' '{long[:1024]}'
printf '1: [n2:3] boom\\n'
printf '0: %s\\n' '{long[1024:]}'
echo 'srun: error: n2: task 1: Exited with exit code 3' >&2
echo 'srun: error: n1: task 0: Terminated' >&2
exit 3""")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    import io

    out = io.StringIO()
    console = Console(out)
    step = SrunStep(SlurmClient(None), ["srun"], {}, ["n1", "n2"], StageLines(console), "x", "7")
    assert step.wait(timeout=30) == 3
    console.flush()
    assert step.ends[1][0] == 3 and step.ends[0][1] == "Terminated" and step.first_failure == 1
    assert f"[n1] {long}\n" in out.getvalue() and "[n2:3] boom\n" in out.getvalue()
    assert step.output == {}  # a stage's lines go to its StageLines only: nothing kept grows with the run
    probe = SrunStep(SlurmClient(None), ["srun"], {}, ["n1", "n2"], None, "x", "7")  # a probe's are its answer
    assert probe.wait(timeout=30) == 3
    assert probe.output[0] == [long] and probe.output[1] == ["[n2:3] boom"]


def test_a_mixed_fleet_step_gives_each_node_its_count_by_name(tmp_path):
    """One srun step for every node: each node's shell picks its own process count (and threads)."""
    spec = load(tmp_path, "cpu")
    hosts = [h.model_copy(update={"nproc": n}) for h, n in zip(SlurmBackend(spec, RUN).hosts(False), (1, 3))]
    plan = make_plan(PlanContext(spec.model_copy(update={"hosts": hosts}), "mx"), Stage.JOB, 25000)
    body = step_request(plan, "77").argv[-1]
    counts = body[body.index('case "$SLURMD_NODENAME" in'):body.index(" esac") + 5]
    for host, want in zip(hosts, ("1", "3")):
        out = subprocess.run(["bash", "-c", counts + ' && echo "$n"'], capture_output=True, text=True, timeout=10,
                             env={"SLURMD_NODENAME": host.label, "PATH": os.environ["PATH"]})
        assert out.stdout.strip() == want, (host.label, out)
    assert '--nproc-per-node "$n"' in body and 'c / n > 1 ? c / n : 1' in body


def test_known_nodes_take_their_node_rank_by_name_not_by_the_steps_order(tmp_path, monkeypatch):
    """After a spare (first in the allocation) replaced node 1, the step numbers the nodes
    spare, n1, ... while the plan keeps n1 at node 0: each node's shell finds its own node rank by
    its name, and the step's task ids map back to the plan's nodes."""
    from ddplaunch.backends.slurm.render import task_nodes

    spec = load(tmp_path, "cpu")
    placeholder, _ = SlurmBackend(spec, RUN).hosts(False)
    n1, spare = (placeholder.model_copy(update={"addr": n, "name": n}) for n in ("n1", "n0"))
    plan = make_plan(PlanContext(spec.model_copy(update={"hosts": [n1, spare]}), "sp"), Stage.JOB, 25000)
    body = step_request(plan, "77", by_name=True).argv[-1]
    assert body.startswith('case "$SLURMD_NODENAME" in ') and '--node-rank "$r"' in body
    assert "--master-addr n1 " in body  # the master did not move to the allocation's first node
    case = body[:body.index(" esac") + 5]
    for name, want in ((n1.label, "0"), ("n0", "1")):
        out = subprocess.run(["bash", "-c", case + ' && echo "$r"'], capture_output=True, text=True, timeout=10,
                             env={"SLURMD_NODENAME": name, "PATH": os.environ["PATH"]})
        assert out.stdout.strip() == want, (name, out)
    assert task_nodes([n1.label, "n0"], {"n0": 0, n1.label: 1}) == {0: 1, 1: 0}
    # nodes not yet known (a dry run): the step's own numbering, as before
    assert '--node-rank "$SLURM_NODEID"' in step_request(plan, "77").argv[-1]
