"""Words for bash: the one place that quotes a value for a shell on a host.

User data is always quoted (`shlex.quote`); `Raw` fragments, built by ddplaunch itself, pass as
they are; the plan's typed words (plan.py) are resolved on the host: `HostPath` under `$HOME`,
`GpuCount` by asking the host's torch, `CpuShare` from the host's cores. Pure.
"""

from __future__ import annotations

import shlex

from ddplaunch.plan import CpuShare, GpuCount, HostPath

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
        return f'"$({shlex.quote(str(value))} -c {shlex.quote(_GPU_PROBE)})"'
    if isinstance(value, CpuShare):
        n = int(value)
        return f'"$(c=$(nproc); echo $(( c / {n} > 1 ? c / {n} : 1 )))"'
    return shlex.quote(value)
