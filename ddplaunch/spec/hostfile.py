"""`hosts: {file: PATH}`: the hosts of a DeepSpeed or MPI hostfile, each with its process count.

One host per line, `NAME [slots=N] [max_slots=M]`; `#` starts a comment; blank lines are skipped.
`slots=N` is the host's `nproc` (without it: the spec's `nproc_per_node`), `max_slots` (MPI's
oversubscription cap) is read and not used. The file is read by the same bounded reader as a
spec (yamlsafe.read_text); every problem is a SpecError naming the file, its line and the entry.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Union

from ddplaunch.errors import SpecError
from ddplaunch.spec.hostlist import MAX_HOSTS
from ddplaunch.spec.yamlsafe import read_text, show

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$")
_FIELD = re.compile(r"^(slots|max_slots)=([0-9]{1,6})$")


def read_hostfile(path: Union[str, Path]) -> list[Any]:
    """The hosts of the hostfile at `path`, in its order: a name, or {addr, nproc} with slots.

    Raises:
        SpecError: `file:line: problem` for an unreadable file, a bad entry or no host at all.
    """
    text, shown = read_text(path, "hostfile")
    hosts: list[Any] = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        name, fields = words[0], words[1:]
        if not _NAME.match(name):
            raise SpecError(f"{shown}:{number}: {show(name)!r} is not a host name or address; a line is "
                            "`NAME slots=N`")
        slots = None
        for field in fields:
            found = _FIELD.match(field)
            if not found:
                raise SpecError(f"{shown}:{number}: {show(field)!r}: a line is `NAME slots=N` "
                                "(slots: the processes on that host; max_slots is also read)")
            if found.group(1) == "slots":
                slots = int(found.group(2))
        if slots == 0:
            raise SpecError(f"{shown}:{number}: {show(name)}: slots=0; a host runs at least one process "
                            "(remove the line to leave it out)")
        hosts.append(name if slots is None else {"addr": name, "nproc": slots})
        if len(hosts) > MAX_HOSTS:
            raise SpecError(f"{shown}:{number}: more than {MAX_HOSTS} hosts")
    if not hosts:
        raise SpecError(f"{shown}: no hosts in the file (one per line: `NAME slots=N`)")
    return hosts
