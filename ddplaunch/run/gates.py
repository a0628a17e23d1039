"""The launch gate: pre-flight and health-check verdicts decide whether, and where, the job runs.

`preflight_gate` and `healthcheck_gate` return the spec to go on with — unchanged, re-planned
without the hosts found bad (`healthcheck.on_fail: exclude`), or None to stop — and say why on
the console. Files with the evidence (preflight.json, localize.json/.html) go to the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ddplaunch.backends.contract import Admitted, HostResult, Launcher, StopEvent
from ddplaunch.diagnose.localize import Localization, localize, render_html
from ddplaunch.diagnose.preflight import (PROBE_SLACK, PreflightReport, evaluate, host_facts, listen_seconds,
                                          probe_command, render_table, run_preflight)
from ddplaunch.errors import BackendError, PlanError
from ddplaunch.plan.hostprogram import parse_answer
from ddplaunch.output.console import Console, hosts_named
from ddplaunch.plan.stages import exclude_hosts
from ddplaunch.record.results import StageResult
from ddplaunch.record.runs import write_private
from ddplaunch.spec.model import ClusterSpec, HostSpec


def preflight_gate(spec: ClusterSpec, backend: Launcher[Any], run_id: str, port: Optional[int],
                   console: Console, run_dir: Path, spares: Optional[list[HostSpec]] = None, emulated: bool = False,
                   reached: Optional[list[HostResult]] = None
                   ) -> tuple[Optional[ClusterSpec], list[HostSpec], PreflightReport]:
    """Run the pre-flight checks on the hosts and the spares at once; the spec to go on with (None:
    stop) and the spares that passed (a spare that fails is named and dropped; the run goes on).
    `reached`: the hosts' connections, where the caller tried them already."""
    spares = list(spares or [])
    probed = spec.model_copy(update={"hosts": [*spec.hosts, *spares]}) if spares else spec
    report = run_preflight(probed, backend, run_id, port, emulated, reached)
    gated, spares = judge_preflight(spec, report, spares, console, run_dir)
    return gated, spares, report


def judge_preflight(spec: ClusterSpec, report: PreflightReport, spares: list[HostSpec], console: Console,
                    run_dir: Path) -> tuple[Optional[ClusterSpec], list[HostSpec]]:
    """The pre-flight's verdict, shown and kept in the run directory: the spec to go on with
    (None: stop; with the interface every host reaches the master through, where one was found)
    and the spares that passed."""
    console.block(render_table(report))
    if report.socket_ifname and not spec.socket_ifname:
        spec = spec.model_copy(update={"socket_ifname": report.socket_ifname})
    write_private(run_dir / "preflight.json", json.dumps(report.to_dict(), indent=2, sort_keys=True))
    bad = set(report.bad_hosts)
    dropped = [s.label for s in spares if s.label in bad]
    if dropped:
        console.note(f"spare {', '.join(dropped)} failed the pre-flight: dropped (the run goes on without it)")
    spares = [s for s in spares if s.label not in bad]
    bad_hosts = [h.label for h in spec.hosts if h.label in bad]
    if not bad_hosts:
        return spec, spares
    return _exclude_or_stop(spec, bad_hosts, "pre-flight", console), spares


class InStagePreflight:
    """The pre-flight in the first launch's own sessions (`backends.contract.StartGate`): each
    node's session runs the probe once its files are there, and the stage starts only when the
    verdict keeps every host — one SSH round per host instead of two. Otherwise nothing started:
    `outcome` is the spec to go on with (hosts excluded) or None (stop), as `preflight_gate` says.
    Called from the backend's thread; `verdict(report, the stage starts)` runs there too."""

    def __init__(self, spec: ClusterSpec, parallel: int, run_id: str, port: int, console: Console,
                 run_dir: Path, emulated: bool, verdict: Callable[[PreflightReport, bool], None]):
        self.spec, self.run_id, self.port, self.console, self.run_dir = spec, run_id, port, console, run_dir
        self.parallel, self.emulated, self.verdict = parallel, emulated, verdict
        self.timeout = listen_seconds(spec, parallel) + PROBE_SLACK
        self._nonces: dict[str, str] = {}
        self._sent = time.time()
        self.outcome: Optional[ClusterSpec] = spec

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
        gated, _ = judge_preflight(self.spec, report, [], self.console, self.run_dir)
        self.outcome = gated
        starts = gated is not None and [h.label for h in gated.hosts] == [h.label for h in self.spec.hosts]
        self.verdict(report, starts)
        if not starts:
            return None
        return Admitted(report.socket_ifname)


def healthcheck_gate(spec: ClusterSpec, backend: Launcher[Any], run_id: str, result: StageResult,
                     stop: StopEvent, console: Console, run_dir: Path
                     ) -> tuple[Optional[ClusterSpec], Optional[Localization]]:
    """After a health check: the spec to go on with (unchanged, without the bad hosts, or None).

    The pair gate runs inside the health check's own processes (its verdict is in the result's
    `healthcheck`); only a health check that failed without naming hosts is localized by launches
    of their own: each host alone, then pairs, then suspects with known-good hosts.
    """
    pairs = result.healthcheck.pairs if result.healthcheck is not None else None
    if pairs is not None and (pairs.pairs or pairs.bad_hosts):
        loc = pairs
    elif result.ok or result.interrupted or stop.is_set() or len(spec.hosts) < 2:
        return (spec if result.ok else None), None
    else:
        console.note("localizing: each host alone, then host pairs, then suspects with known-good hosts")
        loc = localize(spec, backend, run_id, stop)
    console.block(loc.summary())
    write_private(run_dir / "localize.json", json.dumps(loc.to_dict(), indent=2, sort_keys=True))
    write_private(run_dir / "localize.html", render_html(loc))
    if not loc.bad_hosts:
        if not result.ok:
            console.note("no single host explains the failure: stopping")
        return (spec if result.ok else None), loc
    console.note(f"localization chart: {run_dir / 'localize.html'}")
    return _exclude_or_stop(spec, loc.bad_hosts, "the health check", console), loc


def _exclude_or_stop(spec: ClusterSpec, bad: list[str], what: str, console: Console) -> Optional[ClusterSpec]:
    if spec.healthcheck.on_fail != "exclude":
        hint = " (healthcheck.on_fail: exclude would run on the other hosts)" if len(spec.hosts) > len(bad) else ""
        console.note(f"{what} failed on {', '.join(bad)}: stopping{hint}")
        return None
    try:
        kept = exclude_hosts(spec, bad)
    except PlanError as err:
        console.note(f"{what} failed on {', '.join(bad)} and they cannot be excluded: {err}")
        return None
    console.note(f"{what} failed on {', '.join(bad)}: EXCLUDED them (healthcheck.on_fail: exclude); "
              f"going on with {len(kept.hosts)} host(s): {hosts_named([h.label for h in kept.hosts])}")
    return kept
