"""Every value a spec can put into a rendered command arrives byte for byte, and nothing in it runs:
the shell line of the local/ssh backends and the body of the Slurm step are run under bash with a
stub interpreter that reports what it received; a canary file must never appear."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddplaunch.backends.shell import env_text, shell_line
from ddplaunch.backends.slurm.render import step_request
from ddplaunch.plan.launch import PlanContext, Stage, make_plan
from ddplaunch.spec.model import ClusterSpec

CANARY = "/tmp/ddplaunch-injection-canary"
HOSTILE = st.sampled_from([
    "$(touch {c})", "`touch {c}`", "'; touch {c}; '", '"; touch {c}; "', "a b\tc", "x\ntouch {c}",
    "$HOME", "${{IFS}}", "\\", "-", "--", "*", "~", "!!", "a;b|c&d", "%s %n", "{c}<>|&",
])
TEXT = st.one_of(HOSTILE.map(lambda s: s.format(c=CANARY)),
                 st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=20))


def stub_python(tmp: Path) -> Path:
    """An 'interpreter' that writes its argv and the spec's env values as JSON, then exits: to
    STUB_OUT when it runs torchrun (`-m`), to STUB_OUT.agent when it runs the node's agent (`-S
    agent.py`)."""
    stub = tmp / "py stub"
    stub.write_text("#!/bin/bash\n/usr/bin/env python3 -c 'import json,os,sys; "
                    "agent = sys.argv[1] == \"-S\" and sys.argv[2].endswith(\"agent.py\"); "
                    "out = os.environ[\"STUB_OUT\"] + (\".agent\" if agent else \"\"); "
                    "json.dump({\"argv\": sys.argv[1:], \"env\": dict(os.environ)}, open(out + \".tmp\", \"w\")); "
                    "os.replace(out + \".tmp\", out)' \"$@\"\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return stub


def build(tmp: Path, arg: str, env_value: str, workdir_name: str) -> ClusterSpec:
    workdir = tmp / workdir_name
    workdir.mkdir(exist_ok=True)
    return ClusterSpec.model_validate({
        "backend": "ssh", "hosts": ["h1", "h2"], "python": str(stub_python(tmp)), "workdir": str(workdir),
        "job": {"script": "job.py", "args": [arg, "--x", arg]}, "env": {"NOTE": env_value}})


def run_bash(script: str, home: Path, extra: dict) -> subprocess.CompletedProcess:
    """Run `script` until its process exits; its output goes to files, not pipes: the node's
    heartbeat (a background loop holding stdout for up to a second after the exec'd program
    ended) is no part of what this test waits for."""
    with open(home / "stdout", "w+") as out, open(home / "stderr", "w+") as err:
        proc = subprocess.run(["bash", "-c", script], stdout=out, stderr=err, text=True, timeout=20,
                              env={"HOME": str(home), "PATH": os.environ["PATH"], **extra})
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(arg=TEXT, env_value=TEXT, workdir_name=st.sampled_from(["w d", "w$(x)", "w'q", "plain"]))
def test_values_round_trip_through_every_renderer(tmp_path_factory, arg, env_value, workdir_name):
    tmp = tmp_path_factory.mktemp("inj")
    spec = build(tmp, arg, env_value, workdir_name)
    plan = make_plan(PlanContext(spec, "r1", environ={}), Stage.JOB, 25000)
    node = plan.nodes[1]
    run_dir = tmp / ".ddplaunch" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "job-node1.env").write_text(env_text(node))
    out = tmp / "out.json"
    # local and ssh: the one shell line the backend runs
    shell = run_bash(shell_line(node), tmp, {"STUB_OUT": str(out)})
    assert shell.returncode == 0, shell.stderr
    got = json.loads(out.read_text())
    assert got["argv"][-4:] == ["job.py", arg, "--x", arg] or got["argv"][-3:] == [arg, "--x", arg]
    assert got["env"]["NOTE"] == env_value
    _agent_started(out, "r1.job.h2")
    # slurm: the step's body (per-node values from the step), its env from srun's environment
    out.unlink()
    step = step_request(plan, "7")
    env = {k: v for k, v in step.env}
    body = run_bash(step.argv[-1], tmp, {"STUB_OUT": str(out), "SLURM_NODEID": "1", "SLURMD_NODENAME": "h2",
                                         **env})
    assert body.returncode == 0, body.stderr
    got = json.loads(out.read_text())
    assert got["argv"][-3:] == [arg, "--x", arg] and got["env"]["NOTE"] == env_value
    assert "--node-rank" in got["argv"] and got["argv"][got["argv"].index("--node-rank") + 1] == "1"
    _agent_started(out, "r1.job.h2")
    assert not Path(CANARY).exists()


def _agent_started(out: Path, name: str) -> None:
    """The node's agent ran (in the background, so its report may come after the job's) with its
    name, and the pid of the shell that became torchrun."""
    agent = Path(f"{out}.agent")
    deadline = time.monotonic() + 20
    while not agent.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    got = json.loads(agent.read_text())["argv"]
    assert got[0] == "-S" and got[1].endswith("/r1/agent.py") and got[2:5] == ["--window", "20", name] \
        and got[5].isdigit(), got
    agent.unlink()
