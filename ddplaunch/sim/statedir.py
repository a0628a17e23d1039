"""The sim's state dir and lock: private to us, never followed through a link someone planted.

The state dir holds the client key that root logs in with, so it must be ours alone: `up`
creates it with mkdir(0700) and then checks it through an O_NOFOLLOW descriptor (a directory,
owned by us, not writable by group or others; every parent owned by root or us and not
writable by others unless sticky, like /tmp). An existing one that fails (another user made it
first, a symlink, group-writable) is refused with a SimError. With Slurm the dir is 0711:
munged (user munge) and non-root job users must traverse it to reach munge/munge.socket.2,
etc/slurm.conf and slurm/jobs; the x bit lets them open known names, never list or create
entries, so nothing can be planted. Operations on one prefix are serialized by `prefix_lock`.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddplaunch.sim.proc import SimError

LOCK_TIMEOUT_S = 120.0


@contextmanager
def prefix_lock(prefix: str, suffix: str = "lock", timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Serialize sim operations on one prefix across processes (flock on a /tmp file).

    The lock file is opened without following a symlink and must be ours: one planted by
    another user is refused (SimError), it is never written through.
    """
    path = Path(f"/tmp/ddplaunch-sim-{prefix}.{suffix}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SimError(f"cannot open the sim lock file {path} ({exc.strerror}): if another user "
                       f"created it, remove it (`rm {path}`) and try again") from exc
    with os.fdopen(fd, "r+") as fh:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            raise SimError(f"sim lock file {path} belongs to {_user(owner)}, not to us: "
                           f"remove it (`rm {path}`) and try again")
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    print(f"ddplaunch sim: waiting for {path} (another process uses prefix {prefix!r})",
                          file=sys.stderr, flush=True)
                    told = True
                if time.monotonic() > deadline:
                    raise SimError(f"another process holds {path} for more than {timeout:g}s "
                                   f"(a sim up/down of prefix {prefix!r} is running)") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse(path: Path, why: str) -> SimError:
    return SimError(f"refusing sim state dir {path}: {why}; another user could have planted keys "
                    f"in it that would let them log in as root on the sim hosts. Check and remove it "
                    f"(`rm -rf {path}`), or pass --state-dir with a new path")


def check_state_dir(path: Path) -> None:
    """Raise SimError unless `path` is a real directory (not a symlink), owned by us and not
    writable by group or others. Does not create anything."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SimError(f"sim state dir {path} does not exist") from None
    _check_dir_stat(path, st)


def _check_dir_stat(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"it is a symlink (to {os.readlink(path)})")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"it belongs to {_user(st.st_uid)}, not to {_user(os.geteuid())}")
    if st.st_mode & 0o022:
        raise _refuse(path, f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _check_parents(path: Path) -> None:
    """Every existing parent of `path` (resolved) must be owned by root or us and not writable
    by others unless sticky (like /tmp): else another user could swap the state dir."""
    for parent in [path.parent.resolve(), *path.parent.resolve().parents]:
        st = os.stat(parent)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not sticky):
            raise SimError(f"refusing sim state dir {path}: its parent {parent} ({_user(st.st_uid)}, "
                           f"mode {stat.S_IMODE(st.st_mode):04o}) lets another user replace it: "
                           "pass a --state-dir under directories only root can write (the default "
                           "/tmp/ddplaunch-sim-<prefix> is fine)")


def secure_state_dir(path: Path, mode: int = 0o700) -> bool:
    """Make `path` our private state dir: create it with mkdir(0700), or accept an existing
    one only when it passes `check_state_dir`; then set `mode` (0700, or 0711 for Slurm)
    through an O_NOFOLLOW descriptor. Returns True when this call created it.

    Raises:
        SimError: the dir or a parent is not safe (names it and the fix).
    """
    if mode & 0o022:
        raise SimError(f"internal: state dir mode {mode:04o} would be writable by others")
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_parents(path)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    check_state_dir(path)  # a clear message for a symlink / foreign dir
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # swapped for a symlink since the check
        raise _refuse(path, f"it cannot be opened as a directory ({exc.strerror})") from exc
    try:
        _check_dir_stat(path, os.fstat(fd))  # the object we hold, not a name that may change
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return created
