"""`up --dry-run` (and `check --dry-run`, `up --detach --dry-run`) through the command line, byte
for byte against reviewed goldens (tests/golden/dryrun/): the default spec, the specs `sim up`
writes for SSH and Slurm, the specs `init` writes, and the specs the tests use (containers, a
mixed fleet, spares, a separate health check). They were made before the package was laid out by
stage, so a refactor that changes what executes fails here; a change meant to alter what executes
refreshes them on purpose (UPDATE_GOLDEN=1) and its diff is read in review — the node agent
(hostside/agent.py, issue #40) added its upload and its start to every stage's command."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddplaunch.cli import cli
from ddplaunch.sim.slurm import SlurmState
from ddplaunch.sim.specs import render_slurm_spec, render_spec
from ddplaunch.sim.state import SimCluster, SimHost
from tests.goldens import GOLDEN, ROOT, check_golden

#: The sim's specs' workdir: a path of its own (a detached run's dry run says how many bytes the run
#: handed to its supervisor takes, the workdir among them: the checkout's path would vary it).
WORKDIR = Path("/srv/work")
#: Where the fresh run id of a `check` is made.
NEW_RUN_ID = "ddplaunch.run.begin.new_run_id"

SSH_HOSTS = """name: golden
backend: ssh
hosts: [{addr: 10.9.0.11, name: n1}, {addr: 10.9.0.12, name: n2}, {addr: 10.9.0.13, name: n3}]
nproc_per_node: 2
python: /opt/venv/bin/python
workdir: /srv/work
dist_backend: gloo
"""

SPECS = {
    "mixed": SSH_HOSTS.replace("{addr: 10.9.0.13, name: n3}", "{addr: 10.9.0.13, name: n3, nproc: 1}")
    + "job: {script: jobs/train.py, args: [--epochs, '2'], max_restarts: 1}\n",
    "spares": SSH_HOSTS + "recovery: {max_host_failures: 1, spares: [10.9.0.14]}\n"
    + "job: {script: jobs/train.py, resume_args: [--resume], hang_timeout: 30}\n",
    "separate": SSH_HOSTS + "healthcheck: {launch: separate, pairwise: true, collectives: [all_reduce, all_gather]}\n"
    + "job: {script: jobs/fsdp_train.py}\n",
    "secrets": SSH_HOSTS + "env:\n  WANDB_API_KEY: {from_env: GOLDEN_KEY, secret: true}\n  NOTE: \"$(touch x); echo\"\n"
    + "setup: ['source /opt/venv/bin/activate']\njob: {script: jobs/toy_ddp.py}\n",
    "podman": SSH_HOSTS + "container: {image: localhost/train:1, runtime: podman, mounts: [/data:/data:ro]}\n"
    + "job: {script: /opt/jobs/train.py}\n",
    "slurm": "name: golden-slurm\nbackend: slurm\nnproc_per_node: 2\npython: /opt/venv/bin/python\n"
    + "workdir: /srv/work\ndist_backend: gloo\nslurm: {nodes: 2, partition: debug, time: '00:10:00'}\n"
    + "recovery: {max_host_failures: 1, spares: 1}\njob: {script: jobs/train.py}\n",
}


def _sim_cluster(tmp: Path) -> SimCluster:
    hosts = [SimHost(i, f"dgo{i}", f"10.213.99.{10 + i}", f"dgo-ns{i}") for i in range(1, 4)]
    slurm = SlurmState(conf=tmp / "slurm.conf", spec_path=tmp / "cluster-slurm.yaml", controller_ns="dgo-ctl",
                       controller_name="dgoctl", controller_addr="10.213.99.2")
    return SimCluster(prefix="dgo", subnet="10.213.99.0/24", state_dir=tmp, hosts=hosts, bridge="dgo-br",
                      ifname="eth1", key=tmp / "id_ed25519", known_hosts=tmp / "known_hosts",
                      spec_path=tmp / "cluster.yaml", hosts_file=tmp / "hosts", resolv_conf=tmp / "resolv.conf",
                      slurm=slurm)


def _specs(tmp: Path) -> dict[str, Path]:
    paths = {"default": ROOT / "cluster.yaml"}
    cluster = _sim_cluster(tmp)
    texts = dict(SPECS)
    texts["sim-ssh"] = render_spec(cluster, python="/opt/venv/bin/python", workdir=WORKDIR)
    texts["sim-slurm"] = render_slurm_spec(cluster, python="/opt/venv/bin/python", workdir=WORKDIR)
    for name, text in texts.items():
        paths[name] = tmp / f"{name}.yaml"
        paths[name].write_text(text)
    for name, args in (("init-ssh", ["--ssh", "gpu1", "--ssh", "gpu2"]), ("init-slurm", ["--slurm"])):
        paths[name] = tmp / f"{name}.yaml"
        result = CliRunner().invoke(cli, ["init", *args, "--out", str(paths[name])])
        assert result.exit_code == 0, result.output
    return paths


#: (golden name, spec, extra command-line words); every run id fixed, so every port is too.
CASES = [("default", "default", []), ("default-check", "default", ["check"]),
         ("default-skip", "default", ["--skip-healthcheck", "--", "--epochs", "3"]),
         ("sim-ssh", "sim-ssh", []), ("sim-ssh-check", "sim-ssh", ["check"]),
         ("sim-slurm", "sim-slurm", []), ("sim-slurm-detach", "sim-slurm", ["--detach"]),
         ("init-ssh", "init-ssh", []), ("init-slurm", "init-slurm", []),
         ("mixed", "mixed", []), ("spares", "spares", []), ("separate", "separate", []),
         ("secrets", "secrets", []), ("podman", "podman", []), ("slurm", "slurm", []),
         ("slurm-detach", "slurm", ["--detach"]), ("exclude", "sim-ssh", ["--exclude", "dgo2"]),
         ("emulate", "sim-ssh", ["--emulate", "8", "--emulate-step-s", "0.5", "--emulate-slow", "13:2.5@100",
                                 "--emulate-freeze", "20@300"]),
         ("emulate-slurm", "sim-slurm", ["--emulate", "4", "--emulate-exit", "5:3@50"])]


@pytest.fixture
def _env(monkeypatch):
    # a directory whose name has a fixed length: a detached run's dry run says how many bytes the
    # run handed to its supervisor takes, and the spec's path is part of it
    tmp_path = Path(tempfile.mkdtemp(prefix="ddp-golden-"))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DDPLAUNCH_HOME", str(home / ".ddplaunch"))
    monkeypatch.setenv("GOLDEN_KEY", "k3y-value")
    for name in ("USER", "LOGNAME"):
        monkeypatch.setenv(name, "alice")
    for name in [n for n in list(__import__("os").environ) if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(ROOT)
    # `check` takes no --run-id: its fresh id (and the port derived from it) made fixed
    monkeypatch.setattr(NEW_RUN_ID, lambda name: f"{name}-golden-check")
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def dry_run_text(tmp: Path, spec: Path, extra: list[str], run_id: str) -> str:
    command = "check" if extra[:1] == ["check"] else "up"
    words = extra[1:] if command == "check" else extra
    tail = words[words.index("--"):] if "--" in words else []
    flags = words[:len(words) - len(tail)]
    args = [command, str(spec), "--dry-run", *flags, *(["--run-id", run_id] if command == "up" else []), *tail]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    text = result.output.replace(str(tmp), "<TMP>").replace(sys.executable, "<PYTHON>")
    return text


@pytest.mark.parametrize("name, spec, extra", CASES, ids=[c[0] for c in CASES])
def test_dry_run_is_what_it_was_before_the_move(_env, name, spec, extra):
    text = dry_run_text(_env, _specs(_env)[spec], extra, f"golden-{name}")
    check_golden(f"dryrun/{name}.txt", text)


def test_every_golden_has_its_case():
    """A golden left over from a case that no longer runs would pass nothing."""
    names = {p.stem for p in (GOLDEN / "dryrun").glob("*.txt")}
    assert names == {c[0] for c in CASES}
