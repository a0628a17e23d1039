"""Short programs ddplaunch runs on hosts (probe, reaper, stack dump), and reading their answers.

Each program is hostside/procs.py followed by the program's own source, run as
`PYTHON -c SOURCE NONCE ARGS...`. Its answer is one line `DDPLAUNCH_ANSWER_<nonce> {json}`: a
host's shell start-up files may print anything before or after it (conda, modules, banners, a
racing `pyenv rehash`) and it is never mistaken for the answer. Pure: nothing runs here.
"""

from __future__ import annotations

import json
import re
import secrets
from functools import lru_cache
from typing import Any, Optional, Sequence

from ddplaunch.plan.launch import HOSTSIDE
from ddplaunch.plan.shellword import word


@lru_cache(maxsize=None)
def program_source(name: str) -> str:
    """procs.py and `name`.py as one program (stdlib only)."""
    return (HOSTSIDE / "procs.py").read_text() + "\n" + (HOSTSIDE / f"{name}.py").read_text()


def host_program(name: str, python: str, *args: str, before: Sequence[str] = ()) -> tuple[str, str]:
    """(shell command, nonce) that runs hostside program `name` with `python` and `args`, after the
    words `before` (a container runtime's command: the program runs inside the image)."""
    nonce = secrets.token_hex(6)
    words = [*(word(b) for b in before), word(python), "-c", word(program_source(name)), nonce,
             *(word(a) for a in args)]
    return " ".join(words), nonce


def port_probe(port: int) -> str:
    """Python source that exits 0 when `port` can be listened on as torch's TCPStore binds it
    (SO_REUSEADDR): a listener makes it busy, an earlier listener's connections in TIME_WAIT (the
    pre-flight's own port test) do not."""
    return ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('', {int(port)}))")


def parse_answer(output: str, nonce: str) -> Optional[Any]:
    """The program's JSON answer from everything the host printed, or None if there is none."""
    found = re.findall(rf"^DDPLAUNCH_ANSWER_{re.escape(nonce)} (.*)$", output, re.M)
    if not found:
        return None
    try:
        return json.loads(found[-1])
    except ValueError:
        return None


def marked(command: str) -> tuple[str, str]:
    """(command whose JSON output (e.g. a number) is printed as the answer line, nonce): for plain
    shell commands whose output must be told apart from shell start-up noise."""
    nonce = secrets.token_hex(6)
    return f"printf 'DDPLAUNCH_ANSWER_{nonce} %s\\n' \"$({command})\"", nonce
