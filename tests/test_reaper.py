"""The host-side reaper (hostside/reaper.py) as the program the backends send: a frozen node's
torchrun (stopped: it cannot act on SIGTERM) is killed at once with the run's other stopped
processes, not waited for; nothing of another run is touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

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
