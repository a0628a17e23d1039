"""A run handed to a supervisor in another process (handoff.py, remote.py's receiving side):
`ddplaunch supervise --stdin --daemon` takes the run from its stdin, sets the launcher's
`from_env` values in its own environment, forks the supervisor and answers with one nonce-marked
line once it has taken the run, which `attach` then follows to its end; and the errors a
supervisor host that cannot take a run is named with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddplaunch.errors import BackendError, PlanError
from ddplaunch.plan.handoff import SUPERVISE_ENV, decode_run, encode_run
from ddplaunch.plan.stages import UpOptions
from ddplaunch.spec.load import load_spec
from ddplaunch.supervise.remote import ANSWER, _refused

from tests.ssh_util import ROOT

SPEC = """\
name: t
workdir: {root}
nproc_per_node: 2
healthcheck: {{enabled: false}}
env: {{DDPL_SECRET: {{from_env: DDPL_LAUNCHERS_SECRET}}}}
job: {{script: jobs/toy_ddp.py}}
"""


def test_the_launchers_from_env_values_travel_with_the_run(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC.format(root=ROOT))
    spec = load_spec(tmp_path / "c.yaml")
    encoded = encode_run(spec, "c.yaml", UpOptions(run_id="r"), {"DDPL_LAUNCHERS_SECRET": "s3"})
    run = decode_run({SUPERVISE_ENV: encoded})
    assert run.environ == {"DDPL_LAUNCHERS_SECRET": "s3"} and run.opts == UpOptions(run_id="r")
    assert "s3" not in json.dumps(spec.redacted())


def test_supervise_daemon_takes_the_run_from_stdin_and_attach_follows_it(tmp_path):
    spec_path = tmp_path / "c.yaml"
    spec_path.write_text(SPEC.format(root=ROOT))
    spec = load_spec(spec_path)
    line = encode_run(spec, str(spec_path), UpOptions(run_id="hand-1"),
                      {"DDPL_LAUNCHERS_SECRET": "handed-s3cret"})
    env = {k: v for k, v in os.environ.items() if k not in ("DDPL_LAUNCHERS_SECRET", SUPERVISE_ENV)}
    env["DDPLAUNCH_HOME"] = str(tmp_path / "state")
    took = subprocess.run([sys.executable, "-m", "ddplaunch", "supervise", "--stdin", "--daemon", "--nonce", "n1"],
                          input=line + "\n", capture_output=True, text=True, env=env, cwd="/", timeout=120)
    assert took.returncode == 0, took.stdout + took.stderr
    (answer,) = [json.loads(x.split(" ", 1)[1]) for x in took.stdout.splitlines() if x.startswith(f"{ANSWER}_n1 ")]
    assert answer["run_id"] == "hand-1" and answer["pid"] > 0
    attached = subprocess.run([sys.executable, "-m", "ddplaunch", "attach", "hand-1"], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr
    assert "rank=1 mean_grad=" in attached.stdout
    for path in (tmp_path / "state").rglob("*"):  # the secret reached the run, not its files
        assert not path.is_file() or "handed-s3cret" not in path.read_text(errors="replace"), path


class _Host:
    label, python = "head1", "/opt/py/bin/python"


@pytest.mark.parametrize("code,out,cls,words", [
    (1, "Traceback ...\nModuleNotFoundError: No module named 'ddplaunch'\n", BackendError,
     "supervisor.host head1: /opt/py/bin/python cannot run ddplaunch there (ModuleNotFoundError"),
    (127, "bash: /opt/py/bin/python: No such file or directory\n", BackendError, "cannot run ddplaunch there"),
    (2, "ddplaunch: error: --run-id r: a run with this id exists\n", PlanError, "on head1: --run-id r: a run with"),
    (1, "some rc file noise\n", BackendError, "the supervisor did not take the run (exit 1): some rc file noise"),
])
def test_a_host_that_does_not_take_the_run_is_named(code, out, cls, words):
    err = _refused(_Host(), code, out)  # type: ignore[arg-type]
    assert type(err) is cls and words in str(err), str(err)
    if "cannot run" in words:
        assert "; install ddplaunch for /opt/py/bin/python on head1" in str(err)
