"""The launch gate: pre-flight and health-check verdicts decide whether, and where, the job runs.

`preflight_gate` and `healthcheck_gate` return their `Decision` — the spec to go on with
(unchanged, re-planned without the hosts found bad: `healthcheck.on_fail: exclude`, or None to
stop), the hosts excluded and the spares rejected — and say why on the console; the run loop
makes each decision an event (record/events.py), the run's one memory of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ddplaunch.backends.contract import Admitted, HostResult
from ddplaunch.diagnose.localize import Localization, localize
from ddplaunch.diagnose.preflight import (PROBE_SLACK, PreflightReport, evaluate, host_facts, listen_seconds,
                                          probe_command, render_table, run_preflight)
from ddplaunch.errors import BackendError, PlanError
from ddplaunch.plan.hostprogram import parse_answer
from ddplaunch.output.console import Console, hosts_named
from ddplaunch.plan.stages import exclude_hosts
from ddplaunch.record.diagnosis import Gate
from ddplaunch.report.evidence import LOCALIZE_PAGE
from ddplaunch.record.results import StageResult
from ddplaunch.run.runsession import RunSession
from ddplaunch.spec.model import ClusterSpec, HostSpec


@dataclass
class Decision:
    """What a gate decided: the spec to go on with (None: stop), the hosts it excluded (the spec
    goes on without them) and the spares it rejected (`spares`: those that passed)."""

    gate: Gate
    spec: Optional[ClusterSpec]
    excluded: list[str] = field(default_factory=list)
    rejected_spares: list[str] = field(default_factory=list)
    spares: list[HostSpec] = field(default_factory=list)


def preflight_gate(session: RunSession, spec: ClusterSpec, port: Optional[int], spares: list[HostSpec],
                   reached: Optional[list[HostResult]] = None) -> tuple[Decision, PreflightReport]:
    """Run the pre-flight checks on `spec`'s hosts and the spares at once: the decision (a spare
    that fails is named and rejected; the run goes on) and the report. `reached`: the hosts'
    connections, where the caller tried them already."""
    probed = spec.model_copy(update={"hosts": [*spec.hosts, *spares]}) if spares else spec
    report = run_preflight(probed, session.backend, session.run_id, port, session.emulated, reached)
    return judge_preflight(spec, report, spares, session.console), report


def judge_preflight(spec: ClusterSpec, report: PreflightReport, spares: list[HostSpec],
                    console: Console) -> Decision:
    """The pre-flight's verdict, shown: the spec to go on with (None: stop; with the interface
    every host reaches the master through, where one was found), the hosts it excluded, and the
    spares that passed and that did not."""
    console.block(render_table(report))
    if report.socket_ifname and not spec.socket_ifname:
        spec = spec.model_copy(update={"socket_ifname": report.socket_ifname})
    bad = set(report.bad_hosts)
    dropped = [s.label for s in spares if s.label in bad]
    if dropped:
        console.note(f"spare {', '.join(dropped)} failed the pre-flight: dropped (the run goes on without it)")
    passed = [s for s in spares if s.label not in bad]
    bad_hosts = [h.label for h in spec.hosts if h.label in bad]
    decision = _exclude_or_stop(spec, bad_hosts, Gate.PREFLIGHT, console) if bad_hosts \
        else Decision(Gate.PREFLIGHT, spec)
    decision.rejected_spares, decision.spares = dropped, passed
    return decision


class InStagePreflight:
    """The pre-flight in the first launch's own sessions (`backends.contract.StartGate`): each
    node's session runs the probe once its files are there, and the stage starts only when the
    verdict keeps every host — one SSH round per host instead of two. Otherwise nothing started:
    `outcome` is the spec to go on with (hosts excluded) or None (stop), as `preflight_gate` says.
    Called from the backend's thread; `verdict(report, the stage starts)` runs there too."""

    def __init__(self, session: RunSession, spec: ClusterSpec, port: int,
                 verdict: Callable[[PreflightReport, Decision], None]):
        self.spec, self.run_id, self.port, self.console = spec, session.run_id, port, session.console
        self.parallel, self.emulated, self.verdict = session.backend.max_parallel, session.emulated, verdict
        self.timeout = listen_seconds(spec, self.parallel) + PROBE_SLACK
        self._nonces: dict[str, str] = {}
        self._sent = time.time()
        self.outcome = Decision(Gate.PREFLIGHT, spec)

    def command(self, host: HostSpec) -> str:
        text, self._nonces[host.label] = probe_command(self.spec, host, self.run_id, self.port, self.parallel,
                                                       emulated=self.emulated)
        return text

    def admit(self, outputs: dict[str, tuple[int, str]], errors: dict[str, BackendError]) -> Optional[Admitted]:
        raw = {}
        for host in self.spec.hosts:
            code, out = outputs.get(host.label, (None, ""))
            data = parse_answer(out, self._nonces.get(host.label, "")) if code is not None else None
            raw[host.label] = host_facts(data, code, out, errors.get(host.label) if code is None else None)
        report = evaluate(self.spec, raw, (self._sent, time.time()), self.port, self.emulated)
        report.elapsed_s = time.time() - self._sent
        self.outcome = judge_preflight(self.spec, report, [], self.console)
        self.verdict(report, self.outcome)
        return Admitted(report.socket_ifname) if self.starts else None

    @property
    def starts(self) -> bool:
        """Whether the stage starts: the verdict keeps every host."""
        return self.outcome.spec is not None and not self.outcome.excluded


def healthcheck_gate(session: RunSession, spec: ClusterSpec, result: StageResult
                     ) -> tuple[Decision, Optional[Localization]]:
    """After a health check on `spec`'s hosts: its decision (the spec unchanged, without the bad
    hosts, or None) and the localization, if one ran.

    The pair gate runs inside the health check's own processes (its verdict is in the result's
    `healthcheck`); only a health check that failed without naming hosts is localized by launches
    of their own: each host alone, then pairs, then suspects with known-good hosts.
    """
    pairs = result.healthcheck.pairs if result.healthcheck is not None else None
    if pairs is not None and (pairs.pairs or pairs.bad_hosts):
        loc = pairs
    elif result.ok or result.interrupted or session.stop.is_set() or len(spec.hosts) < 2:
        return Decision(Gate.HEALTHCHECK, spec if result.ok else None), None
    else:
        session.console.note("localizing: each host alone, then host pairs, then suspects with known-good hosts")
        loc = localize(spec, session.backend, session.run_id, session.stop)
    console = session.console
    console.block(loc.summary())
    if not loc.bad_hosts:
        if not result.ok:
            console.note("no single host explains the failure: stopping")
        return Decision(Gate.HEALTHCHECK, spec if result.ok else None), loc
    console.note(f"localization chart: {session.run_dir / LOCALIZE_PAGE}")
    return _exclude_or_stop(spec, loc.bad_hosts, Gate.HEALTHCHECK, console), loc


def _exclude_or_stop(spec: ClusterSpec, bad: list[str], gate: Gate, console: Console) -> Decision:
    what = "the health check" if gate == Gate.HEALTHCHECK else str(gate)
    if spec.healthcheck.on_fail != "exclude":
        hint = " (healthcheck.on_fail: exclude would run on the other hosts)" if len(spec.hosts) > len(bad) else ""
        console.note(f"{what} failed on {', '.join(bad)}: stopping{hint}")
        return Decision(gate, None)
    try:
        kept = exclude_hosts(spec, bad)
    except PlanError as err:
        console.note(f"{what} failed on {', '.join(bad)} and they cannot be excluded: {err}")
        return Decision(gate, None)
    console.note(f"{what} failed on {', '.join(bad)}: EXCLUDED them (healthcheck.on_fail: exclude); "
                 f"going on with {len(kept.hosts)} host(s): {hosts_named([h.label for h in kept.hosts])}")
    return Decision(gate, kept, excluded=list(bad))
