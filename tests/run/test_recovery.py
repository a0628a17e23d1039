"""Self-healing runs on real (simulated) hosts: a host that crashes mid-training (`sim fault
--crash`: its link down, every process of it SIGKILLed, no TCP reset for anyone) is named within
seconds, replaced by a spare at its node rank — the master too — and the job resumes from its
checkpoint with parameters bitwise equal to an uninterrupted run; on Slurm with a spare node the
allocation holds. A job's own failure is never recovered; a second loss beyond the budget names
both hosts; a dead spare is dropped by the pre-flight; without a spare an FSDP job goes on
resharded on fewer hosts (`recovery.min_hosts`)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from ddplaunch.backends.failfast import LOST_STOP_GRACE
from ddplaunch.record.events import RecoveryStarted, Shown, read_events
from ddplaunch.record.hosthealth import recorded
from ddplaunch.record.incidents import Recovery
from ddplaunch.report.goodput import ledger
from ddplaunch.record.view import RunView
from ddplaunch.sim.faults import sim_fault
from tests.doc_examples import check_doc_example
from tests.ssh_util import ROOT, ddplaunch, popen_ddplaunch, read_until, run_processes, run_pythons, run_view, wait_for
from tests.timing import no_hang

pytestmark = [pytest.mark.root, pytest.mark.slow]
SHA_RE = re.compile(r"final_weights_sha256=([0-9a-f]{64})")
#: Hang guards from the crash: the host is named from its heartbeat (detect_timeout 2 s + a 1 s
#: probe: ~3 s measured; 7-8 s with the 6 s of before, also at load 14) and training runs again
#: (~10 s) well before the job's collective timeout (300 s) would have said anything. How fast is
#: bench/recovery.py's figure.
DETECT_S, RESUME_S = 30.0, 90.0


def _train(tmp_path: Path, name: str, *args: str) -> dict:
    (tmp_path / name).mkdir(exist_ok=True)
    return {"nproc_per_node": 1, "healthcheck": {"sizes": ["64K"], "iterations": 1},
            "env": {"DDPLAUNCH_CKPT_DIR": str(tmp_path / name / "ckpt")},
            "job": {"script": "jobs/train.py", "args": ["--epochs", "1", "--samples", "768", "--batch-size", "8",
                                                        "--ckpt-every", "4", "--log-every", "1", "--seed", "3",
                                                        *args]}}


def _spec(cluster, tmp_path: Path, name: str, hosts: list[int], spares: list[int], *args: str, **extra) -> Path:
    """The training spec on these hosts and spares; `job={...}` adds keys to its job section."""
    data = yaml.safe_load(cluster.spec_path.read_text())
    recovery = {"max_host_failures": 1, "spares": [data["hosts"][i] for i in spares], **extra.pop("recovery", {})}
    train = _train(tmp_path, name, *args)
    train["job"].update(extra.pop("job", {}))
    data.update(train, hosts=[data["hosts"][i] for i in hosts], workdir=str(ROOT), recovery=recovery, **extra)
    path = tmp_path / name / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def reference_run(sim_cluster, tmp_path_factory) -> tuple[str, Path]:
    """The same training, uninterrupted, on the same world size, recovery on with a spare: every
    rank pauses 12 s, silent, after step 16 of 32 (an evaluation between steps: a sleep changes no
    weight). Its output and its DDPLAUNCH_HOME's parent (test_a_healthy_job_that_pauses_... reads
    them): one run is both the reference and that test's."""
    tmp_path = tmp_path_factory.mktemp("ref")
    spec = _spec(sim_cluster, tmp_path, "ref", [0, 1, 2], [3], "--step-sleep", "0.1", "--pause-every", "16",
                 "--pause-s", "12")
    ref = ddplaunch(["up", str(spec), "--run-id", "rec-ref"], tmp_path, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:]
    return ref.stdout, tmp_path


@pytest.fixture(scope="module")
def reference(reference_run) -> str:
    """The final weights of the same training, uninterrupted, on the same world size."""
    (sha,) = SHA_RE.findall(reference_run[0])
    return sha


def _disturbed(spec: Path, tmp_path: Path, run_id: str, at: str, disturb, timeout: float = 300) -> tuple[str, int]:
    """Start `up`, call `disturb()` once a rank printed `at`, wait for the end; (all output, exit code)."""
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    try:
        head = read_until(proc, at, timeout=180)
        disturb()
        rest, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return "".join(head) + rest, proc.returncode


def _crash_during(spec: Path, tmp_path: Path, run_id: str, cluster, victim: str, at: str = "step=6 ",
                  timeout: float = 300) -> tuple[str, RunView, float]:
    """Start `up`, crash `victim` once a rank printed `at`; (all output, the fold of the run's event
    log, when it crashed)."""
    crashed: list[float] = []

    def crash() -> None:
        crashed.append(time.time())
        sim_fault(cluster, victim, crash=True)
    try:
        out, _ = _disturbed(spec, tmp_path, run_id, at, crash, timeout)
    finally:
        sim_fault(cluster, victim, clear=True)
    return out, run_view(tmp_path, run_id), crashed[0]


def _timely(record: RunView, t_crash: float) -> Recovery:
    (recovery,) = record.recoveries
    assert recovery.resumed_after_s is not None, recovery
    detected = recovery.detected_at - t_crash
    resumed = recovery.lost_at + recovery.resumed_after_s - t_crash
    print(f"crash -> named {detected:.1f}s, crash -> first step after resuming {resumed:.1f}s")
    no_hang(detected, DETECT_S, "a crashed host is named from its heartbeat, not a collective timeout")
    no_hang(resumed, RESUME_S, "training resumes on the spare, not after a collective timeout")
    return recovery


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "master"])
def test_crashed_host_is_replaced_by_the_spare_and_the_job_ends_bitwise_equal(sim_cluster, tmp_path, reference,
                                                                             victim):
    spec = _spec(sim_cluster, tmp_path, "crash", [0, 1, 2], [3], "--step-sleep", "0.3")
    hosts = [h.name for h in sim_cluster.hosts]
    run_id = f"rec-crash-{victim}"
    out, record, t_crash = _crash_during(spec, tmp_path, run_id, sim_cluster, hosts[victim])
    assert record.state == "ok", out[-4000:]
    recovery = _timely(record, t_crash)
    assert recovery.lost == [hosts[victim]] and recovery.replaced == {hosts[victim]: hosts[3]}
    assert re.search(rf"\[ddplaunch\] {hosts[victim]} \(node {victim}\) lost \(no heartbeat for \d+s and "
                     rf"\S+:22 answers neither this machine nor [^)]+\)", out), out[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {hosts[victim]} lost \(no heartbeat for \d+s and "
                     rf".*\) → replaced by {hosts[3]}, resumed after \d+s from step \d+", out), out[-3000:]
    # where the time went: the crash's detection and recovery, the steps trained again, adding up
    spent = ledger(record)
    assert spent is not None and spent.faults == 1 and spent.parts["recovery"] > 0 and spent.parts["detection"] > 0
    assert spent.parts["checkpoint"] > 0  # train.py's torch.save between its steps, seen inside rank 0
    assert math.isclose(sum(spent.parts.values()), record.wall_s, rel_tol=1e-9)
    assert re.search(r"goodput \d+% of \S+ wall: training \S+; lost to .*recovery \S+ \(1 fault\)", out), out[-2000:]
    new_hosts = [hosts[3] if i == victim else hosts[i] for i in range(3)]
    assert record.hosts == new_hosts
    assert f"stage job: master {sim_cluster.hosts[3 if victim == 0 else 0].addr}:" in out.split("recovery 1 of")[1]
    (got,) = SHA_RE.findall(out)
    assert got == reference  # the same world size, the same ranks: the replicas end bitwise equal
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)
    if victim == 1:
        check_doc_example("recovered", out, hosts, [r"\[ddplaunch\] (\S+ \(node \d+\) lost|recovery \d|training resumed)",
                                                    r"stage job: ", r"recovered from", r"  \S+ lost \(", r"goodput ",
                                                    r"run \S+: "])


def test_a_run_whose_up_was_killed_recovers_a_crashed_host_and_attach_shows_it(sim_cluster, tmp_path, reference):
    """`up` SIGKILLed mid-training: the run's supervisor goes on without it, replaces a host that
    crashes afterwards with the spare, and `attach` from a new process shows the run from its
    first line to the end, exit 0, the weights bitwise equal to an undisturbed run."""
    spec = _spec(sim_cluster, tmp_path, "nolauncher", [0, 1, 2], [3], "--step-sleep", "0.3")
    hosts = [h.name for h in sim_cluster.hosts]
    run_id = "rec-nolauncher"
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    read_until(proc, "step=3 ", timeout=180)
    proc.kill()
    proc.wait(timeout=30)
    events = tmp_path / "state" / "runs" / run_id
    try:
        wait_for(lambda: any(isinstance(e, Shown) and "step=6 " in e.text for e in read_events(events)), 120)
        sim_fault(sim_cluster, hosts[1], crash=True)
        attached = ddplaunch(["attach", run_id], tmp_path, timeout=300)
    finally:
        sim_fault(sim_cluster, hosts[1], clear=True)
    out = attached.stdout
    assert attached.returncode == 0, out[-4000:] + attached.stderr
    assert out.startswith(f"[ddplaunch] run {run_id}: ssh backend"), out[:500]
    assert re.search(rf"recovered from 1 host failure:\n  {hosts[1]} lost \(.*\) → replaced by {hosts[3]}", out), out[-3000:]
    (got,) = SHA_RE.findall(out)
    assert got == reference
    assert [type(e).__name__ for e in read_events(events) if isinstance(e, RecoveryStarted)] == ["RecoveryStarted"]
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)


@contextlib.contextmanager
def _launcher_cut_off(addrs: list[str]):
    """This machine's own traffic with `addrs` dropped both ways (iptables OUTPUT and INPUT rules in
    the launcher's network namespace); the hosts' traffic to each other, bridged, never crosses it.
    Both ways: with only what it sends dropped, what the hosts send still arrives now and then (a
    retransmitted segment), so whether they all fall silent at once was a matter of timing."""
    rules = [r for addr in addrs for r in (["OUTPUT", "-d", addr, "-j", "DROP"], ["INPUT", "-s", addr, "-j", "DROP"])]
    for rule in rules:
        subprocess.run(["iptables", "-w", "-I", *rule], check=True, capture_output=True, timeout=30)
    try:
        yield
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-w", "-D", *rule], capture_output=True, timeout=30)


@pytest.mark.parametrize("cut", ["all", "one"], ids=["spare", "one-host-spare"])
def test_the_launchers_own_network_dropped_for_12s_loses_no_host(sim_cluster, tmp_path, reference, cut):
    """Every host (or one) silent and unreachable from the launcher (its own firewall drops its
    traffic with them) for 12 s while they train on: no host is called lost — every host at once is
    this machine's network; one host that a peer still reaches is this machine's path to it — and
    the run ends ok and bitwise equal. With a spare, so that a host wrongly called lost would be
    replaced and said so; without one the same holds (test_runloop.py's
    test_every_host_silent_at_once_is_the_launchers_network_not_lost_hosts[no-spare])."""
    spec = _spec(sim_cluster, tmp_path, "netdrop", [0, 1, 2], [3], "--step-sleep", "0.6")
    run_id = f"rec-netdrop-1-{cut}"
    addrs = [h.addr for h in sim_cluster.hosts] if cut == "all" else [sim_cluster.hosts[1].addr]

    def cut_off() -> None:
        with _launcher_cut_off(addrs):
            time.sleep(12)  # the fault's length: the launcher's network is down this long
    out, code = _disturbed(spec, tmp_path, run_id, "step=4 ", cut_off)
    assert code == 0, out[-4000:]
    # the dropped SYN of the probe times out (2 s): every host at once is what says it is this machine
    assert (re.search(r"3 of 3 hosts went silent at once and this machine cannot reach them \(.*\): its own "
                      r"network is suspect", out) is not None) == (cut == "all"), out[-4000:]
    assert not [line for line in out.splitlines() if line.startswith("[ddplaunch]") and " lost (" in line], out[-4000:]
    assert "recovered from" not in out
    (got,) = SHA_RE.findall(out)
    assert got == reference


def _freeze(run_id: str, host: str) -> list[int]:
    """SIGSTOP every Python process of the run on `host` (torchrun and its worker); their pids."""
    frozen = [pid for pid in run_pythons(run_id) if run_processes(run_id).get(pid, {}).get("DDPLAUNCH_HOST") == host]
    assert len(frozen) == 2, frozen  # torchrun and its worker
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    return frozen


def test_a_host_whose_ranks_froze_is_named_and_replaced(sim_cluster, tmp_path, reference):
    """Every process of the job on one host stopped (SIGSTOP; its host answers, its heartbeat goes
    on): the others wait in a collective; the hang watchdog finds that host's ranks frozen (state
    T), it counts as lost, the spare takes its node rank and the job ends bitwise equal."""
    spec = _spec(sim_cluster, tmp_path, "frozen", [0, 1, 2], [3], "--step-sleep", "0.3", job={"hang_timeout": 10})
    hosts = [h.name for h in sim_cluster.hosts]
    run_id = "rec-frozen"
    frozen: list[int] = []
    out, code = _disturbed(spec, tmp_path, run_id, "step=6 ", lambda: frozen.extend(_freeze(run_id, hosts[1])))
    assert code == 0, out[-4000:]
    assert re.search(rf"\[ddplaunch\] {hosts[1]}: its ranks are frozen \(process state T: pid \d+\) while the host "
                     "answers", out), out[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {hosts[1]} lost \(its ranks are frozen .*\) → replaced by "
                     rf"{hosts[3]}", out), out[-3000:]
    (got,) = SHA_RE.findall(out)
    assert got == reference
    assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in frozen), timeout=30) is True
    # remembered: the next `up` puts the spare in its place and says so, until it is readmitted
    listed = ddplaunch(["hosts"], tmp_path, timeout=60)
    assert re.search(rf"{hosts[1]}\s+its ranks are frozen .* while the host answers\s+{run_id}\s", listed.stdout), \
        listed.stdout
    again = ddplaunch(["up", str(spec), "--dry-run"], tmp_path, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.search(rf"^# skipped {hosts[1]}: its ranks are frozen .* \(run {run_id}, \S+ ago\): "
                     rf"{hosts[3]} in its place$", again.stdout, re.M), again.stdout[:2000]
    assert hosts[1] not in again.stdout.split("# skipped")[-1].split("\n", 2)[-1]
    cleared = ddplaunch(["hosts", "clear", hosts[1]], tmp_path, timeout=60)
    assert cleared.stdout.strip() == f"{hosts[1]}: readmitted"
    assert "# skipped" not in ddplaunch(["up", str(spec), "--dry-run"], tmp_path, timeout=60).stdout


def _lightning(cluster, tmp_path: Path, hosts: list[int], spares: list[int], steps: int) -> Path:
    """Lightning's Trainer (jobs/lightning_train.py) on these hosts: ModelCheckpoint's last.ckpt
    every 100 steps (a step takes a few ms), given back to the relaunched job as Trainer.fit's
    ckpt_path (job.resume_args)."""
    data = yaml.safe_load(cluster.spec_path.read_text())
    ckpt = tmp_path / "lightning" / "ckpt"
    ckpt.mkdir(parents=True)
    data.update(hosts=[data["hosts"][i] for i in hosts], workdir=str(ROOT), nproc_per_node=1,
                healthcheck={"sizes": ["64K"], "iterations": 1}, env={"OMP_NUM_THREADS": "1"},
                job={"script": "jobs/lightning_train.py",
                     "args": ["--max-steps", str(steps), "--ckpt-dir", str(ckpt), "--save-every", "100"],
                     "resume_args": ["--ckpt-path", str(ckpt / "last.ckpt")]},
                recovery={"max_host_failures": 1, "spares": [data["hosts"][i] for i in spares]})
    path = tmp_path / "lightning" / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_lightning_survivors_are_stopped_at_once_and_it_resumes_from_its_last_ckpt(sim_cluster, tmp_path):
    """Lightning's Trainer (DDP, ModelCheckpoint) on 3 hosts + a spare, host 2 crashed once the
    step-400 checkpoint is written. Lightning holds SIGTERM until the step in progress ends, which
    survivors blocked in a collective with the dead peer never reach: they are stopped
    LOST_STOP_GRACE after the loss is confirmed, not after the job's stop_grace (30 s). The relaunch
    resumes from last.ckpt, named by its path (Lightning hands torch.load an fsspec file object).
    Rank 0 draws the bar, logs and writes the checkpoints, and steps of a few ms on shared cores
    differ by a millisecond here and there: no straggler is named, before the crash nor in the
    relaunch's 1,000 steps and more (the judge could name one after 20 + 3 x 20 steps and 3 s)."""
    spec = _lightning(sim_cluster, tmp_path, [0, 1, 2], [3], steps=1600)
    hosts = [h.name for h in sim_cluster.hosts]
    crashed: list[float] = []
    ckpt = tmp_path / "lightning" / "ckpt"

    def saved() -> bool:
        return any(int(m.group(1)) >= 400 for p in ckpt.glob("*.ckpt") if (m := re.search(r"-step=(\d+)", p.name)))

    def crash() -> None:
        assert wait_for(saved, timeout=180) is True, "no step-400 checkpoint"
        crashed.append(time.time())
        sim_fault(sim_cluster, hosts[1], crash=True)
    try:
        out, code = _disturbed(spec, tmp_path, "rec-lightning", "All distributed processes registered", crash)
    finally:
        sim_fault(sim_cluster, hosts[1], clear=True)
    record = run_view(tmp_path, "rec-lightning")
    assert code == 0 and record.state == "ok", out[-4000:]
    recovery = _timely(record, crashed[0])
    assert recovery.stopped_at is not None
    print(f"named -> survivors stopped {recovery.stopped_at - recovery.detected_at:.1f}s")
    no_hang(recovery.stopped_at - recovery.detected_at, 3 * (LOST_STOP_GRACE + 1),
            "survivors that hold SIGTERM are killed once LOST_STOP_GRACE passed")
    assert recovery.loaded and recovery.loaded[-1] == str(ckpt / "last.ckpt"), recovery
    assert f"the relaunched job loaded {ckpt}/last.ckpt" in out, out[-3000:]
    # the step last.ckpt holds (its global_step, read where torch.load returned it): the redone work is exact
    step = recovery.checkpoint.step if recovery.checkpoint is not None else None
    assert step is not None and step % 100 == 0 and step >= 400 and recovery.resumed_from == step, recovery
    assert re.search(rf"resumed after \d+s from step {step}; ", out), out[-3000:]
    assert record.stragglers == [] and "straggler" not in out, out[-3000:]
    assert "done: 1600 steps" in out, out[-3000:]


def test_a_host_whose_training_link_broke_is_named_and_replaced(sim_cluster, tmp_path, reference):
    """One host's traffic to and from the other hosts dropped but for sshd's (`sim fault
    --cut-training`): it still answers and heartbeats, its ranks run, every rank waits in a
    collective. Silent for 10 of its steps (4 s at least), the job is suspect: the link test finds
    that host cut off from the others, which reach each other, before the hang timeout (its
    default, 60 s); it counts as lost, the spare takes its node rank and the job ends bitwise equal."""
    spec = _spec(sim_cluster, tmp_path, "cut", [0, 1, 2], [3], "--step-sleep", "0.3")
    hosts = [h.name for h in sim_cluster.hosts]
    try:
        out, code = _disturbed(spec, tmp_path, "rec-cut", "step=6 ",
                               lambda: sim_fault(sim_cluster, hosts[1], cut_training=True))
    finally:
        sim_fault(sim_cluster, hosts[1], clear=True)
    assert code == 0, out[-4000:]
    # the spare (host 3) took part in the link test as a witness
    assert re.search(rf"\[ddplaunch\] {hosts[1]}: its training link is broken: no TCP connection to or from "
                     rf"{hosts[0]}, {hosts[2]}, {hosts[3]} on port \d+", out), out[-4000:]
    assert f"a link test found {hosts[1]} cut off: job.hang_timeout=60 not waited for" in out, out[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {hosts[1]} lost \(its training link is broken.*\) → "
                     rf"replaced by {hosts[3]}", out), out[-3000:]
    (got,) = SHA_RE.findall(out)
    assert got == reference


def test_a_healthy_job_that_pauses_between_steps_is_not_called_hung(reference_run):
    """Every rank silent for 12 s after step 16 of 32 (an evaluation), recovery on with a spare (the
    reference run): the pause is suspect at the job's pace, the link test finds every link fine,
    nothing is stopped and the run ends ok with no host lost."""
    out, tmp_path = reference_run
    assert out.rstrip().endswith("ok (exit 0)"), out[-3000:]
    assert "hang" not in out and " lost (" not in out and "recover" not in out, out[-3000:]
    view = run_view(tmp_path, "rec-ref")
    assert view.recoveries == [] and view.unrecovered is None and view.exit_code == 0
    logs = ddplaunch(["logs", "rec-ref"], tmp_path, timeout=60).stdout  # the suspicion, said in the log only
    assert re.search(r"the job silent \d+s \(\d+ of its steps\): a link test found no host cut off", logs), logs[-3000:]


def test_a_relaunched_job_that_ignores_its_checkpoint_is_said_to_restart_from_scratch(sim_cluster, tmp_path):
    """job.resume_args reach the relaunched job only; here they point it at an empty checkpoint
    directory, so it loads nothing and trains from step 0: seen from inside its process (no
    torch.load), the summary says training restarted from scratch."""
    spec = _spec(sim_cluster, tmp_path, "scratch", [0, 1, 2], [3], "--step-sleep", "0.3",
                 job={"resume_args": ["--ckpt-dir", str(tmp_path / "scratch" / "elsewhere")]})
    hosts = [h.name for h in sim_cluster.hosts]
    out, record, _ = _crash_during(spec, tmp_path, "rec-scratch", sim_cluster, hosts[1])
    assert record.state == "ok", out[-4000:]
    (recovery,) = record.recoveries
    # rank 0 says its optimizer steps at most once a second (entry.py): when it printed step=6 (the
    # crash's cue, 5 steps of 0.3 s after the first) it had said at least step 3, and never more
    # than it took before the crash froze it
    last = max(int(n) for n in re.findall(r"\[\S+:0\] step=(\d+) ", out.split("training restarted")[0]))
    assert recovery.from_scratch is True and recovery.loaded == [] and recovery.steps_before is not None
    assert 3 <= recovery.steps_before <= last
    assert "[ddplaunch] training restarted from scratch" in out
    assert re.search(r"\d+ optimizer steps done before; training restarted from scratch: the job did not resume "
                     r"\(see job.resume_args\)", out), out[-3000:]
    launches = [text for text in record.plan_text.split("# run ") if " stage job:" in text.split("\n")[0]]
    assert len(launches) == 2 and "elsewhere" not in launches[0] and "elsewhere" in launches[1]


def test_a_crashed_host_cleared_comes_back_as_a_spare_and_takes_the_next_lost_hosts_place(sim_cluster, tmp_path,
                                                                                           reference):
    """3 hosts + 1 spare. A crashes: the spare takes its place. A's fault cleared: once it has
    answered the supervisor's probes for recovery.rejoin_after it is a spare again (its bad-host
    entry cleared). B crashes: A takes B's place, and the run ends at world 3, bitwise equal to an
    undisturbed run."""
    hosts = [h.name for h in sim_cluster.hosts]
    spec = _spec(sim_cluster, tmp_path, "back", [0, 1, 2], [3], "--step-sleep", "0.8",
                 recovery={"max_host_failures": 2, "rejoin_after": 3})
    run_id = "rec-back"
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    said: list[str] = []
    try:
        said += read_until(proc, "step=6 ", timeout=180)
        sim_fault(sim_cluster, hosts[1], crash=True)
        said += read_until(proc, "[ddplaunch] training resumed", timeout=120)
        sim_fault(sim_cluster, hosts[1], clear=True)
        said += read_until(proc, f"[ddplaunch] {hosts[1]} is back as a spare (healthy for ", timeout=60)
        # its entry in the bad-host memory is gone: the next runs take it too
        assert hosts[1] not in recorded(Path(tmp_path) / "state" / "host-health.json", 86400)
        sim_fault(sim_cluster, hosts[2], crash=True)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for victim in hosts[1:3]:
            sim_fault(sim_cluster, victim, clear=True)
    out = "".join(said) + rest
    record = run_view(tmp_path, run_id)
    assert record.state == "ok", out[-4000:]
    first, second = record.recoveries
    assert first.lost == [hosts[1]] and first.replaced == {hosts[1]: hosts[3]}, first
    assert second.lost == [hosts[2]] and second.replaced == {hosts[2]: hosts[1]}, second
    assert [(b.host, b.cleared) for b in record.hosts_back] == [(hosts[1], False)]
    assert record.hosts == [hosts[0], hosts[3], hosts[1]]
    assert re.search(rf"{hosts[1]} came back as a spare \(healthy for \d+s\)", out), out[-3000:]
    (got,) = SHA_RE.findall(out)
    assert got == reference
    wait_for(lambda: run_processes(run_id) == {}, timeout=15)


def test_a_lost_host_that_answers_again_is_fenced_at_once(sim_cluster, tmp_path, reference):
    """Host 2 cut off (its link down) with its ranks stopped, so nothing of theirs ends by itself:
    it is lost and the spare takes its place. When its link comes back, its ranks are killed
    within seconds (the supervisor keeps asking a lost host to end the run's processes), not
    after their lease (120 s) ran out; the run ends ok and bitwise equal."""
    spec = _spec(sim_cluster, tmp_path, "fenced", [0, 1, 2], [3], "--step-sleep", "0.3")
    hosts = [h.name for h in sim_cluster.hosts]
    run_id = "rec-fenced"
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    frozen: list[int] = []
    try:
        head = read_until(proc, "step=6 ", timeout=180)
        frozen += [pid for pid, env in run_processes(run_id).items() if env.get("DDPLAUNCH_HOST") == hosts[1]
                   and pid in run_pythons(run_id)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        sim_fault(sim_cluster, hosts[1], down=True)
        head += read_until(proc, "recovery 1 of", timeout=120)
        assert all(os.path.exists(f"/proc/{pid}") for pid in frozen)  # cut off, not dead
        sim_fault(sim_cluster, hosts[1], clear=True)
        back = time.monotonic()
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in frozen), timeout=120) is True
        fenced = time.monotonic() - back
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        sim_fault(sim_cluster, hosts[1], clear=True)
    out = "".join(head) + rest
    print(f"link back -> the lost host's ranks gone: {fenced:.1f}s")
    assert proc.returncode == 0, out[-4000:]
    assert fenced < 60, fenced  # the fence, not the lease (120 s + the stop grace)
    (got,) = SHA_RE.findall(out)
    assert got == reference


def _torchrun_of(run_id: str, host: str) -> list[int]:
    """The pid of the run's torchrun agent on `host` (its workers have RANK set, it has not)."""
    return [pid for pid, env in run_processes(run_id).items()
            if env.get("DDPLAUNCH_HOST") == host and "RANK" not in env
            and b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_torchrun_killed_on_a_live_host_is_the_jobs_failure_not_a_lost_host(sim_cluster, tmp_path):
    """SIGKILL to one node's torchrun: its SSH session ends with a signal and no exit status, but
    its host answers the probe, so the host is not lost and no spare replaces it."""
    spec = _spec(sim_cluster, tmp_path, "sigkill", [0, 1, 2], [3], "--step-sleep", "0.3")
    victim = sim_cluster.hosts[1].name
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "rec-sigkill"], tmp_path)
    try:
        head = read_until(proc, "step=3 ", timeout=180)
        (agent,) = wait_for(lambda: _torchrun_of("rec-sigkill", victim), 30)
        os.kill(agent, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(head) + rest
    assert proc.returncode == 1, out[-3000:]
    assert "recovery 1 of" not in out and "recovered from" not in out, out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("[ddplaunch]") and " lost" in line], out[-3000:]
    assert re.search(rf"first failure: {victim} \(node 1\): failed; its session ended by a signal "
                     r"\(no exit status\); its host answers", out), out[-3000:]
    assert run_processes("rec-sigkill") == {}


OOM_JOB = """\
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, 400):
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        print(f"step={step}", flush=True)
    if step == 5 and rank == 1:  # this rank alone goes into a small memory cgroup and outgrows it
        with open(os.path.join(os.environ["OOM_CGROUP"], "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        block = bytearray(1 << 30)
        for i in range(0, len(block), 4096):
            block[i] = 1
    time.sleep(0.1)
"""


@contextlib.contextmanager
def _memory_cgroup(name: str, limit: int):
    """A memory cgroup of `limit` bytes (v1's memory hierarchy, or v2's root), removed after."""
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / name
    group.mkdir(exist_ok=True)
    (group / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")).write_text(str(limit))
    try:
        yield group
    finally:
        for _ in range(50):  # the killed process leaves the group as it is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_rank_the_oom_killer_ended_is_named_in_the_kernels_words(sim_cluster, tmp_path):
    """One rank outgrows its memory (a memory cgroup of 128 MiB) and the kernel's OOM killer ends
    it with SIGKILL: the job's failure, not a lost host, so with recovery on (a spare) it is launched
    once and never retried; the summary says who killed it, with the kernel's own line read from
    that host's kernel log."""
    script = tmp_path / "oom_job.py"
    script.write_text(OOM_JOB)
    with _memory_cgroup(f"ddplaunch-test-oom-{os.getpid()}", 128 << 20) as group:
        spec = _spec(sim_cluster, tmp_path, "oom", [0, 1, 2], [3], job={"script": str(script), "args": []})
        data = yaml.safe_load(spec.read_text())
        data["env"]["OOM_CGROUP"] = str(group)
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        proc = ddplaunch(["up", str(spec), "--run-id", "rec-oom"], tmp_path, timeout=300)
    out = proc.stdout
    victim = sim_cluster.hosts[1].name
    assert proc.returncode == 1, out[-3000:]
    # a job's own failure (its node's exit code 1) with recovery on: launched once, never retried
    assert out.count("] stage job: master") == 1, out[-3000:]
    assert "recovery 1 of" not in out and "recovered from" not in out, out[-3000:]
    assert re.search(rf"first failure: {victim} \(node 1\): failed, exit code 1; rank 1 \(local rank 0\) killed "
                     r"by SIGKILL; rank 1 \(pid \d+\) killed by the OOM killer", out), out[-3000:]
    assert re.search(rf"{victim}: rank 1 \(pid (\d+)\) was killed by the kernel's OOM killer: Memory cgroup out of "
                     r"memory: Killed process \1 \(python", out), out[-3000:]
    assert run_processes("rec-oom") == {}
    # the host is remembered, the next `up` warned (recovery.remember_bad_hosts)
    (entry,) = recorded(tmp_path / "state" / "host-health.json", ttl=3600).values()
    assert entry.host == victim and re.fullmatch(r"its kernel's OOM killer ended rank 1 \(pid \d+\)", entry.cause)


def test_a_second_loss_beyond_the_budget_names_both_hosts(sim_cluster, tmp_path):
    """A recovered run that loses a second host ends, naming both (the master first here)."""
    spec = _spec(sim_cluster, tmp_path, "twice", [0, 1, 2], [3], "--step-sleep", "0.3")
    hosts = [h.name for h in sim_cluster.hosts]
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "rec-twice"], tmp_path)
    try:
        head = read_until(proc, "step=6 ", timeout=180)
        sim_fault(sim_cluster, hosts[0], crash=True)
        head += read_until(proc, "training resumed", timeout=120)
        sim_fault(sim_cluster, hosts[2], crash=True)
        rest, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        for h in (hosts[0], hosts[2]):
            sim_fault(sim_cluster, h, clear=True)
    out = "".join(head) + rest
    assert proc.returncode == 1, out[-3000:]
    assert f"recovery 1 of at most 1: {hosts[0]} lost" in out and f"replaced by {hosts[3]}" in out, out[-3000:]
    assert f"stage job: master {sim_cluster.hosts[3].addr}:" in out.split("recovery 1 of")[1]
    assert (f"not recovered: {hosts[2]} lost after {hosts[0]} earlier: more host failures than "
            "recovery.max_host_failures=1") in out
    wait_for(lambda: run_processes("rec-twice") == {}, timeout=15)
    check_doc_example("unrecovered", out, hosts, [r"\[ddplaunch\] (\S+ \(node \d+\) lost|not recovering)",
                                                  r"stage job: lost", r"recovered from", r"  \S+ lost \(",
                                                  r"not recovered", r"run \S+: "])


def test_a_dead_spare_is_named_and_dropped_and_the_run_goes_on(sim_cluster, tmp_path):
    """A spare that is down fails the pre-flight: named, dropped, and the job (the toy job: what it
    trains is not the point) runs on the hosts."""
    spare = sim_cluster.hosts[3]
    spec = _spec(sim_cluster, tmp_path, "deadspare", [0, 1], [3], job={"script": "jobs/toy_ddp.py", "args": []})
    sim_fault(sim_cluster, spare.name, down=True)
    try:
        proc = ddplaunch(["up", str(spec), "--run-id", "rec-deadspare"], tmp_path, timeout=300)
    finally:
        sim_fault(sim_cluster, spare.name, clear=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(rf"^{spare.name} \(\S+\): reach: ", proc.stdout, re.M)
    assert f"spare {spare.name} failed the pre-flight: dropped (the run goes on without it)" in proc.stdout
    assert proc.stdout.count("updated_weight=0.6") == 2 and f"[{spare.name}:" not in proc.stdout, proc.stdout[-3000:]


def test_a_spare_that_died_while_it_waited_is_dropped_and_the_next_one_used(sim_cluster, tmp_path):
    """2 hosts and 2 spares, budget 1: once training runs the first spare crashes. The spare watch
    names it and drops it (at no cost to the budget); then a worker crashes and the second spare
    takes its node rank at once, and the job ends ok (that a relaunch ends bitwise equal to an
    undisturbed run is the crash tests' to show: no reference run here, for CI's time)."""
    hosts = [h.name for h in sim_cluster.hosts]
    spec = _spec(sim_cluster, tmp_path, "spare2", [0, 1], [2, 3], "--samples", "3200", "--step-sleep", "0.3")
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "rec-spare2"], tmp_path)
    try:
        head = read_until(proc, "step=6 ", timeout=180)
        sim_fault(sim_cluster, hosts[2], crash=True)
        dropped = read_until(proc, f"[ddplaunch] spare {hosts[2]} does not answer", timeout=120)
        sim_fault(sim_cluster, hosts[1], crash=True)
        rest, _ = proc.communicate(timeout=300)
    finally:
        for host in hosts[1:3]:
            sim_fault(sim_cluster, host, clear=True)
        if proc.poll() is None:
            proc.kill()
    out = "".join(head + dropped) + rest
    assert proc.returncode == 0, out[-4000:]
    assert "dropped while it waited, at no cost to recovery.max_host_failures (1 spare left)" in dropped[-1], out[-4000:]
    assert re.search(rf"recovered from 1 host failure:\n  {hosts[1]} lost \(.*\) → replaced by {hosts[3]}", out), \
        out[-3000:]
    assert "cannot be reached" not in out  # the dead spare was not tried
    assert f"spare {hosts[2]} dropped while it waited: " in rest  # the summary says it
    assert len(SHA_RE.findall(out)) == 1, out[-2000:]  # the relaunched job ran to its end


def test_without_a_spare_fsdp_goes_on_resharded_on_fewer_hosts_and_grows_back(sim_cluster, tmp_path):
    """FSDP2 on 3 hosts x 2 ranks, no spare, recovery.min_hosts 2: a crashed host is left out and
    the job resumes from its sharded checkpoint on 2 hosts x 2 (resharded 6 -> 4 ranks). Its fault
    cleared, the host is back as a spare (recovery.rejoin_after) and the run grows back to 3 hosts
    at the job's next checkpoint (resharded 4 -> 6), every rank holding the same full parameters."""
    data = yaml.safe_load(sim_cluster.spec_path.read_text())
    (tmp_path / "shrink").mkdir()
    data.update(hosts=data["hosts"][:3], workdir=str(ROOT), nproc_per_node=2,
                recovery={"max_host_failures": 1, "min_hosts": 2, "rejoin_after": 2}, healthcheck={"enabled": False},
                env={"DDPLAUNCH_CKPT_DIR": str(tmp_path / "shrink" / "ckpt")},
                job={"script": "jobs/fsdp_train.py", "args": ["--steps", "100", "--ckpt-every", "4",
                                                              "--global-batch", "12", "--step-sleep", "0.3"]})
    spec = tmp_path / "shrink" / "cluster.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    hosts = [h.name for h in sim_cluster.hosts[:3]]
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "rec-shrink"], tmp_path)
    said: list[str] = []
    try:
        said += read_until(proc, "step=10 ", timeout=180)
        sim_fault(sim_cluster, hosts[2], crash=True)
        said += read_until(proc, "[ddplaunch] training resumed", timeout=120)
        sim_fault(sim_cluster, hosts[2], clear=True)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        sim_fault(sim_cluster, hosts[2], clear=True)
    out = "".join(said) + rest
    record = run_view(tmp_path, "rec-shrink")
    assert record.state == "ok", out[-4000:]
    shrunk, grown = record.recoveries
    assert shrunk.lost == [hosts[2]] and shrunk.hosts_after == 2 and "left out (2 hosts go on)" in out
    assert grown.grown == [hosts[2]] and grown.lost == [] and grown.hosts_after == 3, grown
    assert record.hosts == hosts and [b.host for b in record.hosts_back] == [hosts[2]]
    first, second = out.split("recovery 1 of")[1].split("growing back: ")
    assert re.search(r"resumed from \S+ at step \d+ \(written by 6 ranks", first), out[-3000:]
    assert re.search(r"resumed from \S+ at step \d+ \(written by 4 ranks", second), out[-3000:]
    assert re.search(rf"{hosts[2]} back → the world grows from 2 to 3 hosts", out), out[-3000:]
    hashes = dict(re.findall(r"rank=(\d+) full_params_sha256=([0-9a-f]{64})", second))
    assert sorted(map(int, hashes)) == [0, 1, 2, 3, 4, 5], hashes  # 3 hosts x 2 again
    assert len(set(hashes.values())) == 1, hashes  # every rank of the grown run holds the same parameters
    assert "goodput" in out and "(2 faults)" not in out  # growing back is no fault
