"""Runs ddplaunch/hostside/healthcheck.py under real torchruns: pass, bad rank, slow fabric,
every collective's busbw at n=3 and n=4, the in-process host-pair gate on simulated hosts."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun_util sits beside us, whatever the import mode
from torchrun_util import HEALTHCHECK, ROOT, free_port, run_torchrun, stop_torchrun  # noqa: E402

JSON_PREFIX = "DDPLAUNCH_HEALTHCHECK_JSON "


def result_of(output: str) -> dict:
    """Parses the one machine-readable line rank 0 prints."""
    lines = [line for line in output.splitlines() if line.startswith(JSON_PREFIX)]
    assert len(lines) == 1, output
    return json.loads(lines[0][len(JSON_PREFIX):])


def test_healthcheck_passes_on_two_ranks(tmp_path):
    json_path = tmp_path / "out" / "hc.json"
    run = run_torchrun(HEALTHCHECK, "--sizes", "4K,1M", "--iters", "3", "--json", json_path, timeout=90)
    assert run.returncode == 0, run.stdout
    assert "HEALTHCHECK OK world=2 backend=gloo" in run.stdout
    result = result_of(run.stdout)
    assert result["ok"] is True and result["failures"] == []
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert [facts["rank"] for facts in result["ranks"]] == [0, 1]
    assert {"host", "ip", "device", "torch", "pid", "local_rank"} <= set(result["ranks"][0])
    assert [row["bytes"] for row in result["bandwidth"]] == [4096, 1 << 20]
    n = result["world_size"]
    for row in result["bandwidth"]:
        assert row["count"] * 4 == row["bytes"] and row["iters"] == 3 and row["time_us"] > 0
        assert row["busbw_gbps"] == row["algbw_gbps"] * 2 * (n - 1) / n  # nccl-tests' definition
    assert json.loads(json_path.read_text()) == result  # the file is the same result
    assert not list(json_path.parent.glob(".healthcheck.*"))  # no temp file left behind


def test_healthcheck_names_the_rank_with_a_wrong_all_reduce():
    run = run_torchrun(HEALTHCHECK, "--sizes", "4K", env={"DDPLAUNCH_HC_FAULT_RANK": "1"}, timeout=90)
    assert run.returncode != 0, run.stdout
    assert "HEALTHCHECK FAIL: rank 1 (host " in run.stdout
    assert "all_reduce result wrong" in run.stdout
    result = result_of(run.stdout)
    assert result["ok"] is False
    # the hook corrupts rank 1's copies: its all_reduce result and the broadcast it received
    assert [(f["rank"], f["check"]) for f in result["failures"]] == [(1, "all_reduce"), (1, "broadcast")]


def test_healthcheck_fails_below_the_bandwidth_gate():
    run = run_torchrun(HEALTHCHECK, "--sizes", "1M", "--iters", "2", "--min-busbw-gbps", "1e6",
                       timeout=90)
    assert run.returncode != 0, run.stdout
    assert "HEALTHCHECK FAIL: all_reduce busbw " in run.stdout
    assert " GB/s at 1 MiB is below healthcheck.min_busbw_gbps 1e+06" in run.stdout  # the spec key
    result = result_of(run.stdout)
    assert result["min_busbw_gbps"] == 1e6
    assert [f["check"] for f in result["failures"]] == ["bandwidth"]


def test_healthcheck_names_a_rank_that_misses_the_barrier():
    run = run_torchrun(HEALTHCHECK, "--sizes", "4K", "--timeout", "3",
                       env={"DDPLAUNCH_HC_STALL_RANK": "1"}, timeout=90)
    assert run.returncode != 0, run.stdout
    assert "HEALTHCHECK FAIL: rank 1 (host " in run.stdout
    assert "did not reach the monitored barrier within 3s (healthcheck.timeout)" in run.stdout


ALL = "all_reduce,all_gather,reduce_scatter"
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,  # nccl-tests' busbw / algbw
          "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}


@pytest.mark.parametrize("world", [3, 4])
def test_busbw_follows_nccl_tests_for_every_collective(world):
    run = run_torchrun(HEALTHCHECK, "--sizes", "4K,1M", "--iters", "2", "--collectives", ALL,
                       nproc=world, timeout=180)
    assert run.returncode == 0, run.stdout
    result = result_of(run.stdout)
    assert result["ok"] is True and result["failures"] == [] and result["unsupported"] == {}
    assert result["collectives"] == ALL.split(",")
    assert [(r["collective"], r["bytes"]) for r in result["bandwidth"]] == [
        (c, b) for c in ALL.split(",") for b in (
            (4096, 1 << 20) if c == "all_reduce" else
            # the whole buffer (all_gather's output, reduce_scatter's input): count divisible by n
            (1024 // world * world * 4, (1 << 18) // world * world * 4))]
    for row in result["bandwidth"]:
        assert row["count"] * 4 == row["bytes"] and row["iters"] == 2
        if row["collective"] != "all_reduce":
            assert row["count"] % world == 0  # every rank's share is whole
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * FACTOR[row["collective"]](world),
                                                  rel=1e-12)
    for collective in ALL.split(","):  # one table row per collective and size
        assert sum(line.startswith(collective + " ") for line in run.stdout.splitlines()) == 2


def test_fault_hook_names_the_rank_for_every_collective():
    run = run_torchrun(HEALTHCHECK, "--sizes", "4K", "--collectives", ALL, nproc=3,
                       env={"DDPLAUNCH_HC_FAULT_RANK": "2"}, timeout=180)
    assert run.returncode != 0, run.stdout
    result = result_of(run.stdout)
    assert [(f["rank"], f["check"]) for f in result["failures"]] == [
        (2, "all_reduce"), (2, "all_gather"), (2, "reduce_scatter"), (2, "broadcast")]
    assert "all_gather result wrong" in run.stdout and "reduce_scatter result wrong" in run.stdout
    assert "broadcast from rank 0 wrong: got 14.0 expected 7.0 at index 0" in run.stdout
    assert result["bandwidth"] == []  # no sweep over a wrong fabric


def test_unsupported_collective_is_reported_not_faked(tmp_path):
    """A backend without reduce_scatter (simulated by its error) gets a marked row, no numbers;
    started without an agent, rank 0 hosts the store and the process stays clean for the job."""
    code = textwrap.dedent(f"""
        import importlib.util, os, torch, torch.distributed as dist
        spec = importlib.util.spec_from_file_location("hc", {str(HEALTHCHECK)!r})
        hc = importlib.util.module_from_spec(spec); spec.loader.exec_module(hc)
        def missing(*args, **kwargs):
            raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")
        hc._collectives._reduce_scatter = missing
        rc = hc.run(["--sizes", "4K", "--iters", "1", "--collectives", "{ALL}"])
        assert not dist.is_initialized()
        dist.init_process_group("gloo")  # the job's own group, env://, on the same port
        t = torch.ones(1); dist.all_reduce(t); dist.destroy_process_group()
        print("RC", rc, "JOB", t.item(), flush=True)
    """)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RC 0 JOB 1.0" in run.stdout
    result = result_of(run.stdout)
    assert result["unsupported"] == {"reduce_scatter": "ProcessGroupGloo does not support reduce_scatter"}
    assert {r["collective"] for r in result["bandwidth"]} == {"all_reduce", "all_gather"}
    assert any(line.startswith("reduce_scatter") and "unsupported" in line for line in run.stdout.splitlines())


def run_hosts(n_hosts: int, *args, env=None, timeout: float = 240) -> list:
    """Runs the health check on ``n_hosts`` simulated hosts: one single-rank torchrun "node" each,
    DDPLAUNCH_HOST=h0..h{n-1}; returns the CompletedProcess of every node, node 0 first."""
    port = free_port()
    procs = []
    for node in range(n_hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n_hosts),
                "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(port), str(HEALTHCHECK), *map(str, args)]
        node_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        DDPLAUNCH_HOST=f"h{node}", **(env or {}))
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=node_env, cwd=ROOT, start_new_session=True))
    done = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_torchrun(proc)
    return done


PAIR_KEYS = {"singles", "pairs", "repairs", "median_busbw_gbps", "bad_hosts", "reasons"}


def test_pair_gate_names_the_slow_host():
    nodes = run_hosts(4, "--sizes", "1M", "--iters", "1", "--pairwise", "--pair-size", "4M",
                      "--pair-parallelism", "0", "--min-busbw-fraction", "0.2",
                      env={"DDPLAUNCH_HC_SLOW_HOST": "h2"})
    out = nodes[0].stdout
    assert all(node.returncode != 0 for node in nodes), out
    result = result_of(out)
    pairs = result["pairs"]
    assert set(pairs) == PAIR_KEYS and pairs["singles"] == []  # localize.Localization.to_dict()
    assert [p["hosts"] for p in pairs["pairs"]] == [["h0", "h1"], ["h2", "h3"]]
    assert [p["ok"] for p in pairs["pairs"]] == [True, False]
    assert [p["hosts"] for p in pairs["repairs"]] == [["h2", "h0"], ["h3", "h1"]]
    assert [p["ok"] for p in pairs["repairs"]] == [False, True]
    assert pairs["bad_hosts"] == ["h2"] and set(pairs["reasons"]) == {"h2"}
    assert "below healthcheck.min_busbw_fraction 0.2" in pairs["reasons"]["h2"]
    for probe in pairs["pairs"] + pairs["repairs"]:
        assert set(probe) == {"hosts", "ok", "busbw_gbps", "detail"} and probe["busbw_gbps"] > 0
    assert [(f["rank"], f["host"], f["check"]) for f in result["failures"]] == [(2, "h2", "pair")]
    assert "HEALTHCHECK FAIL: rank 2 (host h2): host h2 is bad: slow with known-good host h0" in out
    assert "re-pair h2 + h0" in out


def test_pair_gate_passes_healthy_hosts_with_an_odd_one_out():
    nodes = run_hosts(3, "--sizes", "1M", "--iters", "1", "--pairwise", "--pair-size", "4M",
                      "--pair-parallelism", "1", "--min-busbw-fraction", "0.2")
    out = nodes[0].stdout
    assert [node.returncode for node in nodes] == [0, 0, 0], out
    assert "HEALTHCHECK OK world=3 backend=gloo" in out
    pairs = result_of(out)["pairs"]
    assert [p["hosts"] for p in pairs["pairs"]] == [["h0", "h1"], ["h2", "h0"]]  # odd one with the first
    assert all(p["ok"] for p in pairs["pairs"]) and pairs["repairs"] == []
    assert pairs["bad_hosts"] == [] and pairs["median_busbw_gbps"] > 0
