"""The processes of one run on this host: the one definition every host-side program uses.

A process belongs to run R here when its environment holds `DDPLAUNCH_RUN_ID=R` (every process
ddplaunch starts carries it), it belongs to the user running this program, and it lives in this
program's network namespace (hosts that share one kernel, like the simulated cluster or
containers, each see only their own). Standard library only: backends send this file's source to
the hosts ahead of the program that uses it.
"""

import os


def _environ(pid: int | str) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().split(b"\0")


def _netns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


#: Process states of a rank that cannot run: stopped (SIGSTOP, a debugger), or in an
#: uninterruptible wait (a hung device or file system). py-spy would wait for a stopped one; the
#: node agent says its ranks in these states, and the hang watchdog names them.
FROZEN = ("T", "t", "D")
#: The states of a process that was stopped (SIGSTOP, a debugger): it acts on no signal but
#: SIGKILL and SIGCONT until it is continued.
STOPPED = ("T", "t")
#: What a frozen process's state letter means.
FROZEN_WHY = {"T": "stopped", "t": "stopped by a debugger", "D": "in an uninterruptible wait"}


def state_of(pid: int | str) -> str:
    """The process's state letter from /proc/PID/stat (R, S, D, T, Z, ...), "?" when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def proc_alive(pid: int | str) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    return state_of(pid) not in ("Z", "?")


def run_processes(run_id: str | None = None, any_netns: bool = False) -> dict[int, dict[bytes, bytes]]:
    """{pid: environ dict (bytes -> bytes)} of the run's live processes on this host (any run
    when `run_id` is None), owned by this user, in this network namespace (in any, with
    `any_netns`: hosts that share this kernel, seen from outside them), not this process."""
    me, uid, here = os.getpid(), os.getuid(), _netns("self")
    found: dict[int, dict[bytes, bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid or not any_netns and _netns(name) != here:
                continue
            env = dict(kv.split(b"=", 1) for kv in _environ(name) if b"=" in kv)
        except OSError:
            continue
        tag = env.get(b"DDPLAUNCH_RUN_ID")
        if tag is None or (run_id is not None and tag != run_id.encode()):
            continue
        if proc_alive(name):
            found[int(name)] = env
    return found


def is_run_process(pid: int, run_id: str) -> bool:
    """Whether `pid` is one of the run's processes here (checked before any signal from a pid file)."""
    return pid in run_processes(run_id)
