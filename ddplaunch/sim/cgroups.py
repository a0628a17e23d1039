"""CPU limits for a sim host: every process of it in one cgroup with a CPU bandwidth quota.

`sim fault HOST --slow PERCENT` puts every process in the host's network namespace (its sshd,
slurmd and what they started; what they start later inherits it) into a cgroup named
`ddplaunch-sim-<prefix>-<host>` whose processes together get PERCENT % of one CPU (CFS bandwidth:
cgroup v1's cpu.cfs_quota_us, or v2's cpu.max). `--clear` moves them back and removes it; `sim
down` removes what is left of a prefix's cgroups.
"""

from __future__ import annotations

import errno
from pathlib import Path

from ddplaunch.sim.proc import SimError

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _base() -> tuple[Path, bool]:
    """(the cpu hierarchy's root, whether it is cgroup v2)."""
    if (ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return ROOT / "cpu", False
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return ROOT, True
    raise SimError("no cgroup cpu controller here (neither /sys/fs/cgroup/cpu of cgroup v1 nor cpu in "
                   "/sys/fs/cgroup/cgroup.controllers of v2): --slow needs one")


def group_name(prefix: str, host: str) -> str:
    return f"ddplaunch-sim-{prefix}-{host}"


def limit(name: str, pids: list[int], percent: int) -> None:
    """Put `pids` into cgroup `name`, limited to `percent` % of one CPU together."""
    base, v2 = _base()
    group = base / name
    try:
        if v2:
            control = base / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        group.mkdir(exist_ok=True)
        quota = max(1000, PERIOD_US * percent // 100)
        if v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        _move(pids, group)
    except OSError as err:
        raise SimError(f"cgroup {group}: {err}") from None


def release(name: str) -> None:
    """Move the processes of cgroup `name` back to the root cgroup and remove it (none is fine)."""
    base, _ = _base()
    if (base / name).exists():
        _remove(base / name, base)


def remove_all(prefix: str) -> None:
    """Remove the cgroups of a prefix's hosts (left when a host was never cleared)."""
    try:
        base, _ = _base()
    except SimError:
        return
    for group in base.glob(group_name(prefix, "*")):
        try:
            _remove(group, base)
        except SimError:
            pass  # a process still in it: `sim down` goes on, as it does with other leftovers


#: Passes of moving a group's processes out before its removal gives up: a process the host forks
#: while one pass moves the others is born inside the group (the kernel then refuses rmdir, EBUSY).
REMOVE_PASSES = 50


def _remove(group: Path, base: Path) -> None:
    err: OSError = OSError("not tried")
    for _ in range(REMOVE_PASSES):
        _move(_members(group), base)
        try:
            group.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise SimError(f"cgroup {group} could not be removed: {e}") from None
            err = e
    raise SimError(f"cgroup {group} could not be removed: {err} (its processes kept forking into it)")


def _members(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _move(pids: list[int], group: Path) -> None:
    for pid in pids:
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass  # ended meanwhile
