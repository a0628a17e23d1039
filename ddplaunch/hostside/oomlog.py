"""The kernel's word on processes it killed: which of the given pids the OOM killer ended.

Run on a host after a rank or torchrun there died by SIGKILL (`python -c SOURCE NONCE ARGS_JSON`,
standard library only). ARGS: {"pids": [...], "pid_files": [paths relative to the home
directory], "since": epoch seconds}; a pid file's pid (torchrun's, recorded by the node's shell)
is asked about too. Reads the kernel log — /dev/kmsg (every record the ring buffer still holds;
CAP_SYSLOG is needed where kernel.dmesg_restrict is 1), else `dmesg` — and answers
`DDPLAUNCH_ANSWER_<nonce> {"killed": {pid: the kernel's line}, "error": why the log could not be
read, or null}`. Only records since `since` count (a pid number an old OOM kill used is not
taken for this run's process).
"""

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

KILLED_RE = re.compile(r"(?:Out of memory|Memory cgroup out of memory|oom-kill)[^\n]*?Killed process (\d+) \(")
#: dmesg's own format: `[ 1234.567890] message`
DMESG_RE = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$")


def boot_time() -> float:
    """Epoch seconds at boot (the kernel log stamps seconds since then)."""
    with open("/proc/stat") as stat:
        for line in stat:
            if line.startswith("btime "):
                return float(line.split()[1])
    return time.time() - time.monotonic()


def kmsg_records() -> list[tuple[float, str]]:
    """(seconds since boot, message) of every record /dev/kmsg still holds."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    out = []
    try:
        while True:
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == 32:  # EPIPE: a record overwritten while read; go on with the next
                    continue
                raise
            if not raw:
                break
            head, _, message = raw.decode(errors="replace").partition(";")
            fields = head.split(",")
            if len(fields) >= 3 and fields[2].isdigit():
                out.append((int(fields[2]) / 1e6, message.split("\n", 1)[0]))
    finally:
        os.close(fd)
    return out


def dmesg_records() -> list[tuple[float, str]]:
    proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise OSError(proc.stderr.strip() or f"dmesg exited {proc.returncode}")
    return [(float(m.group(1)), m.group(2)) for m in map(DMESG_RE.match, proc.stdout.splitlines()) if m]


def pids_of(args: dict[str, Any]) -> set[int]:
    pids = {int(p) for p in args.get("pids", [])}
    for rel in args.get("pid_files", []):
        try:
            with open(os.path.join(os.path.expanduser("~"), rel)) as f:
                pids.add(int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def main(argv: list[str]) -> None:
    nonce, args = argv[0], json.loads(argv[1])
    pids, since = pids_of(args), float(args.get("since", 0)) - boot_time()
    killed, error = {}, None
    records, errors = None, []
    for read in (kmsg_records, dmesg_records):
        try:
            records = read()
            break
        except (OSError, subprocess.SubprocessError) as err:
            errors.append(f"{read.__name__.split('_')[0]}: {err}")
    if records is None:
        error = "; ".join(errors)
    else:
        for stamp, message in records:
            m = KILLED_RE.search(message)
            if m and int(m.group(1)) in pids and stamp >= since - 5:
                killed[m.group(1)] = message.strip()
    print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps({"killed": killed, "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
