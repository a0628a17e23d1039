"""Bad-node localization: which host makes the all-rank health check fail or crawl.

Each host alone, then the pair algorithm of hostside/pairs.py (disjoint pairs in parallel, one
rank per host, a large all_reduce; then every suspect re-paired with a host known to be good).
Each probe is an ordinary health-check plan run through the same backend. The verdict names the
bad hosts with the evidence: a busbw per pair against the median, also drawn as bars in an HTML
file beside the JSON.
"""

from __future__ import annotations

import html
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddplaunch.backends.contract import Launcher, StopEvent
from ddplaunch.hostside import pairs as pair_algorithm
from ddplaunch.output.console import QuietConsole
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.launch import PlanContext, Stage, StageOptions, derive_port, make_plan
from ddplaunch.record.diagnosis import Localization
from ddplaunch.spec.model import ClusterSpec, HostSpec


def localize(spec: ClusterSpec, backend: Launcher[Any], run_id: str, stop: StopEvent) -> Localization:
    """Find the hosts that fail alone or slow down every pair they are in."""
    runner = _ProbeRunner(spec, backend, run_id, stop)
    by_label = {h.label: h for h in spec.hosts}
    singles = runner.run_all([(h,) for h in spec.hosts], "alone")
    reasons = {p["hosts"][0]: f"fails alone: {p['detail']}" for p in singles if not p["ok"]}
    healthy = [h.label for h in spec.hosts if h.label not in reasons]

    def measure(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        return runner.run_all([(by_label[a], by_label[b]) for a, b in pairs], "pair")

    verdict = pair_algorithm.judge(healthy, measure, spec.healthcheck.min_busbw_fraction)
    reasons.update(verdict["reasons"])
    verdict.update(singles=singles, reasons=reasons, bad_hosts=[h.label for h in spec.hosts if h.label in reasons])
    return Localization.from_dict(verdict)


class _ProbeRunner:
    """Runs one-rank-per-host health checks on host subsets, several at once, quietly."""

    def __init__(self, spec: ClusterSpec, backend: Launcher[Any], run_id: str, stop: StopEvent):
        self.spec, self.backend, self.run_id, self.stop = spec, backend, run_id, stop
        self.count = 0
        self.lock = threading.Lock()

    def run_all(self, groups: list[tuple[HostSpec, ...]], kind: str) -> list[dict[str, Any]]:
        width = self.spec.healthcheck.pair_parallelism or len(groups)
        with ThreadPoolExecutor(max_workers=max(1, min(width, len(groups)))) as pool:
            return list(pool.map(lambda g: self.run_one(g, kind), groups))

    def run_one(self, group: tuple[HostSpec, ...], kind: str) -> dict[str, Any]:
        """One probe, in the shape the pair algorithm takes."""
        with self.lock:
            self.count += 1
            tag = f"{self.run_id}-{kind}{self.count}"
        hc = self.spec.healthcheck.model_copy(update={"sizes": [self.spec.healthcheck.pair_size],
                                                      "iterations": 3, "min_busbw_gbps": None})
        sub = self.spec.model_copy(update={"hosts": list(group), "nproc_per_node": 1, "healthcheck": hc,
                                           "master": self.spec.master.model_copy(update={"addr": None, "port": None})})
        plan = make_plan(PlanContext(sub, tag), Stage.HEALTHCHECK, derive_port(tag), StageOptions(direct=True))
        result = self.backend.launch(self.backend.render(plan), StageLines(QuietConsole()), self.stop)
        payload = result.healthcheck
        labels = [h.label for h in group]
        if not result.ok or payload is None:
            first = result.first_failure
            return {"hosts": labels, "ok": False, "busbw_gbps": None,
                    "detail": first.describe() if first else "no result"}
        rows = payload.bandwidth
        # one rank alone has no link to measure: correctness only
        busbw = rows[-1].busbw_gbps if rows and len(group) > 1 else None
        return {"hosts": labels, "ok": payload.ok, "busbw_gbps": busbw, "detail": ""}


def render_html(loc: Localization) -> str:
    """A bar chart (inline SVG, no dependencies) of every pair's busbw against the median."""
    probes = [("pair", p) for p in loc.pairs] + [("re-pair", p) for p in loc.repairs]
    top = max([p.busbw_gbps or 0 for _, p in probes] + [loc.median_busbw_gbps or 0, 1e-9])
    width, bar_h = 520, 26
    rows = []
    for i, (kind, p) in enumerate(probes):
        y = 10 + i * (bar_h + 8)
        w = int(width * (p.busbw_gbps or 0) / top)
        color = "#2e7d32" if p.ok else "#c62828"
        label = html.escape(f"{kind}: {' + '.join(p.hosts)}")
        value = "failed" if p.busbw_gbps is None else f"{p.busbw_gbps:.3f} GB/s"
        rows.append(f'<text x="0" y="{y + 17}" font-size="13">{label}</text>'
                    f'<rect x="230" y="{y}" width="{max(w, 1)}" height="{bar_h}" fill="{color}"/>'
                    f'<text x="{236 + w}" y="{y + 17}" font-size="13">{value}</text>')
    med_x = 230 + int(width * (loc.median_busbw_gbps or 0) / top)
    height = 20 + len(probes) * (bar_h + 8)
    bad = html.escape(", ".join(f"{h}: {loc.reasons[h]}" for h in loc.bad_hosts) or "none")
    return (f"<!doctype html><meta charset=utf-8><title>ddplaunch localization</title>"
            f"<h2>busbw per host pair (one rank per host)</h2><p>bad hosts: {bad}</p>"
            f'<svg width="{230 + width + 140}" height="{height}">{"".join(rows)}'
            f'<line x1="{med_x}" y1="0" x2="{med_x}" y2="{height}" stroke="#000" stroke-dasharray="4"/>'
            f'</svg><p>dashed line: median {loc.median_busbw_gbps or 0:.3f} GB/s; red: below '
            f"the gate or failed</p>")
