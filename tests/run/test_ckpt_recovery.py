"""The crash of the saver on real (simulated) hosts: a job that checkpoints through
ddplaunch.checkpoint's memory tier (`checkpoint: {tier: memory, replicas: 1}`, jobs/train.py
--ckpt-api) loses the host of rank 0, which holds its saves, two steps after a save (`sim fault
--crash`: every process of it killed, its RAM emptied). The relaunch on the spare resumes from that
save read from the buddy's RAM (node 1's host), not the durable dir; the summary says so; the final
weights are bitwise equal to the same job run without a crash. With the saver and its buddy lost
together, the run resumes from the durable copy and says that."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from ddplaunch.hostside.ckpt.layout import step_name
from ddplaunch.record.incidents import Recovery
from ddplaunch.record.view import RunView
from ddplaunch.sim.faults import sim_fault
from tests.ssh_util import ROOT, ddplaunch, popen_ddplaunch, read_until, run_processes, run_view, wait_for
from tests.timing import no_hang

pytestmark = [pytest.mark.root, pytest.mark.slow]
SHA_RE = re.compile(r"final_weights_sha256=([0-9a-f]{64})")
#: Saves every 4 steps; the crash comes once a rank said step 10: two steps after the save of step 8
#: (the next one, step 12, is at least 0.6 s of --step-sleep away).
EVERY, CRASH_AT, SAVED = 4, "step=10 ", 8
#: Hang guards, as test_recovery.py's: a host named from its heartbeat, training running again
#: well before a collective timeout (300 s) would have said anything.
DETECT_S, RESUME_S = 30.0, 90.0


def _spec(cluster, tmp_path: Path, name: str, hosts: list[int], spares: list[int], *args: str,
          recovery: dict | None = None) -> Path:
    """train.py --ckpt-api (and `args`) on these hosts, with these spares (`recovery` adds to its
    section); its checkpoints in the memory tier with one buddy copy, the durable dir under tmp_path."""
    data = yaml.safe_load(cluster.spec_path.read_text())
    (tmp_path / name).mkdir(exist_ok=True)
    data.update(
        hosts=[data["hosts"][i] for i in hosts], workdir=str(ROOT), nproc_per_node=1,
        healthcheck={"sizes": ["64K"], "iterations": 1},
        recovery={"max_host_failures": 1, "spares": [data["hosts"][i] for i in spares], **(recovery or {})},
        checkpoint={"path": str(tmp_path / name / "ckpt"), "tier": "memory", "replicas": 1},
        job={"script": "jobs/train.py",
             "args": ["--epochs", "1", "--samples", "768", "--batch-size", "8", "--ckpt-every", str(EVERY),
                      "--log-every", "1", "--seed", "3", "--step-sleep", "0.3", "--ckpt-api", *args]})
    path = tmp_path / name / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _uninterrupted(cluster, tmp_path: Path, name: str, hosts: list[int]) -> tuple[str, str]:
    """The same job run to its end without a crash: (its output, its final weights)."""
    spec = _spec(cluster, tmp_path, name, hosts, [])
    ref = ddplaunch(["up", str(spec), "--run-id", f"ckr-{name}"], tmp_path, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:]
    (sha,) = SHA_RE.findall(ref.stdout)
    return ref.stdout, sha


@pytest.fixture(scope="module")
def reference(sim_cluster, tmp_path_factory) -> str:
    """The final weights of the job uninterrupted on three hosts."""
    return _uninterrupted(sim_cluster, tmp_path_factory.mktemp("ckref"), "ref", [0, 1, 2])[1]


def _crash_during(spec: Path, tmp_path: Path, run_id: str, cluster, victims: list[str]) -> tuple[str, RunView, float]:
    """Start `up`, crash every one of `victims` once a rank printed CRASH_AT, wait for the end; (all
    output, the fold of the run's event log, when the crash came)."""
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    try:
        head = read_until(proc, CRASH_AT, timeout=180)
        crashed = time.time()
        for victim in victims:
            sim_fault(cluster, victim, crash=True)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for victim in victims:
            sim_fault(cluster, victim, clear=True)
    return "".join(head) + rest, run_view(tmp_path, run_id), crashed


def _resumed(record: RunView, t_crash: float, out: str, majority: bool = False) -> Recovery:
    """The run's one recovery, after it says how long after the crash training ran again. With
    `majority` of the hosts crashed at once the launcher suspects its own network first and calls
    them lost only after 120 s: then only the time from their naming to training is guarded."""
    assert record.state == "ok", out[-4000:]
    (recovery,) = record.recoveries
    assert recovery.resumed_after_s is not None and recovery.first_step_at is not None, recovery
    detected, resumed = recovery.detected_at - t_crash, recovery.first_step_at - t_crash
    print(f"crash -> named {detected:.1f}s, crash -> first step after resuming {resumed:.1f}s "
          f"({recovery.phases()} after the lost host was last heard from)")
    if majority:
        no_hang(resumed - detected, RESUME_S, "training resumes once the hosts are named, not after a collective "
                                              "timeout")
        return recovery
    no_hang(detected, DETECT_S, "a crashed host is named from its heartbeat, not a collective timeout")
    no_hang(resumed, RESUME_S, "training resumes on the spare, not after a collective timeout")
    return recovery


def test_the_savers_crash_resumes_from_its_buddys_ram_bitwise_equal(sim_cluster, tmp_path, reference):
    hosts = [h.name for h in sim_cluster.hosts]
    spec = _spec(sim_cluster, tmp_path, "saver", [0, 1, 2], [3])
    run_id = "ckr-saver"
    out, record, t_crash = _crash_during(spec, tmp_path, run_id, sim_cluster, [hosts[0]])
    recovery = _resumed(record, t_crash, out)
    assert recovery.lost == [hosts[0]] and recovery.replaced == {hosts[0]: hosts[3]}, recovery
    # rank 0's word of its load, as data: step 8 from node 1's host's RAM, a copy of the lost saver's
    # save (the durable dir may hold step 8 too by then: it was not what was read)
    loaded = recovery.checkpoint
    assert loaded is not None and (loaded.step, loaded.source, loaded.host, loaded.origin) == \
        (SAVED, "memory", hosts[1], hosts[0]), recovery
    assert recovery.resumed_from == SAVED
    assert re.search(rf"resumed from \S+/{hosts[1]}/replicas/{hosts[0]}/\S+ at step {SAVED} "
                     rf"\({hosts[1]}'s memory, saved by {hosts[0]}\)", out), out[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {hosts[0]} lost \(.*\) → replaced by {hosts[3]}, "
                     rf"resumed after \d+s at step {SAVED} from {hosts[1]}'s memory \({hosts[0]} lost\)", out), \
        out[-3000:]
    (got,) = SHA_RE.findall(out)
    assert got == reference  # resumed bitwise: the same weights as the run that never crashed
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)


def test_the_saver_and_its_buddy_lost_together_resume_from_the_durable_copy(sim_cluster, tmp_path):
    """Three hosts, one spare, two may be lost and the job go on with two (`recovery.min_hosts`):
    node 0 saves, node 1 holds its copies, both crash at once. Neither the spare nor node 2 holds
    them in RAM: the relaunch on two hosts reads step 8 from the durable dir and says so, and ends
    bitwise equal to the same job started on two hosts from a copy of that durable step. (Two of
    three hosts silent at once: the launcher waits 120 s before it calls them lost.)"""
    hosts = [h.name for h in sim_cluster.hosts]
    spec = _spec(sim_cluster, tmp_path, "both", [0, 1, 2], [3], "--keep", "0",  # the durable dir keeps every step
                 recovery={"max_host_failures": 2, "min_hosts": 2})
    run_id = "ckr-both"
    out, record, t_crash = _crash_during(spec, tmp_path, run_id, sim_cluster, [hosts[0], hosts[1]])
    recovery = _resumed(record, t_crash, out, majority=True)
    assert sorted(recovery.lost) == hosts[:2] and recovery.hosts_after == 2, recovery
    loaded = recovery.checkpoint
    assert loaded is not None and (loaded.step, loaded.source, loaded.host, loaded.origin) == \
        (SAVED, "durable", "", ""), recovery
    assert re.search(rf"resumed from \S+ at step {SAVED} \(the durable dir\)", out), out[-4000:]
    assert re.search(rf"resumed after \d+s at step {SAVED} from the durable dir", out), out[-3000:]
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)
    # the reference: the same job on the hosts it went on with, its durable dir a copy of step 8 alone
    shutil.copytree(tmp_path / "both" / "ckpt" / step_name(SAVED), tmp_path / "ref" / "ckpt" / step_name(SAVED))
    ref, reference = _uninterrupted(sim_cluster, tmp_path, "ref", [hosts.index(h) for h in record.hosts])
    assert re.search(rf"resumed from \S+ at step {SAVED} \(the durable dir\)", ref), ref[-3000:]
    (got,) = SHA_RE.findall(out)
    assert got == reference
