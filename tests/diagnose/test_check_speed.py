"""`ddplaunch check` on 4 sim hosts with the pair gate: a healthy cluster passes the pre-flight
and the health check, and a host whose link is rate-limited to 200 Mbit/s is named by the
localization (its reason, the health check gate's stop, the localization page), leaving no
process behind; each `--json` summary valid against docs/check-schema.json.

The spec is the sim's own (the default health check: all_reduce 4K..8M, pair tests of 16M
between every disjoint host pair, suspects re-paired with known-good hosts, all inside the one
launch's processes). How fast (the promise: healthy in under 10 s, the slow host named in under
15 s on a quiet 2-core machine) is `bench/dead_host.py --healthcheck sim --faults healthy,slow`,
figures in docs/benchmarks.md; here the times only guard a hang (3x what a loaded machine took:
17.5 s healthy while the rest of the suite ran beside it).
"""

from __future__ import annotations

import json
import time

import jsonschema

from ddplaunch.sim.faults import sim_fault
from tests.ssh_util import ddplaunch, run_processes, sim_spec
from tests.diagnose.test_preflight import SCHEMA
from tests.timing import no_hang

HEALTHY_S = 60.0
SLOW_NAMED_S = 60.0


def _check(cluster, tmp_path):
    # load can halve a healthy pair's busbw: a 0.3x threshold keeps a healthy host off the list,
    # and the 200 Mbit/s host measures under 0.1x the median (see test_fault_matrix's pair-gate test)
    spec = sim_spec(cluster, tmp_path, n_hosts=4, nproc_per_node=1, healthcheck={"min_busbw_fraction": 0.3})
    t0 = time.monotonic()
    proc = ddplaunch(["check", str(spec), "--json"], tmp_path, timeout=120)
    took = time.monotonic() - t0
    summary = json.loads(proc.stdout)
    jsonschema.validate(summary, SCHEMA)
    return proc, summary, took


def test_healthy_check_with_pair_gate_and_a_slow_host_named(sim_cluster, tmp_path):
    proc, summary, healthy = _check(sim_cluster, tmp_path)
    ok_run = summary["run_id"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["preflight"]["ok"], summary["preflight"]
    assert summary["preflight"]["socket_ifname"] is None  # the sim spec sets socket_ifname itself
    hc = summary["healthcheck"]
    assert hc["ok"] and hc["world_size"] == 4, hc
    assert len(hc.get("pairs") or []) >= 2, hc  # the pair gate ran: two disjoint pairs at least
    no_hang(summary["preflight"]["elapsed_s"], 10, "the pre-flight of 4 healthy hosts waits out no timeout")

    slow = sim_cluster.hosts[2]
    sim_fault(sim_cluster, slow.name, rate="200mbit")
    try:
        proc, summary, named = _check(sim_cluster, tmp_path)
    finally:
        sim_fault(sim_cluster, slow.name, clear=True)
    assert proc.returncode == 1 and summary["blocked"] == "health check", proc.stderr[-3000:]
    loc = summary["localization"]
    assert loc["bad_hosts"] == [slow.name], json.dumps(loc, indent=1)
    assert "slow with known-good host" in loc["reasons"][slow.name]
    assert "<svg" in (tmp_path / "state" / "runs" / summary["run_id"] / "localize.html").read_text()
    assert run_processes(ok_run) == {} and run_processes(summary["run_id"]) == {}
    print(f"healthy 4-host check {healthy:.1f}s; 200 Mbit/s host {slow.name} named in {named:.1f}s")
    no_hang(healthy, HEALTHY_S, "a healthy 4-host check with the pair gate ends")
    no_hang(named, SLOW_NAMED_S, "the pair gate's measurements of a 200 Mbit/s host end")
