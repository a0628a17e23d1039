"""The pure plan: per-node torchrun lines, quoting, secrets, ports — checked against reviewed
golden files. Refresh them with `UPDATE_GOLDEN=1 pytest tests/test_plan.py` and review the diff."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from ddplaunch.launch import UpOptions, dry_run
from ddplaunch.plan import PORT_RANGE, derive_port, make_plan, render_plan
from ddplaunch.spec import load_spec
from tests.goldens import check_golden

ROOT = Path(__file__).resolve().parents[1]

SSH_SPEC = """\
name: golden
backend: ssh
hosts:
  - {addr: 10.9.0.11, name: n1}
  - {addr: 10.9.0.12, name: n2}
  - 10.9.0.13
nproc_per_node: 2
python: /opt/venv/bin/python
workdir: /srv/work dir
socket_ifname: eth1
rdzv_timeout: 30
env:
  WANDB_API_KEY: s3cret
  NOTE: "$(touch $HOME/pwned); echo"
setup: ["source /opt/venv/bin/activate"]
healthcheck: {sizes: [1K, 1M], iterations: 3, min_busbw_gbps: 0.5}
job: {script: jobs/train.py, args: [--epochs, "2"], max_restarts: 1}
"""


@pytest.fixture
def ssh_spec(tmp_path):
    path = tmp_path / "golden.yaml"
    path.write_text(SSH_SPEC)
    return load_spec(path)


def test_ssh_dry_run_golden(ssh_spec):
    check_golden("ssh_3hosts.plan.txt", dry_run(ssh_spec, UpOptions(run_id="golden-1")))


def test_local_dry_run_golden():
    spec = load_spec(ROOT / "cluster.yaml").model_copy(update={"python": "/usr/bin/python3"})
    check_golden("local_default.plan.txt", dry_run(spec, UpOptions(run_id="golden-2")))


def test_node_ranks_master_and_world(ssh_spec):
    plan = make_plan(ssh_spec, "r1", "job", 25000)
    assert plan.world_size == 6 and plan.master_addr == "10.9.0.11"
    for rank, node in enumerate(plan.nodes):
        argv = list(node.argv)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--nnodes") + 1] == "3"
        assert argv[argv.index("--master-port") + 1] == "25000"
        assert argv[argv.index("--max-restarts") + 1] == "1"
        assert argv[-3:] == ["jobs/train.py", "--epochs", "2"]
        env = dict(node.env)
        assert env["GLOO_SOCKET_IFNAME"] == "eth1" and "PYTHONPATH" not in env
        assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == f"[{node.host.label}:${{rank}}] "


def test_job_args_override(ssh_spec):
    plan = make_plan(ssh_spec, "r1", "job", 25000, job_args=["--epochs", "9"])
    assert list(plan.nodes[0].argv[-3:]) == ["jobs/train.py", "--epochs", "9"]


def test_secrets_masked_in_dry_run_only(ssh_spec):
    text = dry_run(ssh_spec, UpOptions(run_id="r"))
    assert "s3cret" not in text and "WANDB_API_KEY=***" in text
    assert "WANDB_API_KEY=s3cret" in make_plan(ssh_spec, "r", "job", 25000).nodes[0].shell_line()


def test_shell_line_quotes_hostile_values(tmp_path, ssh_spec):
    """bash parses the line back into exactly the values of the spec; nothing is executed."""
    node = make_plan(ssh_spec, "r1", "job", 25000).nodes[1]
    line = node.shell_line()
    # replace `exec env ... python ...` by printing the env words bash would pass on
    head, _, tail = line.partition("exec env ")
    probe = "printf '%s\\n' " + tail
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=10,
                         env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]})
    words = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert "NOTE=$(touch $HOME/pwned); echo" in words
    assert not (tmp_path / "pwned").exists()
    assert f"{tmp_path}/.ddplaunch/runs/r1/torchrun-job-node1" in words
    assert head.startswith("mkdir -p \"$HOME\"/.ddplaunch/runs/r1 && cd '/srv/work dir' && "
                           "source /opt/venv/bin/activate && echo $$ >")
    assert shlex.split(tail)[0].startswith("DDPLAUNCH_DIST_BACKEND=")


def test_ports_are_derived_from_run_id_and_differ_per_stage(ssh_spec):
    a, b = derive_port("run-a:job"), derive_port("run-b:job")
    assert PORT_RANGE[0] <= a < PORT_RANGE[1] and a == derive_port("run-a:job") and a != b
    text = dry_run(ssh_spec, UpOptions(run_id="x"))
    ports = {line.split("master ")[1] for line in text.splitlines() if line.startswith("# run")}
    assert len(ports) == 2


def test_render_is_deterministic(ssh_spec):
    plans = [make_plan(ssh_spec, "r", s, 25000) for s in ("healthcheck", "job")]
    assert render_plan(plans) == render_plan(plans)
