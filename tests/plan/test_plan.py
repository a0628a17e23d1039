"""The pure plan: per-node torchrun lines, quoting, secrets, ports — checked against reviewed
golden files. Refresh them with `UPDATE_GOLDEN=1 pytest tests/plan/test_plan.py` and review the diff."""

import os
import subprocess
from pathlib import Path

import pytest

from ddplaunch.backends.shell import HEARTBEAT_LOOP, env_text, render_plan, shell_line
from ddplaunch.plan.hostwords import HostPath
from ddplaunch.plan.launch import PORT_RANGE, PlanContext, Stage, derive_port, make_plan
from ddplaunch.plan.stages import UpOptions
from ddplaunch.run.begin import dry_run
from ddplaunch.spec.load import load_spec
from tests.goldens import check_golden
from tests.timing import no_hang

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.fixture(autouse=True)
def _no_ssh_config(tmp_path, monkeypatch):
    """Renderings do not depend on who runs the tests: no ~/.ssh/config, one local user name."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("USER", "LOGNAME"):
        monkeypatch.setenv(name, "alice")


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
    plan = make_plan(PlanContext(ssh_spec, "r1"), Stage.JOB, 25000)
    assert plan.world_size == 6 and plan.master_addr == "10.9.0.11"
    for rank, node in enumerate(plan.nodes):
        t = node.torchrun
        assert (t.node_rank, t.nnodes, t.master_port, t.nproc_per_node) == (rank, 3, 25000, "2")
        # job.max_restarts: 1 is ddplaunch's relaunch of every host together, never torchrun's per node
        assert t.words()[t.words().index("--max-restarts") + 1] == "0"
        # the job runs through the entry script: health check inline, then the script as __main__
        assert node.script.endswith("/entry.py") and node.args[-4:] == ("--", "jobs/train.py", "--epochs", "2")
        argv = node.argv()
        assert argv[argv.index("--node-rank") + 1] == str(rank) and argv[-3:] == ["jobs/train.py", "--epochs", "2"]
        env = dict(node.env)
        assert env["GLOO_SOCKET_IFNAME"] == "eth1" and "PYTHONPATH" not in env
        assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == f"[{node.host_label}:${{rank}}] "


def test_job_args_override(ssh_spec):
    plan = make_plan(PlanContext(ssh_spec, "r1", job_args=["--epochs", "9"]), Stage.JOB, 25000)
    assert plan.nodes[0].argv()[-3:] == ["jobs/train.py", "--epochs", "9"]


def test_env_values_never_on_the_command_line_secrets_never_shown(ssh_spec):
    text = dry_run(ssh_spec, UpOptions(run_id="r"))
    assert "s3cret" not in text and "export WANDB_API_KEY=<secret>" in text
    node = make_plan(PlanContext(ssh_spec, "r"), Stage.JOB, 25000).nodes[0]
    assert "WANDB_API_KEY='s3cret'" in env_text(node) or "WANDB_API_KEY=s3cret" in env_text(node)
    line = shell_line(node)
    assert "s3cret" not in line and "pwned" not in line and "WANDB_API_KEY" not in line


def test_env_file_and_line_round_trip_hostile_values(tmp_path, ssh_spec):
    """bash reads back exactly the spec's values from the env file, and exactly the planned argv
    from the line; nothing in them is executed."""
    node = make_plan(PlanContext(ssh_spec, "r1"), Stage.JOB, 25000).nodes[1]
    env_file = tmp_path / "env"
    env_file.write_text(env_text(node))
    out = subprocess.run(["bash", "-c", f'. {env_file} && printf "%s\\n" "$NOTE"'], capture_output=True,
                         text=True, timeout=10, env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]})
    assert out.stdout == "$(touch $HOME/pwned); echo\n" and not (tmp_path / "pwned").exists()
    line = shell_line(node)
    head, _, tail = line.partition(" && exec ")
    words = subprocess.run(["bash", "-c", "printf '%s\\n' " + tail], capture_output=True, text=True, timeout=10,
                           env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]}).stdout.splitlines()
    want = [word if not isinstance(word, HostPath) else f"{tmp_path}/{word}" for word in node.argv()]
    assert words == want
    env = '"$HOME"/.ddplaunch/runs/r1/job-node1.env'
    assert head.startswith(f"cd '/srv/work dir' && . {env} && rm -f {env} && "
                           f"{HEARTBEAT_LOOP} && source /opt/venv/bin/activate && {{ /opt/venv/bin/python -S "
                           '"$HOME"/.ddplaunch/runs/r1/agent.py --window 20 "$DDPLAUNCH_AGENT" $$ & } && '
                           "(umask 077 && echo $$ >")


def test_ports_are_derived_from_run_id_and_differ_per_stage(ssh_spec):
    a, b = derive_port("run-a:job"), derive_port("run-b:job")
    assert PORT_RANGE[0] <= a < PORT_RANGE[1] and a == derive_port("run-a:job") and a != b
    two = ssh_spec.model_copy(update={"healthcheck": ssh_spec.healthcheck.model_copy(update={"launch": "separate"})})
    text = dry_run(two, UpOptions(run_id="x"))
    ports = {line.split("master ")[1].split()[0] for line in text.splitlines() if line.startswith("# run")}
    assert len(ports) == 2  # the health check launched apart gets a port of its own


def test_render_is_a_function_of_the_inputs(ssh_spec):
    """Two plans built separately from the same inputs render the same text; a changed input shows."""
    first = render_plan([make_plan(PlanContext(ssh_spec, "r"), s, 25000) for s in Stage])
    again = render_plan([make_plan(PlanContext(ssh_spec, "r"), s, 25000) for s in Stage])
    assert first == again
    other = render_plan([make_plan(PlanContext(ssh_spec, "r"), s, 25001) for s in Stage])
    assert other != first and "--master-port 25001" in other


def test_heartbeat_says_the_host_lives_and_ends_with_its_process(tmp_path):
    """Every second a line while the node's process runs; it ends when that process exits, also
    while the parent has not reaped it yet (it waits for the output to end: a zombie is gone)."""
    import time

    ended = tmp_path / "ended"  # the process's own last moment, on the clock every process shares
    child = f"import time; time.sleep(2.2); open({str(ended)!r}, 'w').write(str(time.monotonic()))"
    out = subprocess.run(["bash", "-c", f"{HEARTBEAT_LOOP} && exec python3 -c \"{child}\""],
                         capture_output=True, text=True, timeout=20)
    outlived = time.monotonic() - float(ended.read_text())
    assert out.stdout.splitlines() == ["DDPLAUNCH_ALIVE"] * 3 and out.stderr == ""
    no_hang(outlived, 4.0, "the heartbeat ends within its 1 s tick after its process exits")


MIXED = """\
backend: ssh
hosts:
  - {addr: 10.9.0.11, name: a, nproc: 1}
  - {addr: 10.9.0.12, name: b, nproc: 3}
  - {addr: 10.9.0.13, name: c}
nproc_per_node: 2
python: /opt/venv/bin/python
workdir: /srv
job: {script: jobs/train.py}
"""


def test_a_mixed_fleet_gives_each_host_its_own_process_count(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED)
    plan = make_plan(PlanContext(load_spec(path), "m1"), Stage.JOB, 25000)
    assert [n.torchrun.nproc_per_node for n in plan.nodes] == ["1", "3", "2"]
    assert plan.world_size == 6 and plan.layout() == "3 node(s) with 1+3+2 procs = world 6"
    assert [dict(n.env).get("OMP_NUM_THREADS") for n in plan.nodes] == [None, "3", "2"]
    text = dry_run(load_spec(path), UpOptions(run_id="m1"))
    assert "--nproc-per-node 3" in text and "world 6" in text


def test_hostfile_gives_the_hosts_and_their_slots(tmp_path):
    (tmp_path / "hostfile").write_text("# DeepSpeed style\nworker-1 slots=4\n\nworker-2 slots=1 max_slots=8  # small\n"
                                       "worker-3\n")
    path = tmp_path / "c.yaml"
    path.write_text("backend: ssh\nhosts: {file: hostfile}\nnproc_per_node: 2\nworkdir: /srv\n"
                    "job: {script: jobs/train.py}\n")
    spec = load_spec(path)
    assert [(h.addr, spec.nproc_of(h)) for h in spec.hosts] == [("worker-1", 4), ("worker-2", 1), ("worker-3", 2)]


@pytest.mark.parametrize("content, found", [
    ("worker-1 slots=x\n", "hostfile:1: 'slots=x': a line is `NAME slots=N`"),
    ("ok slots=1\nbad;name slots=2\n", "hostfile:2: 'bad;name' is not a host name or address"),
    ("w slots=0\n", "hostfile:1: w: slots=0; a host runs at least one process"),
    ("# nothing\n\n", "hostfile: no hosts in the file"),
    (None, "hostfile: no such file; pass the path of a hostfile"),
])
def test_a_bad_hostfile_is_one_line_naming_the_spec_key_and_the_file_line(tmp_path, content, found):
    from ddplaunch.errors import SpecError

    if content is not None:
        (tmp_path / "hostfile").write_text(content)
    path = tmp_path / "c.yaml"
    path.write_text("backend: ssh\nworkdir: /srv\nhosts:\n  file: hostfile\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}:4: hosts.file: {tmp_path}/") and found in str(err.value), err.value


CONTAINER_SPEC = """\
name: ctr
backend: ssh
hosts: [{addr: 10.9.0.11, name: n1}, {addr: 10.9.0.12, name: n2}]
nproc_per_node: auto
workdir: /srv/work
env: {WANDB_API_KEY: s3cret}
healthcheck: {enabled: false}
job: {script: /opt/jobs/train.py}
container: {image: IMAGE, runtime: RUNTIME, mounts: [/data:/data:ro]}
"""


@pytest.mark.parametrize("runtime, image", [("docker", "nvcr.io/nvidia/pytorch:24.10-py3"),
                                            ("podman", "localhost/train:1"),
                                            ("apptainer", "/shared/images/pytorch.sif"),
                                            ("enroot", "/shared/images/pytorch.sqsh")])
def test_container_dry_run_golden(tmp_path, runtime, image):
    """Each runtime's command in front of torchrun (renderings only: docker, apptainer and enroot
    do not run here; podman does, in tests/backends/test_containers.py)."""
    path = tmp_path / "c.yaml"
    path.write_text(CONTAINER_SPEC.replace("RUNTIME", runtime).replace("IMAGE", image))
    text = dry_run(load_spec(path), UpOptions(run_id="ctr-1"))
    check_golden(f"container_{runtime}.plan.txt", text)
    assert "s3cret" not in text  # every runtime: the secret's value is never on a line
    # the variable passed by name (apptainer passes the whole environment itself)
    assert runtime == "apptainer" or "--env WANDB_API_KEY" in text.replace("--env=", "--env ")
    for line in (ln for ln in text.splitlines() if ln.startswith("cd ")):
        inside = line.split(f" {image} ", 1)[1]  # the image's interpreter runs torchrun, inside
        assert inside.startswith("python3 -m torch.distributed.run") or runtime == "enroot" and \
            inside.startswith("sh -c 'cd \"$1\" && shift && exec \"$@\"' sh /srv/work python3 -m torch.distributed.run")
        assert subprocess.run(["bash", "-n", "-c", line], capture_output=True, timeout=10).returncode == 0


def test_every_runtime_is_one_row_of_one_table_and_each_per_node_one_renders():
    """spec/values.py RUNTIMES says what each runtime is; the spec accepts exactly those, and
    every runtime that runs a container per node has its command (pyxis is srun's flags)."""
    from ddplaunch.plan.container import _RENDER
    from ddplaunch.spec.model import ContainerSpec
    from ddplaunch.spec.values import PER_NODE_RUNTIMES, RUNTIMES, Runtime

    assert set(RUNTIMES) == set(Runtime) == {ContainerSpec(image="x", runtime=r).runtime for r in Runtime}
    assert set(_RENDER) == set(PER_NODE_RUNTIMES) == {r for r, t in RUNTIMES.items() if not t.in_step}
    assert [r for r, t in RUNTIMES.items() if t.named] == [Runtime.DOCKER, Runtime.PODMAN]

@pytest.mark.parametrize("runtime, pull, problem, fix", [
    ("podman", "missing", "no-runtime", "install podman on the host"),
    ("docker", "never", "no-image", "docker pull img:1 on the host (or load it), or set container.pull: missing"),
    ("apptainer", "missing", "no-image", "put /no/such/img.sif on the host (a shared file system), or use a docker:// image")])
def test_the_image_checks_answer_carries_its_problem_and_the_fix_follows_it(tmp_path, runtime, pull, problem, fix):
    """The image check (plan/container.py) runs in a shell whose PATH holds no runtime or one
    with no image; its answer names the problem as data (`image_problem`), and the pre-flight's
    fix is decided from that value, never from the message's words."""
    from ddplaunch.diagnose.preflight import evaluate, host_facts
    from ddplaunch.plan.container import image_check

    image = "/no/such/img.sif" if runtime == "apptainer" else "img:1"
    path = tmp_path / "c.yaml"
    path.write_text(f"backend: ssh\nhosts: [a]\nworkdir: {tmp_path}\n"
                    f"container: {{image: '{image}', runtime: {runtime}, pull: {pull}}}\n")
    spec = load_spec(path)
    bin_dir = tmp_path / "bin"  # a runtime that has no image (and pulls none), or no runtime at all
    bin_dir.mkdir()
    if problem == "no-image":
        (bin_dir / runtime).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / runtime).chmod(0o755)
    line = image_check(spec.container, "N1", str(tmp_path)) + "; echo past"
    out = subprocess.run(["/bin/bash", "-c", line], capture_output=True, text=True, timeout=10,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin" if problem == "no-image" else str(bin_dir)})
    prefix, answer = out.stdout.strip().split(" ", 1)
    assert prefix == "DDPLAUNCH_ANSWER_N1" and "past" not in out.stdout
    data = __import__("json").loads(answer)
    assert data["image_problem"] == problem
    def judged(facts):
        return evaluate(spec, {"a": host_facts(facts, 0, "", None)}, launcher_time=1000.0, port=None).hosts[0]

    check = judged(data).checks["image"]
    assert check.ok is False and check.seen == data["image_error"] and check.fix == fix
    assert judged(dict(data, image_error="reworded")).checks["image"].fix == fix  # the words decide nothing

