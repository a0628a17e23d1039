"""The launch gate: pre-flight and health-check verdicts decide whether, and where, the job runs.

`preflight_gate` and `healthcheck_gate` return the spec to go on with — unchanged, re-planned
without the hosts found bad (`healthcheck.on_fail: exclude`), or None to stop — and say why on
the sink. Files with the evidence (preflight.json, localize.json/.html) go to the run directory.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Optional

from ddplaunch.backends.contract import Backend
from ddplaunch.console import LineSink
from ddplaunch.results import StageResult
from ddplaunch.errors import PlanError
from ddplaunch.localize import Localization, localize, render_html
from ddplaunch.preflight import PreflightReport, render_table, run_preflight
from ddplaunch.runs import write_private
from ddplaunch.spec import ClusterSpec


def exclude_hosts(spec: ClusterSpec, labels: list[str]) -> ClusterSpec:
    """The spec without `labels` (host names or addresses); ranks are re-planned from it.

    Raises:
        PlanError: an unknown host, the explicit master, or no host left.
    """
    known = {h.label for h in spec.hosts} | {h.addr for h in spec.hosts}
    unknown = sorted(set(labels) - known)
    if unknown:
        raise PlanError(f"--exclude {', '.join(unknown)}: not a host of the spec "
                        f"(hosts: {', '.join(h.label for h in spec.hosts)})")
    keep = [h for h in spec.hosts if h.label not in labels and h.addr not in labels]
    if not keep:
        raise PlanError("every host is excluded: nothing left to run on")
    if spec.master.addr and spec.master.addr not in {h.addr for h in keep}:
        raise PlanError(f"master.addr {spec.master.addr} is excluded: set another master or fix the host")
    return spec.model_copy(update={"hosts": keep})


def preflight_wanted(spec: ClusterSpec, check_only: bool) -> bool:
    """Pre-flight runs on remote hosts (and for every `check`), unless the spec says otherwise."""
    if spec.preflight.enabled is not None:
        return spec.preflight.enabled
    return check_only or any(h.addr not in ("localhost", "127.0.0.1") for h in spec.hosts)


def preflight_gate(spec: ClusterSpec, backend: Backend, run_id: str, port: Optional[int],
                   sink: LineSink, run_dir: Path) -> tuple[Optional[ClusterSpec], PreflightReport]:
    """Run the pre-flight checks; the spec to go on with (None: stop)."""
    report = run_preflight(spec, backend, run_id, port)
    sink.block(render_table(report))
    write_private(run_dir / "preflight.json", json.dumps(report.to_dict(), indent=2, sort_keys=True))
    if report.socket_ifname and not spec.socket_ifname:
        spec = spec.model_copy(update={"socket_ifname": report.socket_ifname})
    if report.ok:
        return spec, report
    return _exclude_or_stop(spec, report.bad_hosts, "pre-flight", sink), report


def healthcheck_gate(spec: ClusterSpec, backend: Backend, run_id: str, result: StageResult,
                     payload: Optional[dict], stop: threading.Event, sink: LineSink, run_dir: Path
                     ) -> tuple[Optional[ClusterSpec], Optional[Localization]]:
    """After a health check: the spec to go on with (unchanged, without the bad hosts, or None).

    The pair gate runs inside the health check's own processes (its verdict is in `payload`);
    only a health check that failed without naming hosts is localized by launches of its own:
    each host alone, then pairs, then suspects with known-good hosts.
    """
    pairs = (payload or {}).get("pairs")
    if pairs and (pairs.get("pairs") or pairs.get("bad_hosts")):
        loc = Localization.from_dict(pairs)
    elif result.ok or result.interrupted or stop.is_set() or len(spec.hosts) < 2:
        return (spec if result.ok else None), None
    else:
        sink.note("localizing: each host alone, then host pairs, then suspects with known-good hosts")
        loc = localize(spec, backend, run_id, stop, singles=True)
    sink.block(loc.summary())
    write_private(run_dir / "localize.json", json.dumps(loc.to_dict(), indent=2, sort_keys=True))
    write_private(run_dir / "localize.html", render_html(loc))
    if not loc.bad_hosts:
        if not result.ok:
            sink.note("no single host explains the failure: stopping")
        return (spec if result.ok else None), loc
    sink.note(f"localization chart: {run_dir / 'localize.html'}")
    return _exclude_or_stop(spec, loc.bad_hosts, "the health check", sink), loc


def _exclude_or_stop(spec: ClusterSpec, bad: list[str], what: str, sink: LineSink) -> Optional[ClusterSpec]:
    if spec.healthcheck.on_fail != "exclude":
        hint = " (healthcheck.on_fail: exclude would run on the other hosts)" if len(spec.hosts) > len(bad) else ""
        sink.note(f"{what} failed on {', '.join(bad)}: stopping{hint}")
        return None
    try:
        kept = exclude_hosts(spec, bad)
    except PlanError as err:
        sink.note(f"{what} failed on {', '.join(bad)} and they cannot be excluded: {err}")
        return None
    sink.note(f"{what} failed on {', '.join(bad)}: EXCLUDED them (healthcheck.on_fail: exclude); "
              f"going on with {len(kept.hosts)} host(s): {', '.join(h.label for h in kept.hosts)}")
    return kept
