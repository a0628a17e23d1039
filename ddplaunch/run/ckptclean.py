"""What an earlier, killed run of the same spec left in the hosts' RAM (the checkpoint memory tier,
hostside/ckpt/), freed by the next `up` (or `check`) of that spec before anything runs.

A run frees its checkpoints' RAM at its end (its backend's `close`) and at `down`. A run whose
supervisor was killed outright did neither: its versions stay in /dev/shm on every host until
someone runs `down`. `stale_runs` finds such runs from the records alone: earlier runs of the same
spec file with a `checkpoint:` section whose supervisor is known dead (never a live one's, never one
this machine cannot see), newest first, back to the newest run of the spec that its supervisor ended
(that run freed what was older). `free_stale` runs, through the backend, the reaper that `close`
runs on each host (backends/shell.free_checkpoints_command): each run's newest intact sealed versions
its durable dir lacks are persisted there first, and RAM is freed only where nothing of the run is
left. Best effort, bounded by a timeout; one line says what was done.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddplaunch.backends import scheduler_of
from ddplaunch.backends.contract import Launcher
from ddplaunch.backends.shell import free_checkpoints_command
from ddplaunch.errors import DdplaunchError
from ddplaunch.plan.hostprogram import parse_answer
from ddplaunch.plan.launch import tool_python
from ddplaunch.record.events import RunEnded, last_event
from ddplaunch.record.runs import InJob, Local, RunRecord, list_runs
from ddplaunch.spec.model import ClusterSpec, HostSpec
from ddplaunch.spec.registry import registration

#: The most killed runs one `up` frees (the newest); `down RUN` frees any other.
MAX_STALE = 8
#: Seconds each host may take to answer (it persists what only RAM holds: a copy per part).
FREE_TIMEOUT = 60.0


@dataclass(frozen=True)
class StaleRun:
    """An earlier run of the spec whose supervisor died without freeing its checkpoints' RAM: its
    id and the durable dir its newest sealed versions are persisted to first."""

    run_id: str
    durable: Optional[str]


def spec_file(spec_path: str, base_dir: str) -> Optional[Path]:
    """The spec file a run was started from, as an absolute path (None: not from a file, e.g. the
    Python API's spec object)."""
    if not spec_path or spec_path.startswith("<"):
        return None
    path = Path(spec_path).expanduser()
    return (path if path.is_absolute() else Path(base_dir) / path.name).resolve()


def stale_runs(spec: ClusterSpec, spec_path: str, run_id: str, backend: Optional[Launcher[Any]] = None,
               records: Optional[list[RunRecord]] = None) -> list[StaleRun]:
    """The earlier runs of `spec_path` (not `run_id`) whose checkpoints may still be in the hosts'
    RAM because their supervisor died (see the module's text), newest first; reads records and
    the ends of event logs only. `backend` answers for a run handed to its scheduler (is its job
    still running); without it such a run is left alone."""
    mine = spec_file(spec_path, spec.base_dir)
    if mine is None:
        return []
    found: list[StaleRun] = []
    for record in list_runs() if records is None else records:
        if record.run_id == run_id or spec_file(record.spec_path, record.spec.base_dir) != mine:
            continue
        try:
            last = last_event(record.dir)
        except OSError:
            continue  # its log cannot be read here: whether it ended is not known
        if isinstance(last, RunEnded) and not last.by_scheduler:
            break  # its supervisor ended it and freed its RAM, and what older runs left (at its start)
        if not record.spec.data.get("checkpoint") or _supervisor_alive(record, backend) is not False:
            continue
        found.append(StaleRun(record.run_id, _durable(record, spec)))
        if len(found) == MAX_STALE:
            break
    return found


def _supervisor_alive(record: RunRecord, backend: Optional[Launcher[Any]]) -> Optional[bool]:
    """Whether the run's supervisor still runs; None: not known here (another machine, a host)."""
    placement = record.placement
    if isinstance(placement, Local):
        return placement.alive()
    scheduler = scheduler_of(backend) if backend is not None else None
    if isinstance(placement, InJob) and scheduler is not None:
        try:
            return scheduler.job_running(record)
        except DdplaunchError:
            return None
    return None


def _durable(record: RunRecord, spec: ClusterSpec) -> Optional[str]:
    """The durable dir of the run's own spec (the one it saved for), else this spec's."""
    try:
        return record.spec.validated.checkpoint_durable() or spec.checkpoint_durable()
    except ValueError:
        return spec.checkpoint_durable()


def targets(spec: ClusterSpec) -> Optional[list[HostSpec]]:
    """The hosts asked: the spec's and its listed spares (one may have replaced a lost host); on a
    backend whose scheduler picks the nodes, None: the nodes the backend's probe reaches."""
    if registration(spec.backend).allocates:
        return None
    spares = spec.recovery.spares if isinstance(spec.recovery.spares, list) else []
    return [*spec.hosts, *spares]


def free_stale(spec: ClusterSpec, backend: Launcher[Any], stale: list[StaleRun]) -> list[str]:
    """Free the stale runs' checkpoints from the RAM of every host `targets` names, in one short
    command per host (the reaper of each run, one after the other); one line on what was done,
    none when no host held any of it.

    Raises nothing: a host that does not answer is named (`down` frees it later)."""
    if not stale:
        return []
    nonces: dict[str, list[str]] = {}

    def command(host: HostSpec) -> str:
        text, nonces[host.label] = free_checkpoints_command(tool_python(spec, host),
                                                            [(s.run_id, s.durable) for s in stale])
        return text
    try:
        results = backend.probe(command, timeout=FREE_TIMEOUT, hosts=targets(spec))
    except DdplaunchError as err:
        return [f"checkpoints of earlier runs whose supervisors died ({_ids(stale)}) not freed: {err}"]
    freed, busy, silent = set(), set(), []
    for host, answer, failed in results:
        said = [parse_answer(answer[1], n) for n in nonces.get(host.label, [])] if answer is not None else []
        replies = [a for a in said if isinstance(a, dict)]
        if failed is not None or len(replies) != len(stale):
            silent.append(host.label)
            continue
        freed |= {run.run_id for run, reply in zip(stale, replies) if reply.get("freed")}
        busy |= {run.run_id for run, reply in zip(stale, replies) if reply.get("left")}
    parts = [f"freed from RAM the checkpoints of earlier runs of this spec whose supervisors died "
             f"({_ids(stale, freed)}), their newest sealed versions persisted to the durable dir first"]
    parts = parts if freed else []
    parts += [f"{run.run_id} still has processes: its RAM stays until `ddplaunch down {run.run_id}`"
              for run in stale if run.run_id in busy]
    if silent:
        parts.append(f"{', '.join(silent)} did not answer: what those runs left in its RAM stays until "
                     "`ddplaunch down RUN`")
    return ["; ".join(parts)] if parts else []


def _ids(stale: list[StaleRun], only: Optional[set[str]] = None) -> str:
    return ", ".join(s.run_id for s in stale if only is None or s.run_id in only)


def dry_run_text(spec: ClusterSpec, stale: list[StaleRun]) -> str:
    """What the dry run says of it: which runs' RAM is freed, where, before the first stage."""
    if not stale:
        return ""
    hosts = targets(spec)
    where = "the allocation's nodes" if hosts is None else ", ".join(h.label for h in hosts)
    lines = [f"# before the first stage, on {where}: free from RAM the checkpoints of earlier runs of this spec "
             "whose supervisors died (the reaper with --free-checkpoints, where nothing of the run is left; each "
             "part's newest intact sealed version persisted to the durable dir first):"]
    lines += [f"#   {s.run_id} (durable dir {s.durable})" for s in stale]
    return "\n".join(lines) + "\n"
