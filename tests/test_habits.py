"""Real clusters' habits on real sim hosts and the Slurm sim: a mixed fleet (hosts with different
process counts) gets the right rank layout, checked by the ranks themselves; a line every rank
prints is on screen once and in the log once per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.ssh_util import ROOT, ddplaunch, ranks_showing, sim_spec
from tests.backends.test_slurm import slurm_spec

#: Every rank reports what torchrun told it and where it runs; rank 0 prints all of it.
LAYOUT_JOB = """\
import json, os, socket
import torch.distributed as dist
dist.init_process_group("gloo")
me = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK")}
me.update(host=socket.gethostname(), world=dist.get_world_size(), rank=dist.get_rank())
every = [None] * dist.get_world_size()
dist.all_gather_object(every, me)
if dist.get_rank() == 0:
    print("LAYOUT " + json.dumps(every), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _layout(text: str) -> list[dict]:
    (line,) = [ln for ln in text.splitlines() if "LAYOUT " in ln]
    return json.loads(line.split("LAYOUT ", 1)[1])


def _check_layout(every: list[dict], hosts: list[str], counts: list[int]) -> None:
    """Ranks contiguous per host in node order, each host its own count, one world."""
    world = sum(counts)
    assert len(every) == world
    rank = 0
    for node, (host, count) in enumerate(zip(hosts, counts)):
        for local in range(count):
            me = every[rank]
            assert (me["host"], me["RANK"], me["rank"], me["LOCAL_RANK"], me["LOCAL_WORLD_SIZE"], me["GROUP_RANK"]) \
                == (host, rank, rank, local, count, node), me
            assert me["WORLD_SIZE"] == me["world"] == world, me
            rank += 1


def test_mixed_fleet_over_ssh_has_the_right_rank_layout(sim_cluster, tmp_path):
    job = tmp_path / "layout.py"
    job.write_text(LAYOUT_JOB)
    data = yaml.safe_load(sim_cluster.spec_path.read_text())
    hosts = data["hosts"][:3]
    for host, n in zip(hosts, (1, 3, 1)):
        host["nproc"] = n
    spec = sim_spec(sim_cluster, tmp_path, hosts=hosts, nproc_per_node=2, workdir=str(tmp_path),
                    healthcheck={"sizes": ["4K"]}, job={"script": "layout.py"})
    dry = ddplaunch(["up", str(spec), "--dry-run"], tmp_path)
    assert "3 node(s) with 1+3+1 procs = world 5" in dry.stdout, dry.stdout
    out = ddplaunch(["up", str(spec), "--run-id", "mixed-ssh"], tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "HEALTHCHECK OK world=5" in out.stdout
    _check_layout(_layout(out.stdout), [h.name for h in sim_cluster.hosts[:3]], [1, 3, 1])


def test_mixed_fleet_on_slurm_has_the_right_rank_layout(slurm_cluster, tmp_path):
    job = tmp_path / "layout.py"
    job.write_text(LAYOUT_JOB)
    names = [h.name for h in slurm_cluster.hosts[:3]]
    spec = slurm_spec(slurm_cluster, tmp_path, script=str(job), nodes=3)
    data = yaml.safe_load(spec.read_text())
    data.update(hosts=[{"addr": n, "nproc": c} for n, c in zip(names, (1, 3, 1))], nproc_per_node=2,
                healthcheck={"sizes": ["4K"]})
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    out = ddplaunch(["up", str(spec), "--run-id", "mixed-slurm"], tmp_path, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "HEALTHCHECK OK world=5" in text
    _check_layout(_layout(text), names, [1, 3, 1])


def test_a_line_every_rank_prints_is_shown_once_and_logged_per_rank(sim_cluster, tmp_path):
    job = tmp_path / "chatty.py"
    # the ranks meet first (a barrier), then print at once, as a job's ranks do after init: on 2
    # cores their start-ups alone are seconds apart, more than the fold window
    job.write_text("import os\nimport torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
                   "print('config: lr=0.1 batch=32', flush=True)\n"
                   "print('I am rank', os.environ['RANK'], flush=True)\ndist.barrier()\ndist.destroy_process_group()\n")
    spec = sim_spec(sim_cluster, tmp_path, nproc_per_node=2, workdir=str(tmp_path),
                    healthcheck={"enabled": False}, job={"script": "chatty.py"})
    out = ddplaunch(["up", str(spec), "--run-id", "fold"], tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    shown = [ln for ln in out.stdout.splitlines() if "config: lr=0.1 batch=32" in ln]
    assert 1 <= len(shown) <= 2, out.stdout  # folded: once, twice if the window cut the ranks in two
    assert ranks_showing(out.stdout, "config: lr=0.1 batch=32") == 6, shown
    logs = ddplaunch(["logs", "fold"], tmp_path).stdout
    assert logs.count("config: lr=0.1 batch=32") == 6, logs
    only3 = ddplaunch(["logs", "fold", "--rank", "3"], tmp_path).stdout.splitlines()
    assert only3 and all(ln.startswith(f"[{sim_cluster.hosts[1].name}:3] ") for ln in only3), only3
    assert f"[{sim_cluster.hosts[1].name}:3] I am rank 3" in only3


def test_readme_run_is_quiet_and_the_python_api_returns_a_report(tmp_path):
    """`ddplaunch.up("cluster.yaml")` from a plain Python process (not pytest's): exit code 0,
    a run id, the health check's payload, and no torchrun banner on its output."""
    import os
    import subprocess
    import sys

    code = ("import ddplaunch, json\n"
            "r = ddplaunch.up('cluster.yaml')\n"
            "print('REPORT', json.dumps({'exit_code': r.exit_code, 'run_id': r.run_id,"
            " 'hc': r.healthcheck.ok if r.healthcheck else None}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"), PYTHONPATH=str(ROOT)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    report = json.loads(out.split("REPORT ", 1)[1].splitlines()[0])
    assert report["exit_code"] == 0 and report["run_id"] and report["hc"] is True, report
    assert "OMP_NUM_THREADS" not in out and "*****" not in out, out
    assert (Path(tmp_path) / "state" / "runs" / report["run_id"] / "record.json").is_file()


pytestmark = pytest.mark.slow
