"""Reading torchrun's and PyTorch's output: the one place that knows their log formats.

torchrun's "Root Cause" block names the failing rank and its exit code; PyTorch's collective
consistency check and store errors are condensed into one line each; a rank's own exception is
cut out of its per-rank lines for the failure summary.
"""

from __future__ import annotations

import re
import signal
from typing import Callable, Iterable, Optional, Sequence

from ddplaunch.output.who import OutputLine

PAYLOAD_RE = re.compile(r"\bDDPLAUNCH_([A-Z]+)_JSON (\{.*\})\s*$")
_RANK_RE = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT_RE = re.compile(r"\bexitcode\s*:\s*(-?\d+)")
#: Lines worth repeating in the summary however far they scrolled: PyTorch's collective
#: consistency check (TORCH_DISTRIBUTED_DEBUG=DETAIL) and rendezvous/store timeouts.
FINDING_RE = re.compile(r"Detected mismatch between collectives|DistStoreError|DistNetworkError")
MAX_FINDINGS = 50
#: Lines ddplaunch keeps off the terminal (still in the run's log): torchrun's per-run banner
#: repeated on every host after the first, and warnings about our own sim/launch plumbing.
NOISE_RE = re.compile(r"Setting OMP_NUM_THREADS environment variable for each process|"
                      r"\*{20,}|The hostname of the client socket cannot be retrieved")


#: What a node's shell prints every second while it runs (backends/shell.py): its host is alive.
HEARTBEAT = "DDPLAUNCH_ALIVE"
#: A training job's progress, by the convention jobs/train.py and jobs/fsdp_train.py follow: a
#: completed step prints `step=N ...`; a resumed run first says `resumed from PATH at step N`.
STEP_RE = re.compile(r"\bstep=(\d+)\b")
RESUMED_RE = re.compile(r"\bresumed from \S+ at step (\d+)")

#: A rank's own words when it failed only because another rank died first.
VICTIM_RE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing|"
                       r"Broken pipe|DistBackendError|failed to recv|Socket Timeout")


def parse_torchrun_failures(lines: list[str]) -> list[tuple[int, int, Optional[int]]]:
    """Every failed rank torchrun reports, its "Root Cause" first: (global rank, local rank, exit code)."""
    start = next((i for i, line in enumerate(lines) if "Root Cause" in line), None)
    if start is None:
        return []
    block_start = max((i for i, line in enumerate(lines[:start]) if "Failures:" in line), default=start)
    out: list[tuple[int, int, Optional[int]]] = []
    rank = None
    for line in lines[start:] + lines[block_start:start]:
        if (m := _RANK_RE.search(line)):
            rank = (int(m.group(1)), int(m.group(2)))
        elif (m := _EXIT_RE.search(line)) and rank is not None:
            entry = (*rank, int(m.group(1)))
            if entry[0] not in [e[0] for e in out]:
                out.append(entry)
            rank = None
    return out


def culprit(failures: list[tuple[int, int, Optional[int]]],
            own_words: Callable[[int], Iterable[str]]) -> Optional[tuple[int, int, Optional[int]]]:
    """The failed rank that failed first in fact: torchrun's root cause has one-second resolution
    and often names a rank that only saw its peer die; prefer a rank whose own last lines do not
    say so (`own_words(rank)` gives their text), nor was ended by torchrun itself (it SIGTERMs a
    node's other workers once one failed; such a rank has nothing to say)."""
    for entry in failures:
        stopped = entry[2] == -signal.SIGTERM and len(failures) > 1
        if not stopped and not is_victim(own_words(entry[0])):
            return entry
    return failures[0] if failures else None


def is_victim(texts: Iterable[str]) -> bool:
    """Whether a rank's own last lines (their text) say it failed only because another rank died first."""
    return any(VICTIM_RE.search(text) for text in texts)


#: torch's trailer of an error raised in a Future's callback (a DDP comm hook's, ours included):
#: `At:` and the callback's Python frames, after the error itself.
#: torch's own prefix of a rank's error lines (`[rank0]: `, sometimes twice).
_TORCH_RANK_RE = re.compile(r"^(\[rank\d+\]: )+")
_AT_RE = re.compile(r"^(\[rank\d+\]: )*At:\s*$")
_AT_FRAME_RE = re.compile(r"^(\[rank\d+\]: )*(\s+\S.*\(\d+\): \S.*)?\s*$")


def rank_cause(lines: Sequence[OutputLine], keep: int = 12) -> list[str]:
    """A rank's own account of its failure (the text of its lines): its last traceback, else its
    last lines; never the frame list a callback's error ends with (the error is above it)."""
    text = [line.body for line in lines]
    at = max((i for i, line in enumerate(text) if _AT_RE.match(line)), default=None)
    if at is not None:
        end = next((j for j in range(at + 1, len(text)) if not _AT_FRAME_RE.match(text[j])), len(text))
        text = text[:at] + text[end:]
    starts = [i for i, line in enumerate(text)
              if _TORCH_RANK_RE.sub("", line).startswith("Traceback (most recent call last)")]
    if starts:
        block = text[starts[-1]:]
        # the frames are long; the exception (last lines) is what people need
        return block[:1] + block[-(keep - 1):] if len(block) > keep else block
    return text[-keep:]


_FP_RE = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\((.*?)(?=, but Rank|\.Collectives|$)")
_STORE_RE = re.compile(r"(torch\.distributed\.)?(DistStoreError|DistNetworkError): (.*)")
_FIELD_RE = re.compile(r"(OpType)=([A-Z_]+)|(TensorShape)=(\[[^\]]*\])|(TensorDtypes)=(\w+)")


def finding_lines(findings: Sequence[OutputLine]) -> list[str]:
    """The findings (FINDING_RE's lines) as the summary repeats them: PyTorch's collective
    mismatches, then rendezvous/store timeouts, one short line each."""
    return _mismatches(findings) + _store_errors(findings)


def _mismatches(findings: Sequence[OutputLine]) -> list[str]:
    """PyTorch's collective mismatch errors, one short line per reporting rank, with its host:
    `dlt1 rank 0: collective mismatch: rank 0 ALLREDUCE [8] Double vs rank 1 ALLREDUCE [4] Float`."""
    out = []
    for line in findings:
        if "Detected mismatch between collectives" not in line.body:
            continue
        who = f"{line.host} rank {line.rank}" if line.rank is not None else "?"
        sides = []
        for rank, fp in _FP_RE.findall(line.body):
            fields = {}
            for m in _FIELD_RE.finditer(fp):
                key = next(g for g in m.groups()[0::2] if g)
                fields[key] = next(g for g in m.groups()[1::2] if g)
            sides.append(" ".join(x for x in (f"rank {rank}", fields.get("OpType"), fields.get("TensorShape"),
                                               fields.get("TensorDtypes")) if x))
        detail = " vs ".join(sides) if sides else line.body.split("Detected mismatch", 1)[1][:200]
        text = f"{who}: collective mismatch (TORCH_DISTRIBUTED_DEBUG=DETAIL): {detail}"
        if text not in out:
            out.append(text)
    return out


def _store_errors(findings: Sequence[OutputLine]) -> list[str]:
    """Rendezvous/store timeouts (a host that never joined), one per host and message."""
    out = []
    for line in findings:
        m = _STORE_RE.search(line.body)
        if m is None:
            continue
        who = line.host if line.rank is None else f"{line.host} rank {line.rank}"
        text = f"{who}: {m.group(2)}: {m.group(3).strip()}"
        if text not in out:
            out.append(text)
    return out
