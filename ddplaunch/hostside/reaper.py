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
masked. `--free-checkpoints [--durable DIR]`: then (once nothing of the run is left) remove the
run's checkpoints from this host's RAM (hostside/ckpt/: its memory tier): at the run's end and at
`down`, never between stages (a relaunch loads from there); first, each part's newest sealed RAM
version that DIR lacks (a job stopped by a signal before its tier persisted it, a run killed
outright) is written there, intact copies only, as the tier writes it. Prints one answer line:
`DDPLAUNCH_ANSWER_<nonce> {"before": [...], "left": [...]}`.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib

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


def free_checkpoints(run_id: str, ram: str = CKPT_RAM, durable: str | None = None) -> bool:
    """Remove the run's checkpoints from this host's RAM (every host's part this machine holds),
    after persisting to `durable` what only RAM holds; whether there were any. `run_id` is one path
    component (the run ids ddplaunch makes are)."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        return False
    path = os.path.join(ram.format(uid=os.getuid()), run_id)
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    if durable:
        persist_sealed(path, durable)
    shutil.rmtree(path, ignore_errors=True)
    return True


#: The tier's names (hostside/ckpt/layout.py; a test holds them equal).
CKPT_VERSION, CKPT_STEP, CKPT_FILES = re.compile(r"v-(\d{12})"), "step-{:012d}", ("data", "meta")


def persist_sealed(run_ram: str, durable: str) -> list[str]:
    """Each part's newest sealed version in a run's RAM here (own saves and replicas) whose files
    match its manifest, when `durable` lacks it (and no newer), written there as the tier writes it: a temporary
    directory, every file fsynced, the manifest last, renamed into `step-N/part-R`. What it wrote."""
    by_part: dict[int, list[tuple[int, str]]] = {}
    for part_dir in _part_dirs(run_ram):
        for m in map(CKPT_VERSION.fullmatch, _names(part_dir)):
            version = os.path.join(part_dir, m.group(0)) if m else ""
            if m and os.path.isfile(os.path.join(version, "MANIFEST")):
                by_part.setdefault(int(os.path.basename(part_dir)[5:]), []).append((int(m.group(1)), version))
    wrote = []
    for part, versions in sorted(by_part.items()):
        for step, version in sorted(versions, reverse=True):  # the newest intact one the durable dir lacks
            final = os.path.join(durable, CKPT_STEP.format(step), f"part-{part}")
            if os.path.isfile(os.path.join(final, "MANIFEST")):
                break
            if _intact(version):
                try:
                    _careful_copy(version, final, part)
                    wrote.append(final)
                except OSError:
                    pass  # the durable dir cannot take it here: freed all the same, as before
                break
    return wrote


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _part_dirs(run_ram: str) -> list[str]:
    """Every part directory of a run's RAM here: each host's own, and the replicas it holds."""
    out = []
    for host in _names(run_ram):
        bases = [os.path.join(run_ram, host)]
        bases += [os.path.join(run_ram, host, "replicas", o) for o in _names(os.path.join(run_ram, host, "replicas"))]
        # the job-dir versions (part 1000000, ckpt/jobfiles.py) are the watch's: persisted as the job's files
        out += [os.path.join(b, n) for b in bases for n in _names(b) if re.fullmatch(r"part-\d{1,6}", n)]
    return out


def _intact(version: str) -> bool:
    """Whether a version's files match its manifest (sizes and CRC-32)."""
    try:
        with open(os.path.join(version, "MANIFEST"), "rb") as f:
            files = json.loads(f.read(1 << 20))["files"]
        for name in CKPT_FILES:
            crc, size = 0, 0
            with open(os.path.join(version, name), "rb") as f:
                while chunk := f.read(8 << 20):
                    crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            if (size, crc) != (files[name]["bytes"], files[name]["crc32"]):
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _careful_copy(version: str, final: str, part: int) -> None:
    step_dir = os.path.dirname(final)
    os.makedirs(step_dir, mode=0o700, exist_ok=True)
    tmp = os.path.join(step_dir, f".tmp-part-{part}-reaper-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    for name in (*CKPT_FILES, "MANIFEST"):  # the manifest last
        with open(os.path.join(version, name), "rb") as src:
            fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                while chunk := src.read(8 << 20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in (tmp, None):
        if directory is None:
            os.rename(tmp, final)
            directory = step_dir
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    durable = rest[rest.index("--durable") + 1] if "--durable" in rest[:-1] else None
    if durable is not None:
        rest = [a for a in rest if a not in ("--durable", durable)]
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
    freed = free and not left and free_checkpoints(run_id, durable=durable)
    print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps({"before": before, "termed": sent, "left": left,
                                                     "containers": containers, "freed": freed}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
