"""The ranks' payloads: one schema for every machine-readable line a rank prints
(``DDPLAUNCH_<KIND>_JSON {...}``) and every message it sends its node's agent (agent.py).

Written by entry.py and steptiming.py (``say``, ``to_agent``), read by ddplaunch with
``read_payload`` (ddplaunch/output/stagelines.py). Standard library only: this file runs on the
hosts, loaded beside entry.py by its path.
"""

import dataclasses
import json
import os
import socket
import sys
from typing import Any, ClassVar, Optional

#: The environment variable that names the node's agent (the node's shell sets it).
AGENT_ENV = "DDPLAUNCH_AGENT"


@dataclasses.dataclass
class RankStart:  # a worker started under torchrun: its host and pid (the OOM killer names pids), restart
    KIND: ClassVar[str] = "RANKSTART"
    rank: int
    pid: int = 0
    local_rank: int = 0
    restart: int = 0
    host: str = ""


@dataclasses.dataclass
class RankExit:  # the script returned, exited or raised with this code; the process leaves next
    KIND: ClassVar[str] = "RANKEXIT"
    rank: int
    code: int


@dataclasses.dataclass
class RankFailed:  # the script raised: the exception's type and message, the line it came from
    KIND: ClassVar[str] = "RANKFAILED"
    rank: int
    exc_type: str
    message: str
    file: str = ""
    line: int = 0


@dataclasses.dataclass
class StepsDone:  # rank 0's optimizer steps so far (at most once a second, and at exit)
    KIND: ClassVar[str] = "PROGRESS"
    rank: int
    steps: int
    saving_s: float = 0.0  # seconds inside its checkpoint saves, up to its newest step
    saves: int = 0  # the checkpoint saves those seconds were spent in


@dataclasses.dataclass
class Loaded:  # rank 0 loaded a checkpoint (torch.load, torch.distributed.checkpoint.load, ddplaunch.checkpoint)
    KIND: ClassVar[str] = "LOADED"
    rank: int
    path: str
    via: str = ""
    # ddplaunch.checkpoint's loads also say: the step; where it was read ("memory" or "durable");
    # the host whose RAM held it, and the host that saved it (another one's for a buddy's replica)
    step: Optional[int] = None
    source: str = ""
    host: str = ""
    origin: str = ""


#: Where a checkpoint's dict keeps its step: Lightning, nanoGPT, most hand-written loops.
STEP_KEYS = ("global_step", "iter_num", "step")


def step_in(state: Any) -> Optional[int]:
    """The step a loaded checkpoint (a dict) names, for `Loaded.step`; None when it names none."""
    if isinstance(state, dict):
        for key in STEP_KEYS:
            value = state.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return None


@dataclasses.dataclass
class Durable:  # a rank that saved through ddplaunch.checkpoint, at its exit: its newest save is durable
    KIND: ClassVar[str] = "DURABLE"
    rank: int
    step: int
    after_s: float  # seconds the exit waited for it, after the script ended
    failed: str = ""  # why its newest save could not be made durable ("": it is)


@dataclasses.dataclass
class Held:  # rank 0 holds before its first optimizer step after the checkpoint it saved (HOLD_FILE)
    KIND: ClassVar[str] = "HELD"
    rank: int
    steps: int
    path: Optional[str] = None


@dataclasses.dataclass
class Timing:  # a rank's step timing (steptiming.py): [step, step_s, wait_s] per optimizer step
    KIND: ClassVar[str] = "TIMING"
    rank: int
    steps: list[Any]


@dataclasses.dataclass
class HostWindow:  # a node's agent, per window of steps: each rank's medians of [compute_s, wait_s, step_s],
    # then its trimmed-mean compute_s and that mean's standard error
    KIND: ClassVar[str] = "WINDOW"
    first: int
    last: int
    ranks: dict[str, Any]
    silent: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class HostSteps:  # a node's agent, every few seconds: newest step, median step time and wait, slowest rank
    KIND: ClassVar[str] = "HOSTSTEPS"
    step: int
    step_s: float
    wait_s: float
    ranks: int
    worst: list[Any]


@dataclasses.dataclass
class HostFrozen:  # a node's agent, when it changes: its ranks that cannot run (rank -> [state, pid]), of how many
    KIND: ClassVar[str] = "FROZEN"
    ranks: dict[str, Any]
    of: int

    def states(self) -> dict[int, tuple[str, int]]:
        """rank -> (state letter, pid), of the well-formed entries (a line is read from a host)."""
        return {int(r): (str(v[0]), int(v[1])) for r, v in self.ranks.items()
                if r.isdigit() and isinstance(v, list) and len(v) == 2 and isinstance(v[1], int)}


PAYLOADS = {cls.KIND: cls for cls in (RankStart, RankExit, RankFailed, StepsDone, Loaded, Durable, Held, Timing,
                                      HostWindow, HostSteps, HostFrozen)}
_TYPES: dict[Any, Any] = {int: int, str: str, float: (int, float), list[Any]: list, dict[str, Any]: dict,
                          Optional[str]: (str, type(None)), Optional[int]: (int, type(None))}


def payload_line(payload: Any) -> str:
    """The line a payload is printed as (with its newline)."""
    return f"DDPLAUNCH_{payload.KIND}_JSON " + json.dumps(dataclasses.asdict(payload)) + "\n"


def read_payload(kind: str, text: str) -> Optional[Any]:
    """The payload of kind ``kind`` a line's JSON text holds; None when it is not one (unknown
    kind, not JSON, a field missing or of the wrong type)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    cls = PAYLOADS.get(kind)
    if cls is None or not isinstance(data, dict):
        return None
    fields = [f for f in dataclasses.fields(cls) if f.name in data or
              f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if any(f.name not in data or isinstance(data[f.name], bool) or not isinstance(data[f.name], _TYPES[f.type])
           for f in fields):
        return None
    return cls(**{f.name: data[f.name] for f in fields})


def say(payload: Any) -> None:
    """Print a payload line on stdout (never the job's failure)."""
    try:
        sys.stdout.write(payload_line(payload))
        sys.stdout.flush()
    except Exception:
        pass


def under_torchrun() -> bool:
    """Whether torchrun started this worker (ddplaunch reads the payloads then)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def agent_address(name: str) -> str:
    """The node agent's socket: a name in the abstract namespace (no file, no path-length limit),
    the same for the agent and its node's ranks."""
    return "\0ddplaunch-" + name[-90:]


_agent: list[socket.socket] = []


#: What became of a message for the node's agent: taken; not taken at once (the agent is there but
#: behind: the message is dropped, never written elsewhere — a rank whose reports are dropped is
#: silent to the agent, a finding); no agent to take it (the caller writes its line instead).
SENT, BUSY, ABSENT = "sent", "busy", "absent"


def to_agent(message: dict[str, Any]) -> str:
    """Send `message` to the node's agent (``DDPLAUNCH_AGENT``): SENT, BUSY or ABSENT (see
    above). Never blocks."""
    name = os.environ.get(AGENT_ENV)
    if not name:
        return ABSENT
    if not _agent:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        _agent.append(sock)
    try:
        _agent[0].sendto(json.dumps(message, separators=(",", ":")).encode(), agent_address(name))
        return SENT
    except BlockingIOError:
        return BUSY
    except OSError:
        return ABSENT
