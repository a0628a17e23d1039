"""The spec's `checkpoint:` section, planned: validated like every section, and turned into every
node's environment (hostside/ckpt/config.py reads it) and `{checkpoint_dir}` in the job's
arguments. Pure: nothing runs."""

from __future__ import annotations

import json
import os
import shlex
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddplaunch.cli import cli
from ddplaunch.diagnose.preflight import evaluate, probe_command, render_table
from ddplaunch.errors import PlanError
from ddplaunch.hostside.probe import durable_problem
from ddplaunch.spec.load import load_spec, load_spec_data
from ddplaunch.plan.launch import PlanContext, StageOptions, Stage, make_plan
from ddplaunch.spec.model import CheckpointTier

SSH = {"backend": "ssh", "hosts": [{"addr": "10.9.0.11", "name": "n1"}, {"addr": "10.9.0.12", "name": "n2"}],
       "workdir": "/srv/my work", "python": "/opt/venv/bin/python", "dist_backend": "gloo"}
CKPT_ENV = ("DDPLAUNCH_CHECKPOINT_DIR", "DDPLAUNCH_CHECKPOINT_DURABLE", "DDPLAUNCH_CHECKPOINT_KEEP",
            "DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT")


def _validate(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    (tmp_path / "jobs").mkdir(exist_ok=True)
    (tmp_path / "jobs" / "toy_ddp.py").write_text("print('hi')\n")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return result.output.removeprefix(f"ddplaunch: error: {path}").strip()


@pytest.mark.parametrize("text, expected", [
    ("checkpoint:\n  path: ck\n  tiers: memory\n", ":3: checkpoint.tiers: unknown key 'tiers' (did you mean 'tier'?)"),
    ("checkpoint:\n  path: ck\n  tier: ram\n", ":3: checkpoint.tier: Input should be 'memory' or 'disk', got 'ram'"),
    ("checkpoint:\n  durable: /shared\n", ":1: checkpoint.path: Field required"),
    ("checkpoint:\n  path: ck\n  memory_limit: lots\n", ":3: checkpoint.memory_limit: size 'lots' is not a positive"),
    ("checkpoint:\n  path: ck\n  keep: 0\n", ":3: checkpoint.keep: Input should be greater than or equal to 1"),
    ("checkpoint:\n  path: ck\n  replicas: -1\n", ":3: checkpoint.replicas: Input should be greater than or equal"),
    ("checkpoint:\n  path: ~/ck\n", ":2: checkpoint.path: '~/ck' is not a directory on the hosts"),
    ("job:\n  args: [--out, '{checkpoint_dir}']\n", "job.args: {checkpoint_dir} names the checkpoint: section's path"),
    ("env:\n  DDPLAUNCH_CHECKPOINT_DIR: /x\ncheckpoint: {path: ck}\n",
     "env.DDPLAUNCH_CHECKPOINT_DIR: set from the checkpoint: section"),
])
def test_bad_checkpoint_section_is_one_line_with_key_and_line(tmp_path, text, expected):
    assert expected in _validate(tmp_path, text)


def test_defaults_and_sizes():
    spec = load_spec_data({**SSH, "checkpoint": {"path": "ck"}})
    ck = spec.checkpoint
    assert ck is not None and (ck.tier, ck.replicas, ck.keep, ck.durable) == (CheckpointTier.DISK, 1, 2, None)
    assert ck.memory_limit_bytes == 0  # the disk tier: every save straight to the durable dir
    memory = load_spec_data({**SSH, "checkpoint": {"path": "ck", "tier": "memory", "memory_limit": "8GiB"}})
    assert memory.checkpoint is not None and memory.checkpoint.memory_limit_bytes == 8 << 30
    assert load_spec_data({**SSH, "checkpoint": {"path": "ck", "tier": "memory"}}).checkpoint.memory_limit_bytes is None
    assert load_spec_data(SSH).checkpoint is None


def _env(spec_data: dict, stage: Stage = Stage.JOB) -> list[dict[str, str]]:
    plan = make_plan(PlanContext(load_spec_data(spec_data), "r1"), stage, 25000)
    return [n.env_dict() for n in plan.nodes]


def test_every_node_gets_the_tier_environment():
    data = {**SSH, "checkpoint": {"path": "ck pt", "durable": "/shared/ckpt", "tier": "memory",
                                  "memory_limit": "512M", "keep": 3}}
    for env in _env(data):
        assert {k: env[k] for k in CKPT_ENV} == {
            "DDPLAUNCH_CHECKPOINT_DIR": "/srv/my work/ck pt", "DDPLAUNCH_CHECKPOINT_DURABLE": "/shared/ckpt",
            "DDPLAUNCH_CHECKPOINT_KEEP": "3", "DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT": str(512 << 20)}
    disk, = _env({**SSH, "hosts": SSH["hosts"][:1], "checkpoint": {"path": "/abs/ck", "durable": "dur"}})
    assert (disk["DDPLAUNCH_CHECKPOINT_DIR"], disk["DDPLAUNCH_CHECKPOINT_DURABLE"],
            disk["DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT"]) == ("/abs/ck", "/srv/my work/dur", "0")
    unlimited, = _env({**SSH, "hosts": SSH["hosts"][:1], "checkpoint": {"path": "ck", "tier": "memory"}})
    assert "DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT" not in unlimited  # the tier's own default: no limit
    assert unlimited["DDPLAUNCH_CHECKPOINT_DURABLE"] == "/srv/my work/ck"  # durable defaults to path
    assert not any(k in env for env in _env(SSH) for k in CKPT_ENV)


def test_checkpoint_dir_in_job_args_resume_args_and_up_args():
    spec = load_spec_data({**SSH, "checkpoint": {"path": "ck"},
                           "job": {"script": "train.py", "args": ["--ckpt-dir", "{checkpoint_dir}"],
                                   "resume_args": ["--resume={checkpoint_dir}/latest"]}})
    first = make_plan(PlanContext(spec, "r1"), Stage.JOB, 25000).nodes[0]
    assert first.args[-3:] == ("train.py", "--ckpt-dir", "/srv/my work/ck")
    again = make_plan(PlanContext(spec, "r1"), Stage.JOB, 25000, StageOptions(recovery=1)).nodes[0]
    assert again.args[-1] == "--resume=/srv/my work/ck/latest"
    given = make_plan(PlanContext(spec, "r1", job_args=["{checkpoint_dir}x"]), Stage.JOB, 25000).nodes[0]
    assert given.args[-1] == "/srv/my work/ckx"
    with pytest.raises(PlanError, match=r"\{checkpoint_dir\} names the checkpoint: section's path"):
        make_plan(PlanContext(load_spec_data(SSH), "r1", job_args=["{checkpoint_dir}"]), Stage.JOB, 25000)


def test_dry_run_shows_the_env_a_node_gets_and_the_quoted_dir(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: ck\nbackend: ssh\nhosts: [{addr: 10.9.0.11, name: n1}]\npython: /opt/venv/bin/python\n"
                    "workdir: /srv/my work\ndist_backend: gloo\n"
                    "job: {script: jobs/train.py, args: [--ckpt-dir, '{checkpoint_dir}']}\n"
                    "checkpoint: {path: ck pt, durable: /shared/ckpt, tier: memory, memory_limit: 1G}\n")
    out = CliRunner().invoke(cli, ["up", str(path), "--dry-run", "--run-id", "ck-1"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    env = [line.lstrip("# ") for line in lines if "export DDPLAUNCH_CHECKPOINT" in line]
    assert env == ["export DDPLAUNCH_CHECKPOINT_DIR='/srv/my work/ck pt'",
                   "export DDPLAUNCH_CHECKPOINT_DURABLE=/shared/ckpt", "export DDPLAUNCH_CHECKPOINT_KEEP=2",
                   f"export DDPLAUNCH_CHECKPOINT_MEMORY_LIMIT={1 << 30}"]
    assert any(line.endswith("-- jobs/train.py --ckpt-dir '/srv/my work/ck pt' < /dev/null") for line in lines)


def test_reference_spec_with_the_section_uncommented_loads(tmp_path):
    """cluster.yaml's example section, uncommented, is a valid spec."""
    text = (Path(__file__).resolve().parents[2] / "cluster.yaml").read_text()
    block = text.split("# checkpoint:\n", 1)[1].split("\n# The run's", 1)[0]
    section = "checkpoint:\n" + "\n".join(line[2:].split("#")[0].rstrip() for line in block.splitlines())
    path = tmp_path / "c.yaml"
    path.write_text(section + "\njob: {script: train.py}\n")
    (tmp_path / "train.py").write_text("")
    spec = load_spec(path)
    assert spec.checkpoint is not None and spec.checkpoint.durable == "/shared/ckpt"


# ---------------------------------------------------------------- pre-flight: the durable dir

def _facts(**kw):
    base = {"hostname": "h", "python": "3.11.7", "executable": "/venv/bin/python", "torch": "2.13.0",
            "cuda": None, "nccl": None, "gpus": None, "gpu_procs": [], "leftovers": {},
            "master_ips": ["10.0.0.1"], "route_ip": "10.0.0.2", "route_iface": "eth1", "workdir_ok": True,
            "script_ok": True, "disk_free_gb": 50.0, "port_busy": None, "port_error": None, "time": 1000.0}
    return {**base, **kw}


def test_preflight_fails_where_the_durable_dir_is_missing_or_unwritable():
    spec = load_spec_data({**SSH, "hosts": [{"addr": "10.0.0.1", "name": "a"}, {"addr": "10.0.0.2", "name": "b"},
                                            {"addr": "10.0.0.3", "name": "c"}],
                           "checkpoint": {"path": "ck", "durable": "/shared/ckpt"}})
    raw = {"a": _facts(durable_problem=None), "b": _facts(durable_problem="missing"),
           "c": _facts(durable_problem="not writable (Read-only file system)")}
    report = evaluate(spec, raw, launcher_time=1000.0, port=None)
    assert report.bad_hosts == ["b", "c"]
    assert report.hosts[0].checks["checkpoint"].ok is True
    table = render_table(report)
    assert ("b (10.0.0.2): checkpoint: durable dir /shared/ckpt missing -> fix: create it on every host "
            "(a shared file system), or fix checkpoint.durable") in table
    assert ("c (10.0.0.3): checkpoint: durable dir /shared/ckpt not writable (Read-only file system) -> fix: "
            "make it writable for the run's user, or point checkpoint.durable elsewhere") in table
    # no durable dir named (or no section): nothing probed, no column
    plain = evaluate(load_spec_data(SSH), {"n1": _facts(), "n2": _facts()}, launcher_time=1000.0, port=None)
    assert all("checkpoint" not in h.checks for h in plain.hosts) and "checkpoint" not in render_table(plain)


def test_probe_asks_for_the_durable_dir_only_when_one_is_named():
    def probe_args(data: dict) -> dict:
        spec = load_spec_data(data)
        command, _ = probe_command(spec, spec.hosts[0], "r1", None, 8)
        return json.loads(shlex.split(command)[-1])
    assert probe_args({**SSH, "checkpoint": {"path": "ck", "durable": "dur"}})["durable"] == "/srv/my work/dur"
    assert "durable" not in probe_args({**SSH, "checkpoint": {"path": "ck"}})
    assert "durable" not in probe_args(SSH)


def test_probe_says_why_a_durable_dir_cannot_take_a_save(tmp_path):
    assert durable_problem(str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []  # its trial file is gone
    assert durable_problem(str(tmp_path / "nope")) == "missing"
    (tmp_path / "file").write_text("")
    assert durable_problem(str(tmp_path / "file")) == "not a directory"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        assert (durable_problem(str(locked)) or "").startswith("not writable (")


THREE = {**SSH, "hosts": [{"addr": f"10.9.0.1{i}", "name": f"n{i}"} for i in range(3)]}


def test_a_memory_tier_gives_every_node_its_buddies_around_the_ring():
    spec = load_spec_data({**THREE, "checkpoint": {"path": "ck", "tier": "memory"}})
    plan = make_plan(PlanContext(spec, "r1", environ={"DDPLAUNCH_CHECKPOINT_KEY": "k3y"}), Stage.JOB, 25000)
    envs = [dict(node.env) for node in plan.nodes]
    assert [e["DDPLAUNCH_CHECKPOINT_BUDDIES"] for e in envs] == [
        "n1=10.9.0.11:25001", "n2=10.9.0.12:25001", "n0=10.9.0.10:25001"]
    assert {(e["DDPLAUNCH_CHECKPOINT_PORT"], e["DDPLAUNCH_CHECKPOINT_KEY"]) for e in envs} == {("25001", "k3y")}
    assert "DDPLAUNCH_CHECKPOINT_KEY" in plan.secrets
    two = load_spec_data({**THREE, "checkpoint": {"path": "ck", "tier": "memory", "replicas": 2}})
    assert dict(make_plan(PlanContext(two, "r1"), Stage.JOB, 25000).nodes[2].env)[
        "DDPLAUNCH_CHECKPOINT_BUDDIES"] == "n0=10.9.0.10:25001,n1=10.9.0.11:25001"
    for quiet in ({"path": "ck"}, {"path": "ck", "tier": "memory", "replicas": 0}):  # disk tier, no copies
        plan = make_plan(PlanContext(load_spec_data({**THREE, "checkpoint": quiet}), "r1"), Stage.JOB, 25000)
        assert not any("DDPLAUNCH_CHECKPOINT_BUDDIES" in dict(n.env) for n in plan.nodes)
    check = make_plan(PlanContext(spec, "r1"), Stage.HEALTHCHECK, 25000)  # only the job's agents copy
    assert not any("DDPLAUNCH_CHECKPOINT_BUDDIES" in dict(n.env) for n in check.nodes)


def test_the_dry_run_masks_the_runs_checkpoint_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAUNCH_CHECKPOINT_KEY", "")  # undone after the test, the key the run makes too
    monkeypatch.delenv("DDPLAUNCH_CHECKPOINT_KEY")
    path = tmp_path / "c.yaml"
    path.write_text("name: ck\nbackend: ssh\nhosts: [10.9.0.11, 10.9.0.12]\npython: /opt/venv/bin/python\n"
                    "workdir: /srv/w\ndist_backend: gloo\ncheckpoint: {path: ck, tier: memory}\n")
    out = CliRunner().invoke(cli, ["up", str(path), "--dry-run", "--run-id", "ck-2"])
    assert out.exit_code == 0, out.output
    key = os.environ["DDPLAUNCH_CHECKPOINT_KEY"]  # made once, in this (the supervisor's) process
    assert len(key) == 32 and key not in out.output
    assert out.output.count("export DDPLAUNCH_CHECKPOINT_KEY=<secret>") == 2, out.output
