"""The host-side reaper (hostside/reaper.py) as the program the backends send: a frozen node's
torchrun (stopped: it cannot act on SIGTERM) is killed at once with the run's other stopped
processes, not waited for; nothing of another run is touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from ddplaunch.hostside import reaper
from ddplaunch.plan.hostprogram import host_program

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_a_stopped_torchrun_and_its_stopped_workers_are_killed_not_waited_for(tmp_path):
    run_id, other = f"reap-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    torchrun, worker = (subprocess.Popen(SLEEPER, env=dict(os.environ, DDPLAUNCH_RUN_ID=run_id)) for _ in range(2))
    bystander = subprocess.Popen(SLEEPER, env=dict(os.environ, DDPLAUNCH_RUN_ID=other))
    pidfile = tmp_path / "torchrun-job.pid"
    pidfile.write_text(str(torchrun.pid))
    try:
        for proc in (torchrun, worker, bystander):
            os.kill(proc.pid, signal.SIGSTOP)
        command, nonce = host_program("reaper", sys.executable, run_id, "--term", str(pidfile))
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        (answer,) = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
                     if line.startswith(f"DDPLAUNCH_ANSWER_{nonce} ")]
        assert answer["termed"] == [torchrun.pid] and answer["left"] == [], answer
        assert torchrun.wait(timeout=10) == -signal.SIGKILL and worker.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None  # another run's stopped process: untouched
    finally:
        for proc in (torchrun, worker, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


HOLDS_TERM = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); "
              "print('ready', flush=True); time.sleep(120)"]


def _holds(run_id: str) -> subprocess.Popen:
    proc = subprocess.Popen(HOLDS_TERM, env=dict(os.environ, DDPLAUNCH_RUN_ID=run_id), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # its handler is in place
    return proc


def test_kill_now_kills_a_process_that_holds_sigterm_without_the_grace(tmp_path):
    """`--kill --now` (the survivors of a lost host: they had their SIGTERM) kills at once what
    holds SIGTERM; plain `--kill` sends SIGTERM first and kills only after its grace."""
    run_id = f"reap-{uuid.uuid4().hex[:8]}"
    for words, grace in ((["--kill", "--now"], 0.0), (["--kill"], reaper.GRACE)):
        holder = _holds(run_id)
        try:
            command, nonce = host_program("reaper", sys.executable, run_id, *words)
            t0 = time.monotonic()
            subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
            took = time.monotonic() - t0
            assert holder.wait(timeout=10) == -signal.SIGKILL
            # plain --kill waited out its grace for the holder; --now did not (a hang guard)
            assert took >= grace if grace else took < reaper.GRACE, (words, took)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(timeout=10)
