"""Resilience on the sim cluster: restarts (job.max_restarts) that lose nothing (bitwise, at world
size 4) and stop on a failure that repeats, and a host that never starts torchrun named within the
rendezvous timeout. Hangs and mismatched
collectives are in the fault matrix (tests/run/test_fault_matrix.py, every backend); their pure parts
(stack summaries, PyTorch's mismatch lines) are tested here first."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from ddplaunch.diagnose.oom import killed_ranks
from ddplaunch.diagnose.stacks import RankStack, stuck_at, summarize_stacks
from ddplaunch.output.torchrun import VICTIM_RE, finding_lines, rank_cause
from ddplaunch.output.who import OutputLine, read_line
from tests.doc_examples import check_doc_example
from tests.ssh_util import ddplaunch, popen_ddplaunch, read_until, run_processes, sim_spec, wait_for
from tests.timing import no_hang

SHA_RE = re.compile(r"final_weights_sha256=([0-9a-f]{64})")


def _frames(*frames: tuple[str, str, int]) -> list[dict]:
    return [{"thread_name": "MainThread", "os_thread_id": 1, "active": False,
             "frames": [{"name": n, "filename": f, "short_filename": Path(f).name, "line": ln}
                        for n, f, ln in frames]}]


def test_stuck_at_names_the_collective_and_the_user_line():
    torch_dir = "/v/lib/python3.11/site-packages/torch/distributed"
    threads = _frames(("barrier", f"{torch_dir}/distributed_c10d.py", 5356),
                      ("_exception_logger.<locals>.wrapper", f"{torch_dir}/c10d_logger.py", 83),
                      ("main", "/work/jobs/demo.py", 45), ("<module>", "/work/jobs/demo.py", 60))
    assert stuck_at(threads, "/work") == "barrier at jobs/demo.py:45"
    assert stuck_at(_frames(("sleep", "/usr/lib/python3.11/time.py", 3)), "/w") == "sleep (time.py:3)"
    stacks = [RankStack("h1", 10, 0, "all_reduce at a.py:1"), RankStack("h2", 12, 2, "barrier at a.py:2"),
              RankStack("h1", 11, 1, "barrier at a.py:2"), RankStack("h2", 13, 3, "barrier at a.py:2")]
    assert summarize_stacks(stacks) == "rank 0 (h1): all_reduce at a.py:1 — ranks 1-3 (h1, h2): barrier at a.py:2"
    many = [RankStack(f"n{r // 8}", 100 + r, r, "barrier at a.py:2") for r in range(8 * 1000)]
    assert summarize_stacks(many) == "ranks 0-7999 (n0, n1, n2, n3, n4, n5, n6, n7, ... (1000 hosts)): barrier at a.py:2"


def test_mismatch_and_store_errors_condensed():
    fp = ("CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[{}], TensorDtypes={}, "
          "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))")
    line = (f"[dlt2:1] [rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running "
            f"collective: {fp.format(4, 'Float')}, but Rank 0 is running collective: {fp.format(8, 'Double')}."
            "Collectives differ in the following aspects: Tensor Tensor shapes: 4vs 8")
    store = "[dlt1] torch.distributed.DistStoreError: Timed out after 31 seconds waiting for clients. 1/2 clients joined."
    assert finding_lines([read_line(line), read_line(line), read_line(store)]) == [
        "dlt2 rank 1: collective mismatch (TORCH_DISTRIBUTED_DEBUG=DETAIL): "
        "rank 1 ALLREDUCE [4] Float vs rank 0 ALLREDUCE [8] Double",
        "dlt1: DistStoreError: Timed out after 31 seconds waiting for clients. 1/2 clients joined."]


def test_a_callbacks_error_is_the_cause_not_its_frame_list():
    """An error raised in a Future's callback (a DDP comm hook's) ends with `At:` and the callback's
    frames: the cause keeps the error above them, so a rank that only saw its peer die is known."""
    frames = [f"[dlt1:0] [rank0]: [rank0]:   /x/mod{i}.py({i}): f{i}" for i in range(14)]
    lines = ["[dlt1:0] step=2 loss=0.5", "[dlt1:0] [rank0]: Traceback (most recent call last):",
             *[f'[dlt1:0] [rank0]:   File "/x/y{i}.py", line {i}, in g' for i in range(14)],
             "[dlt1:0] [rank0]: RuntimeError: Got the following error when running the callback: RuntimeError: "
             "[pair.cc:553] Connection closed by peer [10.213.7.12]:61868. This is typically caused by a "
             "remote worker crashing.",
             "[dlt1:0] [rank0]: [rank0]: At:", *frames, "[dlt1:0] ", "[dlt1:0] after the frames"]
    said = [OutputLine("dlt1", 0, 0, line[len("[dlt1:0] "):]) for line in lines]
    cause = rank_cause(said)
    assert cause[0] == "[rank0]: Traceback (most recent call last):"
    assert "Connection closed by peer" in cause[-2] and cause[-1] == "after the frames", cause
    assert VICTIM_RE.search("\n".join(cause))
    assert not any("At:" in line or "mod" in line for line in cause)
    # without the trailer: the same error last
    assert rank_cause(said[:-len(frames) - 3])[-1] == cause[-2]


def test_the_ranks_signal_9_ended_are_found_in_torchruns_failure_report():
    report = ["[dlt2] Failures:", "[dlt2] [1]:", "[dlt2]   rank      : 2 (local_rank: 1)",
              "[dlt2]   exitcode  : 1 (pid: 4101)", "[dlt2] Root Cause (first observed failure):", "[dlt2] [0]:",
              "[dlt2]   host      : dlt2", "[dlt2]   rank      : 1 (local_rank: 0)",
              "[dlt2]   exitcode  : -9 (pid: 4100)", "[dlt2]   traceback : Signal 9 (SIGKILL) received by PID 4100"]
    assert killed_ranks(report) == {4100: 1}
    assert killed_ranks(report[:4]) == {}


# ----------------------------------------------------------------------------- on the sim cluster

def _train_spec(cluster, tmp_path: Path, name: str, *args: str, **job) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    # World size 4 (2 hosts x 2): train.py keeps DDP's buckets fixed (find_unused_parameters), so a
    # resumed run sums gradients in the same order as an uninterrupted one, bit for bit.
    return sim_spec(cluster, run_dir, n_hosts=2, nproc_per_node=2, healthcheck={"enabled": False},
                    env={"DDPLAUNCH_CKPT_DIR": str(run_dir / "ckpt")},
                    job={"script": "jobs/train.py", "args": ["--epochs", "2", "--ckpt-every", "4",
                                                             "--log-every", "2", "--seed", "7", *args], **job})


def test_killed_worker_restarts_resumes_and_ends_bitwise_identical(sim_cluster, tmp_path):
    """job.max_restarts: a rank killed mid-training is restarted with every other rank, on every
    host together (one new launch, never torchrun's per-node restarts), resumes from its checkpoint
    and ends with the weights of an undisturbed run."""
    ref = ddplaunch(["up", str(_train_spec(sim_cluster, tmp_path, "ref")), "--run-id", "res-ref"], tmp_path)
    assert ref.returncode == 0, ref.stdout[-3000:]
    # DDP over SSH across hosts: every replica ends with the same parameters
    assert re.search(r"replicas identical: \w+ on 4 ranks", ref.stdout), ref.stdout[-3000:]
    (want,) = SHA_RE.findall(ref.stdout)

    spec = _train_spec(sim_cluster, tmp_path, "killed", "--step-sleep", "0.3", max_restarts=1)
    proc = popen_ddplaunch(["up", str(spec), "--run-id", "res-restart"], tmp_path)
    host2 = sim_cluster.hosts[1].name
    read_until(proc, "step=10 ", timeout=120)  # past the checkpoint at step 8
    victim = wait_for(lambda: [p for p, e in run_processes("res-restart").items()
                               if e.get("DDPLAUNCH_HOST") == host2 and e.get("RANK") == "3"], 30)[0]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    assert f"restart 1 of at most 1 (job.max_restarts): the job failed (rank 3 on {host2} killed by SIGKILL)" in out
    assert re.search(r"resumed from \S+ckpt_step\d+\.pt at step \d+", out), out[-4000:]
    assert re.search(rf"stage job: rank 3 on {host2} killed by SIGKILL after [\d.]+s: restarted \(relaunch 1\)", out)
    assert re.search(r"stage job: ok on all 2 node\(s\) in [\d.]+s\n", out), out[-2000:]
    assert "workers restarted" not in out  # torchrun restarted nothing by itself
    (got,) = SHA_RE.findall(out)
    assert got == want
    assert run_processes("res-restart") == {}
    check_doc_example("restarts", out, [h.name for h in sim_cluster.hosts],
                      [r"\[\S+:0\] (train: world_size|resumed from)", r"stage job: ", r"recovered from",
                       r"  the job failed", r"run \S+: "])


def test_the_same_exception_after_a_restart_stops_the_run_naming_it(sim_cluster, tmp_path):
    """A job that raises the same error at the same step in every launch is restarted once, then
    stopped with its exception, rank and host in the summary: max_restarts is not spent on it."""
    spec = _train_spec(sim_cluster, tmp_path, "again", "--raise-at-step", "3", "--fail-rank", "2",
                       "--epochs", "1", max_restarts=3)
    out = ddplaunch(["up", str(spec), "--run-id", "res-again"], tmp_path, timeout=300).stdout
    host2 = sim_cluster.hosts[1].name
    failed = f"rank 2 on {host2} raised ValueError: injected failure at step 3 (--raise-at-step) (train.py:"
    assert f"restart 1 of at most 3 (job.max_restarts): the job failed ({failed}" in out, out[-4000:]
    assert re.search(rf"not recovered: the same failure again: {re.escape(failed)}\d+\), as before restart 1: "
                     "not retried", out), out[-3000:]
    assert out.count("stage job: master") == 2 and out.rstrip().endswith("FAILED (exit 1)"), out[-3000:]
    assert run_processes("res-again") == {}


def test_a_job_that_ends_before_its_first_step_in_every_launch_stops_with_no_progress(sim_cluster, tmp_path):
    """A job that exits non-zero at its start every time (an exit code: never "the same failure")
    is restarted until three relaunches in a row ended before a step, then stopped: no progress."""
    script = tmp_path / "gives_up.py"
    script.write_text("import sys\nprint('giving up at once', flush=True)\nsys.exit(3)\n")
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=2, healthcheck={"enabled": False},
                    job={"script": str(script), "max_restarts": 5})
    out = ddplaunch(["up", str(spec), "--run-id", "res-stall"], tmp_path, timeout=300).stdout
    assert re.search(r"not recovered: rank \d on \S+ exit code 3: no progress — the last 3 relaunches each ended "
                     r"before the job's first step", out), out[-3000:]
    assert out.count("stage job: master") == 4 and "restart 4 of" not in out, out[-3000:]
    assert out.rstrip().endswith("FAILED (exit 1)") and run_processes("res-stall") == {}


def _sleepers(seconds: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", seconds.encode()]:
                found.append(int(name))
        except OSError:
            continue
    return found


def test_host_that_never_starts_torchrun_is_named_within_rdzv_timeout(sim_cluster, tmp_path):
    h2 = sim_cluster.hosts[1].name
    spec = sim_spec(sim_cluster, tmp_path, n_hosts=2, healthcheck={"enabled": False}, rdzv_timeout=10,
                    setup=[f'[ "$(hostname)" = {h2} ] && sleep 597 || true'],
                    job={"script": "jobs/toy_ddp.py"})
    t0 = time.monotonic()
    proc = ddplaunch(["up", str(spec), "--run-id", "res-missing"], tmp_path, timeout=300)
    took = time.monotonic() - t0
    print(f"missing host named after {took:.1f}s")
    assert proc.returncode == 1, proc.stdout[-3000:]
    # within a few rendezvous timeouts (pre-flight, start-up and stop included), not torchrun's 900 s
    no_hang(took, 10 * 10, "a host that never starts is named after rdzv_timeout=10, not torchrun's 900 s")
    assert f"  missing host: {h2} (node 1): torchrun never started (blocked before launch)" in proc.stdout
    assert re.search(r"DistStoreError: Timed out after \d+ seconds waiting for clients. 1/2 clients joined",
                     proc.stdout)
    assert run_processes("res-missing") == {}
    wait_for(lambda: not _sleepers("597"), timeout=10)  # the blocked setup line is gone too
    check_doc_example("missing", proc.stdout, [h.name for h in sim_cluster.hosts],
                      [r"\[ddplaunch\] \S+ \(node \d+\): torchrun never started", r"stage job: ",
                       r"  (missing host|\S+: DistStoreError|first failure): ", r"run \S+: "])
