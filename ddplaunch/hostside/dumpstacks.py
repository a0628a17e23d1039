"""Stack dumps of one run's processes on this host, with py-spy, for the hang watchdog.

Usage: `python - NONCE RUN_ID PYTHON` (procs.py's source first). Dumps every worker of the run
(processes with RANK in their environment), or the torchrun agents when no worker has started.
Prints one answer line `DDPLAUNCH_ANSWER_<nonce> {...}`: py-spy's path, whether workers were
found, and per process its pid, rank, cwd, state (/proc/PID/stat) and threads (or the error); a
frozen process (stopped, or in an uninterruptible wait) is not dumped.
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

try:
    from ddplaunch.hostside.procs import FROZEN, run_processes, state_of
except ImportError:  # sent to a host as one program: procs.py's source comes first
    pass


def find_py_spy(python: str) -> tuple[str | None, list[str]]:
    candidates = [os.path.join(os.path.dirname(python), "py-spy"), shutil.which("py-spy")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None), [c for c in candidates if c]


def dump(spy: str, proc: dict[str, Any]) -> dict[str, Any]:
    if proc["state"] in FROZEN:
        proc["error"] = f"not dumped: the process is frozen (state {proc['state']})"
        return proc
    try:
        out = subprocess.run([spy, "dump", "--pid", str(proc["pid"]), "--json"], capture_output=True,
                             text=True, timeout=25)
        if out.returncode == 0:
            proc["threads"] = json.loads(out.stdout)
        else:
            proc["error"] = (out.stderr or out.stdout).strip()[-500:]
    except Exception as err:  # noqa: BLE001 - reported, never raised
        proc["error"] = f"{type(err).__name__}: {err}"
    return proc


def main(argv: list[str]) -> None:
    nonce, run_id, python = argv[:3]
    procs = []
    for pid, env in run_processes(run_id).items():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        rank = env.get(b"RANK")
        procs.append({"pid": pid, "cwd": cwd, "rank": int(rank) if rank else None,
                      "local_rank": int(env.get(b"LOCAL_RANK", b"-1")), "state": state_of(pid)})
    workers = [p for p in procs if p["rank"] is not None]
    targets = workers or procs  # no worker yet (torchrun still in rendezvous): the agents
    spy, looked = find_py_spy(python)
    if spy:
        with ThreadPoolExecutor(max(1, min(32, len(targets)))) as pool:
            targets = list(pool.map(lambda p: dump(spy, p), targets))
    print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps({"py_spy": spy, "looked_for": looked,
                                                      "workers": bool(workers), "procs": targets}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
