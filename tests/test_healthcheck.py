"""Runs ddplaunch/healthcheck.py under a real 2-rank torchrun: pass, bad rank, slow fabric."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # torchrun_util sits beside us, whatever the import mode
from torchrun_util import HEALTHCHECK, run_torchrun  # noqa: E402

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
    assert [(f["rank"], f["check"]) for f in result["failures"]] == [(1, "all_reduce")]


def test_healthcheck_fails_below_the_bandwidth_gate():
    run = run_torchrun(HEALTHCHECK, "--sizes", "1M", "--iters", "2", "--min-busbw-gbps", "1e6",
                       timeout=90)
    assert run.returncode != 0, run.stdout
    assert "HEALTHCHECK FAIL: busbw " in run.stdout
    assert "below --min-busbw-gbps 1000000.0" in run.stdout
    result = result_of(run.stdout)
    assert result["min_busbw_gbps"] == 1e6
    assert [f["check"] for f in result["failures"]] == ["bandwidth"]


def test_healthcheck_names_a_rank_that_misses_the_barrier():
    run = run_torchrun(HEALTHCHECK, "--sizes", "4K", "--timeout", "3",
                       env={"DDPLAUNCH_HC_STALL_RANK": "1"}, timeout=90)
    assert run.returncode != 0, run.stdout
    assert "HEALTHCHECK FAIL: rank 1 (host " in run.stdout
    assert "did not reach the monitored barrier within 3s" in run.stdout
