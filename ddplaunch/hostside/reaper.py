"""End every process of one run on this host (see procs.py for which processes those are).

Usage: `python - RUN_ID [--term PIDFILE...] [--kill [--now]] [--clean] [--free-checkpoints]
[--containers RUNTIME]` with
procs.py + this source on stdin or `-c`. `--term`: SIGTERM the pids recorded in these files
(torchrun stops its workers) — each pid only after checking it is the run's; a stopped one (a frozen
host's: it cannot act on SIGTERM) is killed, with every stopped process of the run here. `--containers`
(docker, podman): with `--kill`, first remove the run's containers of this user (by their labels:
the run id and uid:gid; never by name). `--kill`: then SIGTERM, and after a grace SIGKILL,
whatever of the run is left (`--now`: SIGKILL at once, for processes that had their SIGTERM).
`--clean`: then remove what of the run's directory may hold what the job printed or its
environment (torchrun's per-rank logs, environment files): the launcher's log has every line,
masked. `--free-checkpoints`: then (once nothing of the run is left) remove the run's checkpoints
from this host's RAM (hostside/ckpt/: its memory tier): at the run's end and at `down`, never
between stages (a relaunch loads from there). Prints one answer line:
`DDPLAUNCH_ANSWER_<nonce> {"before": [...], "left": [...]}`.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

try:
    from ddplaunch.hostside.procs import STOPPED, is_run_process, proc_alive, run_processes, state_of
except ImportError:  # sent to a host as one program: procs.py's source comes first
    pass

GRACE = 5.0
#: Where the checkpoint memory tier keeps a run's versions: hostside/ckpt/layout.py's ram_base
#: (this program is sent alone: the path is spelled here too, and a test holds them equal).
CKPT_RAM = "/dev/shm/ddplaunch-ckpt-{uid}"


def term_pidfiles(run_id: str, paths: list[str]) -> tuple[list[int], list[int]]:
    """SIGTERM the pid in each file, when that pid is the run's; returns the pids signalled and the
    stopped processes of the run killed (a SIGKILLed process is gone only once the kernel ran it)."""
    sent, killed = [], []
    for path in paths:
        try:
            with open(path) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid > 0 and is_run_process(pid, run_id):
            try:
                os.kill(pid, signal.SIGTERM)
                sent.append(pid)
            except OSError:
                pass
    if any(state_of(pid) in STOPPED for pid in sent):  # frozen: it cannot act on SIGTERM, nor its workers
        for pid in run_processes(run_id):
            if state_of(pid) in STOPPED:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except OSError:
                    pass
    return sent, killed


def reap(run_id: str, grace: float = GRACE) -> None:
    """SIGTERM every process of the run, then SIGKILL what is left after `grace` seconds."""
    pids = list(run_processes(run_id))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline:
            pids = [p for p in pids if proc_alive(p)]
            if not pids:
                return
            time.sleep(0.1)


def clean(run_id: str) -> None:
    """Remove the run's torchrun log directories and environment files on this host."""
    run_dir = os.path.join(os.path.expanduser("~"), ".ddplaunch", "runs", run_id)
    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(run_dir, name)
        if name.startswith("torchrun-") and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".env") or ".env." in name:
            try:
                os.unlink(path)
            except OSError:
                pass


def free_checkpoints(run_id: str, ram: str = CKPT_RAM) -> bool:
    """Remove the run's checkpoints from this host's RAM (every host's part this machine holds);
    whether there were any. `run_id` is one path component (the run ids ddplaunch makes are)."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        return False
    path = os.path.join(ram.format(uid=os.getuid()), run_id)
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def remove_containers(run_id: str, runtime: str | None) -> list[str]:
    """Remove (stopping them) the containers of this run and this user; their ids."""
    if runtime not in ("docker", "podman") or shutil.which(runtime) is None:
        return []
    labels = [f"label=ddplaunch.run={run_id}", f"label=ddplaunch.user={os.getuid()}:{os.getgid()}"]
    try:
        found = subprocess.run([runtime, "ps", "-aq", "--filter", labels[0], "--filter", labels[1]],
                               capture_output=True, text=True, timeout=30).stdout.split()
        if found:
            subprocess.run([runtime, "rm", "-f", *found], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return found


def wait_gone(run_id: str, pids: list[int], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and any(proc_alive(p) for p in pids):
        time.sleep(0.1)


def main(argv: list[str]) -> None:
    nonce, run_id, rest = argv[0], argv[1], argv[2:]
    kill, tidy, now = "--kill" in rest, "--clean" in rest, "--now" in rest
    free = "--free-checkpoints" in rest
    runtime = rest[rest.index("--containers") + 1] if "--containers" in rest[:-1] else None
    if runtime is not None:
        rest = [a for a in rest if a not in ("--containers", runtime)]
    files = rest[rest.index("--term") + 1:] if "--term" in rest else []
    files = [f for f in files if f not in ("--kill", "--clean", "--now", "--free-checkpoints")]
    before = sorted(run_processes(run_id))
    sent, killed = term_pidfiles(run_id, files)
    if killed:
        wait_gone(run_id, killed, GRACE)
    if sent and not now:
        wait_gone(run_id, sent, GRACE * 2)
    containers = remove_containers(run_id, runtime) if kill else []
    if kill:
        reap(run_id, 0.0 if now else GRACE)
    left = sorted(run_processes(run_id))
    if tidy and not left:
        clean(run_id)
    freed = free and not left and free_checkpoints(run_id)
    print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps({"before": before, "termed": sent, "left": left,
                                                     "containers": containers, "freed": freed}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
