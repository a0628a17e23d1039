"""`ddplaunch init` and the example jobs: the rendered specs load, the CLI never overwrites by
accident, and the wheel carries everything a first run from an empty directory needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ddplaunch.cli import init_cmd
from ddplaunch.spec.examples import EXAMPLE_PREFIX, example_path, list_examples
from ddplaunch.spec.load import load_spec
from ddplaunch.spec.templates import render_init_spec

ROOT = Path(__file__).resolve().parents[2]

def _write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _leaf_keys(data: object, prefix: str = "") -> set[str]:
    if not isinstance(data, dict):
        return set()
    out = set()
    for key, value in data.items():
        out.add(prefix + key)
        out |= _leaf_keys(value, prefix + key + ".")
    return out


# --------------------------------------------------------------------------- examples


def test_examples_resolve_to_the_shipped_jobs() -> None:
    assert {"toy_ddp.py", "train.py", "mismatch_demo.py"} <= set(list_examples())
    path = example_path(EXAMPLE_PREFIX + "toy_ddp.py")
    assert path is not None and path.is_file()
    assert path.read_bytes() == (ROOT / "jobs" / "toy_ddp.py").read_bytes()
    assert example_path("jobs/toy_ddp.py") is None


@pytest.mark.parametrize("bad", ["example:nope.py", "example:toy_ddp", "example:../jobs/toy_ddp.py",
                                 "example:/etc/passwd", "example:"])
def test_unknown_example_names_the_known_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="example:toy_ddp.py"):
        example_path(bad)


# --------------------------------------------------------------------------- rendering


def test_local_spec_loads(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, render_init_spec("local")))
    assert (spec.backend, [h.addr for h in spec.hosts], spec.nproc_per_node, spec.dist_backend) == \
        ("local", ["localhost"], 2, "gloo")
    assert spec.job.script == "example:toy_ddp.py"


def test_ssh_spec_loads(tmp_path: Path) -> None:
    text = render_init_spec("ssh", ["gpu1", "ubuntu@10.0.0.2", "root@gpu3:2222"])
    spec = load_spec(_write(tmp_path, text))
    assert spec.backend == "ssh"
    assert [(h.addr, h.user, h.port) for h in spec.hosts] == [
        ("gpu1", None, None), ("10.0.0.2", "ubuntu", None), ("gpu3", "root", 2222)]
    assert (spec.ssh.host_key_policy, spec.nproc_per_node) == ("strict", "auto")
    assert spec.job.script == "example:toy_ddp.py"
    assert "known_hosts" in text and "ssh-keyscan" in text


def test_slurm_spec_loads(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, render_init_spec("slurm", nodes=4, partition="gpu", gpus_per_node=8)))
    assert (spec.backend, spec.slurm.nodes, spec.slurm.partition, spec.slurm.time, spec.slurm.gpus_per_node) \
        == ("slurm", 4, "gpu", "00:30:00", 8)
    assert spec.nproc_per_node == "auto"
    assert "hosts" not in spec.model_fields_set  # listed hosts would pin the nodes (--nodelist)
    cpu = load_spec(_write(tmp_path, render_init_spec("slurm"), "cpu.yaml"))
    assert (cpu.slurm.nodes, cpu.slurm.gpus_per_node, cpu.nproc_per_node, cpu.dist_backend) == (2, None, 1, "gloo")
    pinned = load_spec(_write(tmp_path, render_init_spec("slurm", ["gpu01", "gpu02", "gpu03"]), "pinned.yaml"))
    assert ([h.addr for h in pinned.hosts], pinned.slurm.nodes) == (["gpu01", "gpu02", "gpu03"], 3)
    with pytest.raises(ValueError, match="one or the other"):
        render_init_spec("slurm", ["gpu01"], nodes=2)


@pytest.mark.parametrize("kind,hosts", [("local", []), ("ssh", ["a", "b"]), ("slurm", [])])
def test_only_documented_keys_each_explained(kind: str, hosts: list[str]) -> None:
    text = render_init_spec(kind, hosts)
    reference = _leaf_keys(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    assert _leaf_keys(yaml.safe_load(text)) - reference == set()
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith(("#", "- ")):
            assert "#" in line, f"key without a comment: {line!r}"


@pytest.mark.parametrize("kind,hosts,match", [
    ("cloud", [], "unknown kind"),
    ("ssh", [], "at least one host"),
    ("ssh", ["a b"], "user@addr:port"),
    ("ssh", ["a:99999"], "1..65535"),
])
def test_bad_input_is_a_value_error(kind: str, hosts: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_init_spec(kind, hosts)


def test_odd_host_names_are_quoted(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, render_init_spec("ssh", ["yes", "[::1]:2200", "null"])))
    assert [(h.addr, h.port) for h in spec.hosts] == [("yes", None), ("::1", 2200), ("null", None)]


def test_ssh_init_spec_passes_the_workdir_probe(tmp_path: Path) -> None:
    """`init --ssh` in an empty directory, then `check`: the example job is staged, not required in workdir."""
    from ddplaunch.plan.hostprogram import parse_answer
    from ddplaunch.diagnose.preflight import probe_command

    spec = load_spec(_write(tmp_path, render_init_spec("ssh", ["localhost"])))
    command, nonce = probe_command(spec, spec.hosts[0], "init-probe", None, parallel=1)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    answer = parse_answer(out.stdout, nonce)
    assert answer is not None, out.stdout[-2000:] + out.stderr[-2000:]
    assert (answer["workdir_ok"], answer["script_ok"]) == (True, True)


# --------------------------------------------------------------------------- the command


def test_cli_writes_and_refuses_to_overwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.chdir(tmp_path)
    first = runner.invoke(init_cmd, ["--ssh", "gpu1", "--ssh", "gpu2"])
    assert first.exit_code == 0, first.output
    written = Path("cluster.yaml").read_text()
    assert load_spec("cluster.yaml").backend == "ssh"
    again = runner.invoke(init_cmd, [])
    assert again.exit_code == 2
    assert again.stderr.count("\n") == 1 and "--force" in again.stderr
    assert Path("cluster.yaml").read_text() == written
    forced = runner.invoke(init_cmd, ["--slurm", "--force", "--nodes", "3", "--time", "2:00:00",
                                      "--gpus-per-node", "4"])
    assert forced.exit_code == 0, forced.output
    spec = load_spec("cluster.yaml")
    assert (spec.backend, spec.slurm.nodes, spec.slurm.time, spec.slurm.gpus_per_node) == ("slurm", 3, "2:00:00", 4)
    other = runner.invoke(init_cmd, ["--out", "sub.yaml"])
    assert other.exit_code == 0 and yaml.safe_load(Path("sub.yaml").read_text())["backend"] == "local"


@pytest.mark.parametrize("args,match", [
    (["--ssh", "a", "--slurm"], "cannot be combined"),
    (["--nodes", "2"], "add --slurm"),
    (["--slurm", "--time", "soon"], "Slurm's format"),
    (["--ssh", "bad host"], "user@addr:port"),
])
def test_cli_bad_input_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                              match: str) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(init_cmd, args)
    assert result.exit_code == 2 and match in result.stderr
    assert not Path("cluster.yaml").exists()


# --------------------------------------------------------------------------- from the wheel


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheel, target dir): built from a copy of the tree at tmp/src (no build/ or egg-info left in it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "tests"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=120, capture_output=True)
    (wheel,) = (tmp / "dist").glob("ddplaunch-*.whl")
    target = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                   check=True, timeout=120, capture_output=True)
    return wheel, target


def _from_wheel(target: Path, cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(target), DDPLAUNCH_HOME=str(cwd / ".state"))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_wheel_ships_jobs_templates_and_hostside(wheel_install: tuple[Path, Path]) -> None:
    wheel, _ = wheel_install
    src = wheel.parents[1] / "src"  # the tree the wheel was built from
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("ddplaunch/jobs/toy_ddp.py", "ddplaunch/jobs/train.py", "ddplaunch/jobs/mismatch_demo.py",
                   "ddplaunch/hostside/healthcheck.py", "ddplaunch/spec/examples.py", "ddplaunch/spec/templates.py"):
        assert needed in names
    expected = {f"ddplaunch/jobs/{p.name}" for p in (src / "jobs").glob("*.py")}
    expected |= {f"ddplaunch/slurm/{p.name}" for p in (src / "slurm").iterdir() if p.suffix in (".sbatch", ".j2")}
    assert any(n.endswith(".j2") for n in expected), "no sbatch template in slurm/"
    assert expected - names == set()


def test_wheel_holds_every_module_of_the_tree(wheel_install: tuple[Path, Path]) -> None:
    """A package missing from [tool.setuptools] packages in pyproject.toml is missing from the wheel."""
    wheel, _ = wheel_install
    src = wheel.parents[1] / "src"
    modules = {p.relative_to(src).as_posix() for p in (src / "ddplaunch").rglob("*.py")
               if "__pycache__" not in p.parts}
    missing = sorted(modules - set(zipfile.ZipFile(wheel).namelist()))
    assert not missing, (f"not in the wheel: {missing}; add their packages to [tool.setuptools] "
                         "packages in pyproject.toml")


def test_wheel_takes_the_torch_it_finds(wheel_install: tuple[Path, Path]) -> None:
    """The wheel never pins torch: what this environment has (2.13.0 from constraints.txt) meets
    every requirement, so installing it installs nothing else; `pip check` is clean."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    wheel, _ = wheel_install
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(meta).decode().splitlines()
    requires = [Requirement(ln.split(":", 1)[1].strip()) for ln in lines if ln.startswith("Requires-Dist:")]
    runtime = [r for r in requires if r.marker is None]
    (torch,) = [r for r in runtime if r.name == "torch"]
    assert str(torch.specifier) == ">=2.10" and not any(s.operator in ("==", "===", "~=") for s in torch.specifier)
    unmet = [f"{r} (have {version(r.name)})" for r in runtime if not r.specifier.contains(version(r.name))]
    assert unmet == []
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_wheel_resolves_examples_from_the_installed_package(wheel_install: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    _, target = wheel_install
    probe = ("import ddplaunch.spec.examples as e; print(e.__file__); "
             "print(e.example_path('example:toy_ddp.py')); print(','.join(e.list_examples()))")
    out = _from_wheel(target, tmp_path, "-c", probe)
    assert out.returncode == 0, out.stderr
    module, toy, listed = out.stdout.splitlines()
    assert module.startswith(str(target)) and toy == str(target / "ddplaunch" / "jobs" / "toy_ddp.py")
    assert "toy_ddp.py" in listed.split(",")


def test_wheel_init_ssh_validates_in_an_empty_dir(wheel_install: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = wheel_install
    made = _from_wheel(target, tmp_path, "-m", "ddplaunch", "init", "--ssh", "gpu1", "--ssh", "gpu2")
    assert made.returncode == 0, made.stderr
    checked = _from_wheel(target, tmp_path, "-m", "ddplaunch", "validate", "cluster.yaml")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("cluster.yaml: ok (ssh, 2 host(s)")


def test_wheel_init_then_validate_local(wheel_install: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = wheel_install
    made = _from_wheel(target, tmp_path, "-m", "ddplaunch", "init")
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".state") == ["cluster.yaml"]
    checked = _from_wheel(target, tmp_path, "-m", "ddplaunch", "validate", "cluster.yaml")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("cluster.yaml: ok (local, 1 host(s), 2 proc per node)")


def test_wheel_cli_init(wheel_install: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = wheel_install
    made = _from_wheel(target, tmp_path, "-m", "ddplaunch", "init", "--ssh", "gpu1")
    assert made.returncode == 0, made.stderr
    assert yaml.safe_load((tmp_path / "cluster.yaml").read_text())["hosts"] == ["gpu1"]
    again = _from_wheel(target, tmp_path, "-m", "ddplaunch", "init")
    assert again.returncode == 2 and again.stderr.count("\n") == 1


@pytest.mark.slow
def test_wheel_up_local_from_an_empty_dir(wheel_install: tuple[Path, Path], tmp_path: Path) -> None:
    """The whole first contact: init, then up, with nothing but the wheel (health check + toy job)."""
    _, target = wheel_install
    made = _from_wheel(target, tmp_path, "-m", "ddplaunch", "init")
    assert made.returncode == 0, made.stderr
    run = _from_wheel(target, tmp_path, "-m", "ddplaunch", "up", "cluster.yaml", timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "HEALTHCHECK OK world=2" in run.stdout
    assert run.stdout.count("mean_grad=4.0 updated_weight=0.6") == 2
