"""Find and end every process of one run on this host, by the run's environment tag.

Every process ddplaunch starts (torchrun and its workers) carries `DDPLAUNCH_RUN_ID=<id>` in
its environment, so leftovers are found exactly — never by name pattern. Plain script with no
imports beyond the standard library: backends also send its source to remote hosts.
Usage: `python reaper.py RUN_ID [--kill]` prints `pid` lines (and kills them with --kill).
"""

import os
import signal
import sys
import time


def run_pids(run_id):
    """PIDs on this host whose environment has DDPLAUNCH_RUN_ID=run_id (not this process)."""
    tag = b"DDPLAUNCH_RUN_ID=" + run_id.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if tag in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def reap(run_id, grace=5.0):
    """SIGTERM every process of the run, then SIGKILL what is left after `grace` seconds."""
    pids = run_pids(run_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.1)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    rid = sys.argv[1]
    if "--kill" in sys.argv:
        reap(rid)
    left = [p for p in run_pids(rid) if _alive(p)]
    print(" ".join(map(str, left)) or "none")
