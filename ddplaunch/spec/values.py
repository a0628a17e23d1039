"""The spec's value types: the checks of single values (printable lines, environment names,
host names and addresses, Slurm names and times, interpreters) as annotated types, which
environment names and values are secret, and the container runtimes with what each one is
(`Runtime`, `RUNTIMES`). Pure; spec/model.py builds its models from these."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Union

from pydantic import AfterValidator

from ddplaunch.spec.yamlsafe import char_name, show

SECRET_SHOWN = "<secret>"


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SLURM_TIME = re.compile(r"(?:[0-9]+-)?[0-9]+(?::[0-9]+){0,2}|UNLIMITED|INFINITE|unlimited|infinite")


def _printable(value: str) -> str:
    """Values that reach a shell line or an `#SBATCH` line: no newline or other control character."""
    bad = _CONTROL.search(value)
    if bad:
        raise ValueError(f"{char_name(bad.group())} at character {bad.start() + 1}; a command or "
                         "#SBATCH line cannot hold it")
    return value


def _no_nul(value: str) -> str:
    """Process arguments and environment values cannot hold NUL."""
    if "\0" in value:
        raise ValueError("contains a NUL character, which no process argument can hold")
    return value


def _shaped(pattern: str, what: str) -> AfterValidator:
    rx = re.compile(pattern)

    def check(value: str) -> str:
        _printable(value)
        if not rx.fullmatch(value) or value in (".", ".."):
            raise ValueError(f"{show(value)!r} is not {what}")
        return value

    return AfterValidator(check)


def _env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise ValueError(f"{show(value)!r} is not a valid environment variable name "
                         "(letters, digits and _, not starting with a digit)")
    return value


#: The variables ddplaunch sets for every rank: the run's tag (which `down` and the reaper trust),
#: the stage, host, rendezvous and recovery facts. Others under DDPLAUNCH_ (DDPLAUNCH_CKPT_DIR, the
#: test hooks) are the user's to set.
RESERVED_ENV = frozenset(f"DDPLAUNCH_{n}" for n in ("RUN_ID", "STAGE", "HOST", "NODE", "DIST_TIMEOUT",
                                                    "DIST_BACKEND", "RECOVERY", "MASTER_ADDR"))


def _user_env_name(value: str) -> str:
    """A name the spec may set: not one that ddplaunch sets itself."""
    _env_name(value)
    if value.upper() in RESERVED_ENV:
        raise ValueError(f"{show(value)!r} is set by ddplaunch for every rank (DDPLAUNCH_RUN_ID tags the "
                         "run's processes); use another name")
    return value


def _interpreter(value: str) -> str:
    """`python:`: a path or a command name, never something `exec` would read as an option."""
    _printable(value)
    if not value.strip() or value.startswith("-"):
        raise ValueError(f"{show(value)!r} is not an interpreter: give a path (/opt/venv/bin/python) or a "
                         "command name (python3)")
    return value


def _sbatch_option(value: str) -> str:
    _printable(value)
    if not value.startswith("--"):
        raise ValueError(f"{show(value)!r} must be an sbatch option starting with -- (e.g. --exclusive)")
    return value


Line = Annotated[str, AfterValidator(_printable)]
Arg = Annotated[str, AfterValidator(_no_nul)]
EnvName = Annotated[str, AfterValidator(_env_name)]
UserEnvName = Annotated[str, AfterValidator(_user_env_name)]
Interpreter = Annotated[str, AfterValidator(_interpreter)]
HostAddr = Annotated[str, _shaped(r"[A-Za-z0-9_.:%\[\]][A-Za-z0-9_.:%\[\]-]{0,252}",
                                  "a host address (a name or IP: letters, digits, . _ - : % [ ])")]
HostName = Annotated[str, _shaped(r"[A-Za-z0-9_.-]{1,253}", "a host name (letters, digits, . _ -)")]
UserName = Annotated[str, _shaped(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?",
                                  "a user name (letters, digits, _ . -, starting with a letter or _)")]
SlurmName = Annotated[str, _shaped(r"[A-Za-z0-9_.+-]{1,200}", "a Slurm name (letters, digits, _ . + -)")]
SlurmNames = Annotated[str, _shaped(r"[A-Za-z0-9_.+-]{1,200}(?:,[A-Za-z0-9_.+-]{1,200})*",
                                    "a Slurm partition or comma-separated list of them")]
SlurmTime = Annotated[str, _shaped(_SLURM_TIME.pattern, "a Slurm time limit (MINUTES, MM:SS, HH:MM:SS, "
                                                        "D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)")]
SbatchOption = Annotated[str, AfterValidator(_sbatch_option)]

_SECRET_PARTS = ("SECRET", "PASSW", "CREDENTIAL", "APIKEY", "API_KEY", "PRIVATE")
_SECRET_WORDS = {"PASSPHRASE", "CREDS", "COOKIE"}
#: English words that end in PASS and hold no password.
_PASS_WORDS = {"BYPASS", "COMPASS", "ENCOMPASS", "OVERPASS", "UNDERPASS", "SURPASS", "TRESPASS"}
#: A URL that carries a password: `scheme://user:PASSWORD@host` (DATABASE_URL, a proxy's URL).
_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


def is_secret_name(name: str) -> bool:
    """Whether an env name looks like it holds a secret, whose value ddplaunch never prints.

    Matches (case-insensitively) SECRET, PASSW(ORD), CREDENTIAL, API_KEY/APIKEY and PRIVATE
    anywhere; and, as `_`-separated words: a word ending in TOKEN(S) (not TOKENIZERS) or PASS
    (SSHPASS, PGPASS), PASSPHRASE, CREDS, COOKIE, a word starting with AUTH (AUTHKEY,
    AUTHORIZATION; not AUTHOR), PWD after another word (MYSQL_PWD; not PWD, the working
    directory), and KEY/KEYS or PAT as the last word (OPENAI_KEY, GH_PAT; not KEYBOARD_LAYOUT,
    MONKEY or AWS_ACCESS_KEY_ID).
    """
    upper = name.upper()
    if any(part in upper for part in _SECRET_PARTS):
        return True
    words = upper.split("_")
    if words[-1] in ("KEY", "KEYS") or len(words) > 1 and words[-1] in ("PAT", "PWD"):
        return True
    return any(w.endswith(("TOKEN", "TOKENS")) or w.endswith("PASS") and w not in _PASS_WORDS or w in _SECRET_WORDS
               or w.startswith("AUTH") and (not w.startswith("AUTHOR") or w.startswith("AUTHORIZ")) for w in words)


def is_secret_value(value: str) -> bool:
    """Whether a value says by its shape that it is secret: a URL with a password in it."""
    return bool(_URL_PASSWORD.match(value))


def _mount(value: str) -> str:
    """`SRC:DST[:ro]`: absolute paths, no `,` (a runtime's list separator) and nothing else."""
    parts = value.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")) or \
            not all(p.startswith("/") for p in parts[:2]) or "," in value:
        raise ValueError(f"{show(value)!r} is not a mount: write SRC:DST or SRC:DST:ro (absolute paths, no commas)")
    return value


Mount = Annotated[Line, AfterValidator(_mount)]


class Runtime(StrEnum):
    """A container runtime the ranks can run in (`container.runtime`)."""

    DOCKER = "docker"
    PODMAN = "podman"
    APPTAINER = "apptainer"
    ENROOT = "enroot"
    PYXIS = "pyxis"


@dataclass(frozen=True)
class RuntimeTraits:
    """What a runtime is, for everyone who asks (the plan's renderings, the pre-flight's image
    check and its fix, the teardown, which backends can run it)."""

    #: The command that must be on the host (pyxis: srun, whose plugin it is).
    client: str
    #: Its containers outlive a killed client: each is named and labelled with the run, and the
    #: reaper removes them by label when a run is ended (docker, podman). Its images come from a
    #: registry (`container.pull`).
    named: bool = False
    #: srun runs the whole step in the image (pyxis): no container per node, Slurm only.
    in_step: bool = False
    #: Its image may be a file on the host (a .sif, a .sqsh; enroot: also a name `enroot list`
    #: shows) unless it is a registry's (docker://, oras://, library://).
    local_image: bool = False


#: Every runtime's traits: the one place that says which runtime is which.
RUNTIMES: dict[Runtime, RuntimeTraits] = {
    Runtime.DOCKER: RuntimeTraits("docker", named=True),
    Runtime.PODMAN: RuntimeTraits("podman", named=True),
    Runtime.APPTAINER: RuntimeTraits("apptainer", local_image=True),
    Runtime.ENROOT: RuntimeTraits("enroot", local_image=True),
    Runtime.PYXIS: RuntimeTraits("srun", in_step=True),
}
#: The runtimes that run a container per node (every backend can run them).
PER_NODE_RUNTIMES = tuple(r for r, t in RUNTIMES.items() if not t.in_step)


SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from `4096`, `'64K'`, `'1M'` or `'2G'`.

    Raises:
        ValueError: for anything else.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper().removesuffix("B").removesuffix("I")
    num, suffix = (text[:-1], text[-1]) if text and text[-1] in "KMG" else (text, "")
    if not num.isascii() or not num.isdigit() or len(num) > 15 or int(num) == 0:
        raise ValueError(f"size {show(repr(size), 60)} is not a positive byte count like 4096, 64K, 1M or 1G")
    return int(num) * SIZE_SUFFIXES[suffix]
