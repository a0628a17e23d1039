"""The fail-fast watcher: how every backend follows a started stage to its end, written once.

A backend starts a stage its own way (SSH sessions, one srun step, a local process) and hands
`follow` a `RunningStage`: which nodes have ended, how to stop the others, which never got as far
as torchrun. The policy is here: when a node fails, the others get `REPORT_GRACE` seconds to
report a failure of their own (a rank that failed at the same time is then told apart from one
that only saw its peer die), then they are stopped; Ctrl-C or a hang stops everyone. Every node
is classified with one vocabulary on every backend (record/results.py): ok, failed (its code, or its
torchrun never started), lost (its host is gone), interrupted (ddplaunch stopped it). After a
confirmed loss the others are stopped at once and get LOST_STOP_GRACE, not `job.stop_grace`.

A host is lost only when the backend's own probe confirms it does not answer (`confirm_lost`):
after its session or step ended without an exit status, or after its node has said nothing — not
even the shell's heartbeat (backends/shell.py) — for `detect` seconds, whatever collective the
survivors are blocked in, and however long their own timeouts are. A node whose command ended
without a status on a host that answers was ended by a signal there (a SIGKILLed or OOM-killed
torchrun, srun's "Killed"): the job's failure, one verdict for one cause on every backend.
"""

from __future__ import annotations

import errno
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol

from ddplaunch.backends.contract import StopEvent
from ddplaunch.hostside.payloads import RankExit, RankFailed, RankStart
from ddplaunch.output.stagelines import StageLines
from ddplaunch.output.torchrun import culprit, is_victim, parse_torchrun_failures, rank_cause
from ddplaunch.plan.launch import LaunchPlan
from ddplaunch.record.results import (FAILED, INTERRUPTED, LOST, OK, RUNNING, UNREACHABLE, NodeOutcome, NodeState,
                                      StageResult)

#: After a node failed, how long the others may report their own failure before they are stopped.
REPORT_GRACE = 2.0
#: Seconds torchrun gets to stop its workers after SIGTERM before the run's processes are killed
#: (`job.stop_grace`; torchrun's own, which the plan hands it: TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
SHUTDOWN_GRACE = 30.0
#: Seconds beyond the grace for the stopped nodes' sessions or steps to end.
SETTLE_SLACK = 5.0
#: The stop grace once a host is lost (instead of `job.stop_grace`): the survivors are blocked in a
#: collective with a dead peer, where a SIGTERM handler (Lightning's) never runs, and the relaunch
#: resumes from the checkpoint anyway; what has not ended by then is killed at once (no second
#: grace: backends' `close`). No report grace either.
LOST_STOP_GRACE = 2.0
POLL_S = 0.1
#: Seconds a node may say nothing (a heartbeat every second) before its host is probed.
DETECT_S = 2.0
#: How long the probe of a silent node's host waits for an answer (a host's kernel answers a TCP
#: connection in well under a millisecond on a cluster's network, however busy the host is).
PROBE_S = 1.0
#: A node silent this long (1.5 heartbeats; less when `detect` is shorter) counts as hushed when
#: the watcher asks whether its own network is the one at fault.
HUSHED_S = 1.5
#: Silent hosts probed at the same time.
MAX_PROBES = 64
#: How long the watcher suspects its own network, not the hosts, when most hosts went silent at
#: once or a probe failed with this machine's own error: no host is called lost meanwhile (a
#: laptop's Wi-Fi or VPN coming back). After that the silent hosts are lost as any other.
SELF_SUSPECT_S = 120.0
#: Seconds between probes while the watcher suspects itself.
RETRY_S = 1.0
#: Errors of a connection attempt that this machine raises itself (a firewall rule, no route, the
#: network down): they say nothing of the host. EHOSTUNREACH is not one: a dead host on the same
#: network gives it too.
LOCAL_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.ENETUNREACH, errno.ENETDOWN, errno.EADDRNOTAVAIL,
                          errno.ENOBUFS})


class NoAnswer(str):
    """Why a host does not answer the probe, and whether the error was this machine's own
    (`local`: the probe could not even leave it, which says nothing of the host)."""

    local: bool

    def __new__(cls, why: str, local: bool = False) -> "NoAnswer":
        self = super().__new__(cls, why)
        self.local = local
        return self


@dataclass(frozen=True)
class NodeEnd:
    """A node's command ended: its exit status, or None when it left none."""

    node: int
    code: Optional[int]
    #: What the backend knows of the end (srun's words, "SSH connection lost").
    how: str = ""
    #: The host itself is gone (its connection or its Slurm node died), not just its command.
    lost: bool = False
    at: float = field(default_factory=time.time)
    #: The backend's probe already said the host does not answer (nothing more to ask).
    confirmed: bool = False


class RunningStage(Protocol):
    """A stage a backend has started on every node of its plan."""

    def poll(self) -> list[NodeEnd]:
        """The nodes that ended since the last call (never blocks)."""

    def stop(self, nodes: list[int]) -> None:
        """Ask these nodes to end: SIGTERM to their torchrun, which stops its workers."""

    def settle(self, nodes: set[int], timeout: float) -> list[NodeEnd]:
        """Wait up to `timeout` for stopped nodes to end; their ends (the rest are ended by
        `close`)."""

    def never_started(self, nodes: list[int]) -> set[int]:
        """Of these stopped nodes, those whose torchrun never started (setup lines still running)."""

    def confirm_lost(self, node: int) -> Optional[str]:
        """A node went silent: why its host counts as gone (it does not answer the backend's own
        probe), or None when it answers after all."""

    def lost(self, node: int) -> None:
        """The node's host is gone: stop waiting for it and talking to it (no stop, no reaping)."""

    def at_fault(self, node: int) -> None:
        """The node's host answers but its ranks are at fault (frozen): stopping the stage does
        not wait for them (they never act on SIGTERM); `close` still ends them."""

    def close(self) -> None:
        """Release the stage's sessions and end whatever of the run is left on its hosts."""


class LossAware:
    """What a RunningStage that talks to remote hosts keeps: the nodes it reported ended, the ones
    the watcher found lost (never waited for or talked to again), and the backend's probe of a
    silent node's host (`unanswered(node)`: why it does not answer, None when it does)."""

    def __init__(self, unanswered: Callable[[int], Optional[str]]):
        self._unanswered = unanswered
        self._seen: set[int] = set()
        self._lost: set[int] = set()
        self._at_fault: set[int] = set()

    def confirm_lost(self, node: int) -> Optional[str]:
        return self._unanswered(node)

    def lost(self, node: int) -> None:
        self._seen.add(node)
        self._lost.add(node)

    def at_fault(self, node: int) -> None:
        self._at_fault.add(node)


def unanswered(addr: str, port: int, timeout: float = PROBE_S) -> Optional[str]:
    """Why `addr` does not answer a TCP connection to `port` (the backend's daemon on the host:
    sshd, slurmd), or None when it does. A host that is down or cut off gives no answer at all;
    only the host's kernel has to answer, so a busy host still does."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except (socket.timeout, TimeoutError):
        return NoAnswer(f"{addr}:{port} gave no answer within {timeout:g}s")
    except OSError as err:
        return NoAnswer(f"{addr}:{port} refused or unreachable ({err.strerror or err})", err.errno in LOCAL_ERRNOS)


def unstarted(plan: LaunchPlan, state: NodeState, details: dict[int, str]) -> StageResult:
    """The result of a stage that started nowhere: the nodes in `details` in `state` (unreachable,
    or failed staging), the others never started."""
    now = time.time()
    outcomes = [NodeOutcome(node_rank=n.node_rank, host=n.host_label) for n in plan.nodes]
    for o in outcomes:
        if o.node_rank in details:
            o.state, o.detail, o.ended_at = state, details[o.node_rank], now
    return StageResult(stage=plan.stage, outcomes=outcomes, ran_healthcheck=plan.healthcheck, ended_at=now)


def follow(stage: RunningStage, plan: LaunchPlan, lines: StageLines, stop: StopEvent,
           grace: float = REPORT_GRACE, detect: float = DETECT_S, stop_grace: float = SHUTDOWN_GRACE) -> StageResult:
    """Follow `stage` until every node ended; fail fast; one outcome per node, never just the first.
    A node silent for `detect` seconds whose host the backend cannot reach is lost; stopped nodes
    get `stop_grace` seconds (and a little) to end before `close` kills what is left."""
    watch = _Watch(plan, lines, detect, stop_grace)
    try:
        cause = watch.wait(stage, stop, grace)
        if cause is not None:
            watch.stop_rest(stage, cause)
    finally:
        stage.close()
    return watch.finish()


class _Watch:
    def __init__(self, plan: LaunchPlan, lines: StageLines, detect: float, stop_grace: float):
        self.plan, self.lines, self.detect, self.stop_grace = plan, lines, detect, stop_grace
        #: When a silent node's host last answered the backend's probe (it is not probed again sooner).
        self._answered: dict[int, float] = {}
        #: Since when (monotonic) the watcher suspects its own network rather than the silent hosts.
        self._suspect_since: Optional[float] = None
        self._suspect_probed = 0.0
        self.result = StageResult(stage=plan.stage, ran_healthcheck=plan.healthcheck,
                                  outcomes=[NodeOutcome(node_rank=n.node_rank, host=n.host_label, state=RUNNING)
                                            for n in plan.nodes])
        self.ended: dict[int, NodeEnd] = {}
        self.first_bad: Optional[NodeEnd] = None
        self.stopped: set[int] = set()
        for o in self.result.outcomes:
            lines.state(o.host, RUNNING)

    def host(self, node: int) -> str:
        return self.result.outcomes[node].host

    def take(self, ends: list[NodeEnd], stage: Optional[RunningStage] = None) -> None:
        for end in ends:
            if end.node in self.ended or not 0 <= end.node < len(self.result.outcomes):
                continue
            if stage is not None and end.code is None and not end.confirmed and end.node not in self.stopped:
                end = self._probed(stage, end)
            self.ended[end.node] = end
            outcome = self.result.outcomes[end.node]
            if end.lost and outcome.last_heard_at is None:
                silent = self.lines.silent_for(end.node)
                outcome.last_heard_at = end.at - silent if silent is not None else end.at
            if end.code != 0 and self.first_bad is None and end.node not in self.stopped:
                self.first_bad = end

    def _probed(self, stage: RunningStage, end: NodeEnd) -> NodeEnd:
        """An end without an exit status decides nothing by itself: the host's answer does."""
        why = stage.confirm_lost(end.node)
        if why is None:
            return replace(end, lost=False, how=f"{end.how or 'no exit status'}; its host answers")
        stage.lost(end.node)
        return replace(end, lost=True, confirmed=True, how=end.how or why)

    def wait(self, stage: RunningStage, stop: StopEvent, grace: float) -> Optional[str]:
        """Until every node ended (None), or the cause to stop the rest for."""
        nodes = len(self.result.outcomes)
        failed_at: Optional[float] = None
        while len(self.ended) < nodes:
            self.take(stage.poll(), stage)
            self.take(self._silent(stage))
            if self.first_bad is not None and failed_at is None:
                failed_at = time.monotonic()
                end = self.first_bad
                what = (f"lost ({end.how})" if end.lost else f"exited with {end.code}" if end.code is not None
                        else f"ended without an exit status ({end.how})" if end.how else "ended without an exit status")
                self.lines.note(f"{self.host(end.node)} (node {end.node}) {what}: stopping every other node")
            if len(self.ended) == nodes:
                return None
            if stop.is_set():
                self.result.interrupted = stop.by_user
                cause = stop.cause or "interrupted by the user"
                self._at_fault(stage, stop.lost)
                self.lines.note(f"{cause}: stopping every node")
                return cause
            if failed_at is not None and (time.monotonic() - failed_at >= grace or self.first_bad is not None
                                          and self.first_bad.lost):
                assert self.first_bad is not None
                return f"{self.host(self.first_bad.node)} (node {self.first_bad.node}) failed"
            time.sleep(POLL_S)
        return None

    def _at_fault(self, stage: RunningStage, hosts: dict[str, str]) -> None:
        """Nodes on hosts the stop names at fault (frozen ranks) end as lost, not stopped: their
        hosts answer, so they are reaped with the others (which kills even a stopped process),
        and not waited for (a frozen torchrun never acts on SIGTERM)."""
        at_fault = [o.node_rank for o in self.result.outcomes if o.host in hosts and o.node_rank not in self.ended]
        for node in at_fault:
            stage.at_fault(node)
        self.take([NodeEnd(node, None, how=hosts[self.host(node)], lost=True, confirmed=True) for node in at_fault])

    def _silent(self, stage: RunningStage) -> list[NodeEnd]:
        """Nodes silent for `detect` seconds whose host does not answer the backend's probe (the
        silent hosts are probed at once: 32 dead hosts cost one probe's timeout, not 32) — unless
        the watcher suspects itself (`_self_suspect`)."""
        out: list[NodeEnd] = []
        mono = time.monotonic()
        silences = self._silences()
        quiet = {n: s for n, s in silences.items() if s is not None and s >= self.detect
                 and (n not in self._answered or mono - self._answered[n] >= self.detect)}
        if self._suspect_since is not None and not any(s is not None and s >= self.hushed
                                                       for s in silences.values()):
            self.lines.note(f"every host is heard from again after {mono - self._suspect_since:.0f}s: none was lost")
            self._suspect_since = None
        if not quiet or self._suspect_since is not None and mono - self._suspect_probed < RETRY_S:
            return out
        with ThreadPoolExecutor(max_workers=min(MAX_PROBES, len(quiet))) as pool:
            answers = dict(zip(quiet, pool.map(stage.confirm_lost, quiet)))
        for node in quiet:
            if answers[node] is None:
                self._answered[node] = mono
        unanswered = {n: why for n, why in answers.items() if why is not None}
        # the others' silence as it is now, after the probes: a dropped network of this machine's
        # has silenced them too by then; a crash of one host has not
        if self._self_suspect(self._silences(), unanswered, time.monotonic()):
            return out
        now = time.time()
        for node, why in unanswered.items():
            silent = quiet[node]
            stage.lost(node)
            self.result.outcomes[node].last_heard_at = now - silent
            out.append(NodeEnd(node, None, how=f"no heartbeat for {silent:.0f}s and {why}", lost=True, confirmed=True))
        return out

    def _silences(self) -> dict[int, Optional[float]]:
        return {n: self.lines.silent_for(n) for n in range(len(self.result.outcomes)) if n not in self.ended}

    @property
    def hushed(self) -> float:
        return min(HUSHED_S, 0.75 * self.detect)

    def _self_suspect(self, silences: dict[int, Optional[float]], unanswered: dict[int, str], mono: float) -> bool:
        """Whether the silence is more likely this machine's than the hosts': a probe failed with
        this machine's own error (or no peer could be asked either), or most running nodes (at
        least 2) are hushed together. Then no host is lost for up to SELF_SUSPECT_S seconds; the
        silent hosts are probed every RETRY_S seconds until they answer."""
        hushed = [n for n, s in silences.items() if s is not None and s >= self.hushed]
        suspect = bool(unanswered) and (any(getattr(why, "local", False) for why in unanswered.values())
                                        or len(hushed) >= 2 and 2 * len(hushed) > len(silences))
        if not suspect:
            return False
        if self._suspect_since is None:
            self._suspect_since = mono
            first = next(iter(unanswered.values()))
            self.lines.note(f"{len(hushed)} of {len(silences)} hosts went silent at once and this machine cannot "
                            f"reach them ({first}): its own network is suspect; no host is called lost for up to "
                            f"{SELF_SUSPECT_S:.0f}s")
        self._suspect_probed = mono
        if mono - self._suspect_since < SELF_SUSPECT_S:
            return True
        self.lines.note(f"this machine has reached none of the silent hosts for {SELF_SUSPECT_S:.0f}s: "
                        "they count as lost")
        return False

    def stop_rest(self, stage: RunningStage, cause: str) -> None:
        rest = [n for n in range(len(self.result.outcomes)) if n not in self.ended]
        self.stopped = set(rest)
        self.lines.mute(set(rest))
        for n in rest:
            o = self.result.outcomes[n]
            o.state, o.detail = INTERRUPTED, f"stopped by ddplaunch: {cause}"
        stage.stop(rest)
        lost = self.first_bad is not None and self.first_bad.lost
        self.take(stage.settle(set(rest), LOST_STOP_GRACE if lost else self.stop_grace + SETTLE_SLACK))
        ran = time.time() - self.result.started_at
        for n in sorted(stage.never_started(rest)):
            o = self.result.outcomes[n]
            o.state, o.never_started = FAILED, True
            o.detail = f"its setup lines were still running {ran:.0f}s after the launch"
            self.lines.note(f"{o.host} (node {n}): torchrun never started (blocked before launch)")

    def finish(self) -> StageResult:
        bad = self.first_bad
        for o in self.result.outcomes:
            end = self.ended.get(o.node_rank)
            o.ended_at = end.at if end is not None else time.time()
            if o.never_started or end is None:
                finish_outcome(o, self.lines, None)
                continue
            if end.code is None and o.state != INTERRUPTED:
                if end.lost:
                    o.state, o.detail = LOST, end.how or "no exit status"
                elif bad is None or bad.node == o.node_rank:  # ended by a signal on a host that answers
                    o.state, o.detail, o.signalled = FAILED, end.how, True
                else:
                    o.state = INTERRUPTED
                    o.detail = f"ended after {self.host(bad.node)} (node {bad.node}) failed"
            finish_outcome(o, self.lines, end.code)
        self.result.ended_at = time.time()
        return self.lines.fill(self.result)


def finish_outcome(outcome: NodeOutcome, lines: StageLines, exit_code: Optional[int]) -> NodeOutcome:
    """Fill an outcome from its exit code and the node's last lines: which rank failed, and why.

    The failing rank is what the node's ranks said of themselves (entry.py's payloads: each rank's
    start and exit, the exception that ended its script), else torchrun's "Root Cause" block (a
    script that bypasses the entry, a rank killed by a signal); its cause is that rank's own last
    lines (its exception), not torchrun's ChildFailedError report.
    """
    outcome.ended_at = outcome.ended_at or time.time()
    outcome.tail = lines.tail(outcome.node_rank)
    outcome.exit_code = exit_code
    if outcome.state in (INTERRUPTED, LOST, UNREACHABLE):
        lines.state(outcome.host, outcome.state, exit_code)
        return outcome
    if not outcome.never_started:
        outcome.state = OK if exit_code == 0 else FAILED
    if exit_code != 0:
        found = _said_culprit(outcome.node_rank, lines) or culprit(parse_torchrun_failures(outcome.tail),
                                                                   lambda rank: [t.body for t in lines.rank_tail(rank)])
        if found:
            outcome.failed_rank, outcome.failed_local_rank, outcome.rank_exit_code = found
            outcome.cause = rank_cause(lines.rank_tail(outcome.failed_rank))
            outcome.victim = is_victim(outcome.cause)
            outcome.failure = next((p for n, p in lines.payloads(RankFailed.KIND)
                                    if n == outcome.node_rank and p.rank == outcome.failed_rank), None)
    lines.state(outcome.host, outcome.state, exit_code)
    return outcome


def _said_culprit(node: int, lines: StageLines) -> Optional[tuple[int, int, Optional[int]]]:
    """(global rank, local rank, exit code) of the node's rank that failed by itself, from what its
    ranks said: each said it started and how its script ended, and one ended non-zero — the one
    whose own words do not say a peer died first, else the first. None when a rank of the node
    ended without a word (a signal, `os._exit`): torchrun's report says more then."""
    starts = {p.rank: p for n, p in lines.payloads(RankStart.KIND) if n == node}
    exits = {p.rank: p.code for n, p in lines.payloads(RankExit.KIND) if n == node}
    failed = [(rank, starts[rank].local_rank, exits[rank]) for rank in starts if exits.get(rank, 0) != 0]
    if not failed or not starts.keys() <= exits.keys():
        return None
    return min(failed, key=lambda f: is_victim(line.body for line in lines.rank_tail(f[0])))
