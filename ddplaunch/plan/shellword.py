"""Words for bash: the one place that quotes a value for a shell on a host.

User data is always quoted (`shlex.quote`); `Raw` fragments, built by ddplaunch itself, pass as
they are; the plan's typed words (plan/hostwords.py) are resolved on the host: `HostPath` under `$HOME`,
`GpuCount` by asking the host's torch, `CpuShare` from the host's cores, `HostFlags` by a test
there, `HomeBind` and `HostUser` from its home and the user's ids. Pure.
"""

from __future__ import annotations

import re
import shlex

from ddplaunch.plan.hostwords import CpuShare, GpuCount, HomeBind, HostFlags, HostPath, HostUser

#: A network interface's name as `ip link` shows one, and nothing a shell reads as more than a
#: word (a host's probe says which interface it routes through; the SSH session is told it raw).
IFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,31}")

_GPU_PROBE = "import torch; print(torch.cuda.device_count() or 1)"


class Raw(str):
    """A shell fragment built by ddplaunch itself (never from user input): left unquoted."""


def word(value: str) -> str:
    """One word of a command line for bash: user data quoted, the plan's typed words resolved."""
    if isinstance(value, Raw):
        return value
    if isinstance(value, HostPath):
        return '"$HOME"/' + shlex.quote(str(value))
    if isinstance(value, GpuCount):
        if not value:  # no interpreter with torch on the host (a container): the driver counts them
            return '"$(n=$(nvidia-smi -L 2>/dev/null | grep -c ^GPU); echo $(( n > 0 ? n : 1 )))"'
        return f'"$({shlex.quote(str(value))} -c {shlex.quote(_GPU_PROBE)})"'
    if isinstance(value, CpuShare):
        n = int(value)
        return f'"$(c=$(nproc); echo $(( c / {n} > 1 ? c / {n} : 1 )))"'
    if isinstance(value, HostFlags):  # unquoted on purpose: none, or several words (ddplaunch's own)
        return f"$({value.test} && echo {' '.join(shlex.quote(f) for f in value.split())})"
    if isinstance(value, HomeBind):
        path = '"$HOME"/' + shlex.quote(str(value))
        return f"{path}:{path}"
    if isinstance(value, HostUser):
        return f'{shlex.quote(str(value))}"$(id -u):$(id -g)"'
    return shlex.quote(value)
