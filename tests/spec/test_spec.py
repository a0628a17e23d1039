"""The cluster spec: the reference cluster.yaml loads, and every kind of bad input is one clear
line with file:line and key path, exit 2, no traceback."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddplaunch.cli import cli
from ddplaunch.errors import SpecError
from ddplaunch.spec.load import load_spec
from ddplaunch.spec.model import EnvVar, parse_size

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    (tmp_path / "jobs").mkdir(exist_ok=True)
    (tmp_path / "jobs" / "toy_ddp.py").write_text("print('hi')\n")
    return path


def validate(path: Path):
    return CliRunner().invoke(cli, ["validate", str(path)])


def test_reference_cluster_yaml_loads_and_runs_on_localhost():
    spec = load_spec(ROOT / "cluster.yaml")
    assert spec.backend == "local"
    assert [h.addr for h in spec.hosts] == ["localhost"]
    assert spec.nproc_per_node == 2
    assert spec.dist_backend in ("auto", "gloo")
    assert spec.workdir_path == str(ROOT)
    assert (ROOT / spec.job.script).is_file()


def test_host_shorthand_and_defaults(tmp_path):
    spec = load_spec(write(tmp_path, """
        backend: ssh
        hosts: [10.0.0.1, {addr: 10.0.0.2, name: gpu2, user: bob, port: 2222}]
        nproc_per_node: auto
        env: {A: 1, B: x y}
    """))
    assert [h.label for h in spec.hosts] == ["10.0.0.1", "gpu2"]
    assert spec.hosts[1].user == "bob" and spec.hosts[1].port == 2222
    assert spec.nproc_per_node == "auto"
    assert spec.env == {"A": EnvVar(value="1"), "B": EnvVar(value="x y")}
    assert spec.env_values({}) == {"A": "1", "B": "x y"}
    assert spec.ssh.host_key_policy == "strict"


@pytest.mark.parametrize("text, expected", [
    ("backend: local\nnproc_per_node: 2\nhealthchek: {}\n",
     ":3: healthchek: unknown key 'healthchek' (did you mean 'healthcheck'?)"),
    ("healthcheck:\n  iterations: 5\n  timout: 3\n",
     ":3: healthcheck.timout: unknown key 'timout' (did you mean 'timeout'?)"),
    ("nproc_per_node: 0\n", ":1: nproc_per_node: must be a positive integer or 'auto', got 0"),
    ("nproc_per_node: two\n", ":1: nproc_per_node: must be a positive integer or 'auto', got 'two'"),
    ("master:\n  port: 70000\n", ":2: master.port: Input should be less than or equal to 65535, got 70000"),
    ("rdzv_timeout: soon\n", ":1: rdzv_timeout: Input should be a valid integer"),
    ("backend: kubernetes\n", ":1: backend: unknown backend 'kubernetes' (registered: local, ssh, slurm)"),
    ("job:\n  script: jobs/nope.py\n", ":2: job.script: 'jobs/nope.py' not found in workdir"),
    ("hosts: [a, b]\n", ":1: hosts: backend 'local' runs on exactly one host"),
    ("healthcheck:\n  sizes: [4K, lots]\n", ":2: healthcheck.sizes: size 'lots' is not a positive byte count"),
    ("env:\n  1BAD: x\n", ":2: env.1BAD: '1BAD' is not a valid environment variable name"),
    ("env:\n  A: x\n  DEBUG: on\n", ':3: env.DEBUG: on would become true; write DEBUG: "on"'),
    ("slurm:\n  time: 1:30:00\n", ':2: slurm.time: 1:30:00 would become 5400; write time: "1:30:00"'),
    ("name: x\nname: y\n", ":2: name: duplicate key 'name' (first at line 1)"),
    ("backend: ssh\nhosts: [a]\nslurm:\n  partition: gpu\n",
     ":4: slurm.partition: not supported by backend 'ssh' (only used by backend: slurm)"),
    ("backend: ssh\nhosts: [a]\ncontainer: {image: x, runtime: pyxis}\n",
     ":3: container.runtime: backend 'ssh' cannot run 'pyxis' (pyxis is srun's own --container-image); "
     "use one of docker, podman, apptainer, enroot"),
    ("container: {image: x, runtime: lxc}\n",
     ":1: container.runtime: Input should be 'docker', 'podman', 'apptainer', 'enroot' or 'pyxis', got 'lxc'"),
])
def test_bad_input_is_one_clear_line_with_file_line_and_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    result = validate(path)
    assert result.exit_code == 2, result.output
    assert f"ddplaunch: error: {path}{expected}" in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    path = write(tmp_path, "name: x\nhosts: [a, b\nnproc_per_node: 2\n")
    result = validate(path)
    assert result.exit_code == 2
    assert f"{path}:3:15: YAML syntax error" in result.output


def test_missing_file(tmp_path):
    result = validate(tmp_path / "missing.yaml")
    assert result.exit_code == 2
    assert "missing.yaml: no such file" in result.output


def test_several_errors_are_one_line_first_and_a_count(tmp_path):
    path = write(tmp_path, "master: {port: 0}\nnproc_per_node: 0\nrdzv_timeout: 0\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value) == (f"{path}:1: master.port: Input should be greater than or equal to 1, got 0 "
                              "(and 2 more problems)")


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    """The installed entry point itself, not only CliRunner: exit 2, one line on stderr."""
    path = write(tmp_path, "nproc_per_node: 0\n")
    proc = subprocess.run([sys.executable, "-m", "ddplaunch", "validate", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"ddplaunch: error: {path}:1: nproc_per_node: "
                                   "must be a positive integer or 'auto', got 0")
    assert proc.stdout == ""


def test_parse_size():
    assert parse_size("4K") == 4096 and parse_size("1M") == 1 << 20 and parse_size(7) == 7
    assert parse_size("2GiB") == 2 << 30
    with pytest.raises(ValueError):
        parse_size("0")


def test_env_forms_secrets_and_redaction(tmp_path):
    spec = load_spec(write(tmp_path, """
        env:
          PLAIN: "x"
          HF_TOKEN: {from_env: MY_HF_TOKEN}
          DB: {value: "hunter2", secret: true}
          WANDB_API_KEY: abc
    """))
    assert spec.secret_names() == {"HF_TOKEN", "DB", "WANDB_API_KEY"}
    assert spec.env_values({"MY_HF_TOKEN": "hf_123"}) == {
        "PLAIN": "x", "HF_TOKEN": "hf_123", "DB": "hunter2", "WANDB_API_KEY": "abc"}
    assert spec.redacted()["env"] == {"PLAIN": "x", "HF_TOKEN": {"from_env": "MY_HF_TOKEN"},
                                      "DB": "<secret>", "WANDB_API_KEY": "<secret>"}
    with pytest.raises(SpecError, match="^env.HF_TOKEN: from_env MY_HF_TOKEN is not set in the launcher's "
                                        "environment; export it before ddplaunch up$"):
        spec.env_values({})
