"""A scripted backend for unit tests of the run loop: the Launcher contract filled without a host.

`FakeBackend` plays each launch from a `StageScript` (when each node ends and how, what its ranks
print: the health check's verdict, restarts) through the real fail-fast watcher and the real
line reading, and answers pre-flight probes with a healthy host's facts (or an unreachable
host's error). `fake_registered(script)` registers it as backend `fake` for one test: no file of
ddplaunch knows it, which is the point.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from ddplaunch.backends.contract import Admitted, CommandFor, HostResult, RunContext, StartGate, StopEvent
from ddplaunch.backends.failfast import NoAnswer, NodeEnd, follow, unstarted
from ddplaunch.errors import BackendError
from ddplaunch.output.stagelines import StageLines
from ddplaunch.output.torchrun import HEARTBEAT
from ddplaunch.plan.launch import LaunchPlan
from ddplaunch.record.results import UNREACHABLE, StageResult
from ddplaunch.record.runs import RunRecord
from ddplaunch.spec import registry
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: How long nodes of a failed stage get to report their own failure (the real backends: 2 s).
GRACE = 0.05


@dataclass
class NodeScript:
    """How one node's launch goes: its exit code after `after` seconds (None: its host is lost)."""

    code: Optional[int] = 0
    after: float = 0.0
    lines: tuple[str, ...] = ()
    #: Stopped before its torchrun started (its setup lines still running).
    never_started: bool = False
    #: Never ends by itself (only when stopped).
    hangs: bool = False
    restarts: int = 0
    #: Goes silent (no heartbeat) after `after` seconds and its host answers no probe: lost.
    silent: bool = False
    #: With `code=None`: its command ended without a status (a signal) on a host that still answers.
    answers: bool = False
    #: Silent (no heartbeat, no answer to the probe) from `quiet_from` for `quiet_for` seconds,
    #: then heard again: the launcher's own network dropped, not the host.
    quiet_from: float = 0.0
    quiet_for: float = 0.0
    #: While quiet, its probe fails with this machine's own error (a firewall rule, no route).
    local: bool = False
    #: Rank 0's optimizer steps, said as the entry says them: one every `step_every` seconds until
    #: `steps_until` (then silent, unless it ends or hangs as said above).
    step_every: float = 0.0
    steps_until: float = 0.0

    def quiet_at(self, elapsed: float) -> bool:
        return self.quiet_from <= elapsed < self.quiet_from + self.quiet_for


@dataclass
class StageScript:
    """One launch: per host label, how its node goes (default: ok at once)."""

    nodes: dict[str, NodeScript] = field(default_factory=dict)
    #: What rank 0 reports when the launch runs the health check (default: ok).
    healthcheck: Optional[dict[str, Any]] = None
    rescheduled: bool = False
    #: Hosts the launch cannot reach (label -> why): nothing starts anywhere, as on the real backends.
    unreachable: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeScript:
    """Every launch of a run, in order, and what the pre-flight finds."""

    stages: list[StageScript] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)
    #: Host labels the backend offers on each call of hosts() (a scheduler's allocation): cycles.
    host_sets: list[list[str]] = field(default_factory=list)
    launched: list[LaunchPlan] = field(default_factory=list)
    probes: int = 0
    #: The last command each host was sent by `probe`.
    commands: dict[str, str] = field(default_factory=dict)
    #: Set on this event during the named launch (index), after its nodes started.
    interrupt_in: Optional[int] = None
    #: Hosts whose ranks the hang watchdog's stack program finds frozen (process state T).
    frozen: set[str] = field(default_factory=set)
    #: The backend runs the pre-flight's probe in a launch's own sessions (as SSH does).
    in_session: bool = False
    #: Hosts whose probe finds the job's script missing in workdir.
    no_script: set[str] = field(default_factory=set)
    #: Hosts a link test finds cut off: they reach no peer, no peer reaches them.
    cut: set[str] = field(default_factory=set)
    #: Link tests run (hostside/linkprobe.py's program sent to the hosts).
    link_tests: int = 0
    #: Every launch's start gate: the probe command each host ran in its session, and what it said.
    gated: list[dict[str, str]] = field(default_factory=list)
    admitted: list[Optional[Admitted]] = field(default_factory=list)


def healthy_facts(host: HostSpec, master_ip: str = "10.0.0.1") -> dict[str, Any]:
    """What hostside/probe.py reports on a healthy host."""
    return {"hostname": host.label, "python": "3.11.2", "executable": "/usr/bin/python3", "torch": "2.13.0",
            "cuda": None, "nccl": None, "gpus": None, "gpu_procs": [], "leftovers": {}, "master_ips": [master_ip],
            "route_iface": "eth0", "route_ip": host.addr, "time": time.time(), "disk_free_gb": 100.0,
            "script_ok": True, "workdir_ok": True}


class FakeBackend:
    """Fills the Launcher contract from a FakeScript."""

    name = "fake"
    max_parallel = 8

    def __init__(self, spec: ClusterSpec, run: RunContext, script: FakeScript):
        self.spec, self.run, self.script = spec, run, script
        self._hosts_calls = 0
        self._current = list(spec.hosts)

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        if not self.script.host_sets or not allocate:
            return list(self._current)
        labels = self.script.host_sets[min(self._hosts_calls, len(self.script.host_sets) - 1)]
        self._hosts_calls += 1
        self._current = [HostSpec(addr=label, name=label) for label in labels]
        return list(self._current)

    def spares(self) -> list[HostSpec]:
        spares = self.spec.recovery.spares
        return list(spares) if isinstance(spares, list) else []

    def allocation_text(self) -> str:
        return ""

    def render(self, plan: LaunchPlan) -> "FakeRequest":
        return FakeRequest(plan)

    def launch(self, request: "FakeRequest", lines: StageLines, stop: StopEvent) -> StageResult:
        index = len(self.script.launched)
        self.script.launched.append(request.plan)
        stage = self.script.stages[index] if index < len(self.script.stages) else StageScript()
        if self.script.interrupt_in == index:
            stop.set()
        if stage.unreachable:
            return unstarted(request.plan, UNREACHABLE, {n.node_rank: stage.unreachable[n.host_label]
                                                         for n in request.plan.nodes if n.host_label in stage.unreachable})
        result = follow(FakeStage(request.plan, stage, lines), request.plan, lines, stop, grace=GRACE,
                        detect=self.spec.recovery.detect_timeout)
        result.rescheduled = stage.rescheduled
        return result

    def reach(self, hosts: list[HostSpec], timeout: float = 30) -> list[HostResult]:
        return [HostResult(h, (0, ""), None) if h.label not in self.script.unreachable else
                HostResult(h, None, BackendError(f"{h.label} ({h.addr}): no answer", fix="plug it in")) for h in hosts]

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        self.script.probes += 1
        out = []
        asked = self._current if hosts is None else hosts
        for host in asked:
            text = self.script.commands[host.label] = command(host)
            if host.label in self.script.unreachable:
                out.append(HostResult(host, None, BackendError(f"{host.label} ({host.addr}): no answer", fix="plug it in")))
                continue
            links = "def serve(srv" in text  # hostside/linkprobe.py
            facts = self._stacks(host) if "def find_py_spy" in text else self._links(host, asked) if links \
                else self._facts(host)
            out.append(HostResult(host, (0, answer_lines(text, facts)), None))
        self.script.link_tests += any("def serve(srv" in self.script.commands[h.label] for h in asked)
        return out

    def _links(self, host: HostSpec, tested: list[HostSpec]) -> dict[str, Any]:
        """The link test's answer: the peers this host reached (none, or none of it, when cut)."""
        peers = [h.addr for h in tested if h.label != host.label and h.label not in self.script.cut]
        return {"reached": [] if host.label in self.script.cut else peers, "came_from": []}

    def _facts(self, host: HostSpec) -> dict[str, Any]:
        return healthy_facts(host) | ({"script_ok": False} if host.label in self.script.no_script else {})

    def _stacks(self, host: HostSpec) -> dict[str, Any]:
        """The hang watchdog's stack program's answer: one worker, frozen when the script says."""
        state = "T" if host.label in self.script.frozen else "S"
        return {"py_spy": None, "looked_for": [], "workers": True,
                "procs": [{"pid": 100, "cwd": "/", "rank": 0, "local_rank": 0, "state": state}]}

    def port_free(self, addr: str, port: int) -> bool:
        return True

    def down(self, record: RunRecord) -> list[str]:
        return [f"{h}: nothing left" for h in record.hosts]

    def close(self) -> None:
        pass


def answer_lines(command: str, facts: dict[str, Any]) -> str:
    """A host program's answer line for every nonce in its command."""
    return "".join(f"DDPLAUNCH_ANSWER_{nonce} {json.dumps(facts)}\n"
                   for nonce in re.findall(r"(?<![0-9a-f])[0-9a-f]{12}(?![0-9a-f])", command))


class SessionFakeBackend(FakeBackend):
    """A FakeBackend whose launches run a start gate (the pre-flight's probe) in their sessions."""

    def launch_gated(self, request: "FakeRequest", lines: StageLines, stop: StopEvent, gate: StartGate
                     ) -> Optional[StageResult]:
        commands = {n.host_label: gate.command(n.host) for n in request.plan.nodes if n.host is not None}
        self.script.gated.append(commands)
        admitted = gate.admit({label: (0, answer_lines(text, self._facts(HostSpec(addr=label, name=label))))
                               for label, text in commands.items()}, {})
        self.script.admitted.append(admitted)
        return self.launch(request, lines, stop) if admitted is not None else None


@dataclass(frozen=True)
class FakeRequest:
    plan: LaunchPlan

    def text(self) -> str:
        return f"# fake launch of {self.plan.stage} on {', '.join(self.plan.hosts)}\n"


class FakeStage:
    """A RunningStage whose nodes end as scripted, printing their scripted lines first."""

    def __init__(self, plan: LaunchPlan, script: StageScript, lines: StageLines):
        self.plan, self.script, self.lines = plan, script, lines
        self.t0 = time.monotonic()
        self.done: set[int] = set()
        self.stopped: set[int] = set()
        self.steps_said = 0
        for node in plan.nodes:
            mine = self.node(node.node_rank)
            if mine.restarts:
                self.say(node.node_rank, f'DDPLAUNCH_RANKSTART_JSON {{"rank": {node.node_rank}, '
                                         f'"restart": {mine.restarts}}}')
        if plan.healthcheck:
            verdict = script.healthcheck or {"ok": True, "world_size": len(plan.nodes), "failures": []}
            self.say(0, "DDPLAUNCH_HEALTHCHECK_JSON " + json.dumps(verdict))

    def node(self, rank: int) -> NodeScript:
        return self.script.nodes.get(self.plan.nodes[rank].host_label, NodeScript())

    def say(self, rank: int, text: str) -> None:
        host = self.plan.nodes[rank].host_label
        self.lines.emit(rank, host, f"[{host}:{rank}] {text}")

    def poll(self) -> list[NodeEnd]:
        out = []
        for node in self.plan.nodes:
            rank, mine = node.node_rank, self.node(node.node_rank)
            elapsed = time.monotonic() - self.t0
            if rank in self.done:
                continue
            if not (mine.silent and elapsed >= mine.after or mine.quiet_at(elapsed)):
                self.lines.emit(rank, node.host_label, HEARTBEAT)
            if mine.step_every and rank == 0:
                steps = int(min(elapsed, mine.steps_until) / mine.step_every)
                if steps > self.steps_said:
                    self.steps_said = steps
                    self.say(0, f'DDPLAUNCH_PROGRESS_JSON {{"rank": 0, "steps": {steps}}}')
            if mine.silent or mine.hangs or elapsed < mine.after:
                continue
            for text in mine.lines:  # as printed: a rank's lines carry their [host:rank] prefix
                self.lines.emit(rank, node.host_label, text)
            self.done.add(rank)
            how = "" if mine.code is not None else "Killed" if mine.answers else "host lost"
            out.append(NodeEnd(rank, mine.code, how=how, lost=mine.code is None))
        return out

    def stop(self, nodes: list[int]) -> None:
        self.stopped |= set(nodes)

    def settle(self, nodes: set[int], timeout: float) -> list[NodeEnd]:
        ends = [NodeEnd(n, 143) for n in sorted(nodes - self.done)]
        self.done |= nodes
        return ends

    def never_started(self, nodes: list[int]) -> set[int]:
        return {n for n in nodes if self.node(n).never_started}

    def confirm_lost(self, node: int) -> Optional[str]:
        mine = self.node(node)
        if mine.silent or (mine.code is None and not mine.answers):
            return "the fake says so"
        if mine.quiet_at(time.monotonic() - self.t0):
            return NoAnswer("fake:22 gave no answer" if not mine.local else
                            "fake:22 refused or unreachable (Operation not permitted)", mine.local)
        return None

    def lost(self, node: int) -> None:
        self.done.add(node)

    def at_fault(self, node: int) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def fake_registered(script: FakeScript) -> Iterator[FakeScript]:
    """Backend `fake` plays `script` while the block runs (one registration, nothing else)."""
    kind = SessionFakeBackend if script.in_session else FakeBackend
    registry.register(registry.Registration("fake", lambda spec, run: kind(spec, run, script)))
    try:
        yield script
    finally:
        registry.unregister("fake")


def fake_spec(tmp_path: Path, hosts: "int | list[Any]" = 3, **sections: Any) -> Path:
    """A spec file for backend `fake` with hosts f1..fN (or these `hosts` entries)."""
    import yaml

    entries = [f"f{i + 1}" for i in range(hosts)] if isinstance(hosts, int) else hosts
    data = {"name": "fake", "backend": "fake", "hosts": entries, **sections}
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
