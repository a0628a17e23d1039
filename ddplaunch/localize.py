"""Bad-node localization: which host makes the all-rank health check fail or crawl.

Each host alone, then disjoint pairs in parallel (one rank per host, a large all_reduce), then
every suspect re-paired with a host known to be good. Each probe is an ordinary health-check
plan run through the same backend. The verdict names the bad hosts with the evidence: a busbw
per pair against the median, also drawn as bars in an HTML file beside the JSON.
"""

from __future__ import annotations

import html
import io
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from ddplaunch.backends.contract import Backend
from ddplaunch.console import LineSink
from ddplaunch.plan import derive_port, make_plan
from ddplaunch.spec import ClusterSpec, HostSpec


@dataclass
class Probe:
    """One health check on a subset of hosts."""

    hosts: tuple[str, ...]
    ok: bool
    busbw_gbps: Optional[float]
    detail: str = ""


@dataclass
class Localization:
    """What the localization found; `bad_hosts` is the verdict."""

    singles: list[Probe] = field(default_factory=list)
    pairs: list[Probe] = field(default_factory=list)
    repairs: list[Probe] = field(default_factory=list)
    median_busbw_gbps: Optional[float] = None
    bad_hosts: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Localization":
        """From the health check's in-process pair gate (the same shape as `to_dict`)."""
        def probes(key: str) -> list[Probe]:
            return [Probe(tuple(p["hosts"]), bool(p["ok"]), p.get("busbw_gbps"), p.get("detail", ""))
                    for p in data.get(key) or []]
        return cls(singles=probes("singles"), pairs=probes("pairs"), repairs=probes("repairs"),
                   median_busbw_gbps=data.get("median_busbw_gbps"), bad_hosts=list(data.get("bad_hosts") or []),
                   reasons=dict(data.get("reasons") or {}))

    def summary(self) -> str:
        lines = ["localization (busbw of one rank per host, large all_reduce):"]
        for p in self.singles:
            lines.append(f"  alone {p.hosts[0]:<16} {'ok' if p.ok else 'FAILED ' + p.detail}")
        med = self.median_busbw_gbps
        for kind, probes in (("pair", self.pairs), ("re-pair", self.repairs)):
            for p in probes:
                bw = "failed" if p.busbw_gbps is None else f"{p.busbw_gbps:.3f} GB/s"
                ratio = f" ({p.busbw_gbps / med:.2f} x median)" if med and p.busbw_gbps is not None else ""
                lines.append(f"  {kind:<7} {' + '.join(p.hosts):<28} {bw}{ratio}{'' if p.ok else '  <- slow/failed'}")
        lines.append("  bad hosts: " + (", ".join(f"{h} ({self.reasons[h]})" for h in self.bad_hosts)
                                        if self.bad_hosts else "none found"))
        return "\n".join(lines)


def localize(spec: ClusterSpec, backend: Backend, run_id: str, stop: threading.Event,
             singles: bool = True) -> Localization:
    """Find the hosts that fail alone or slow down every pair they are in."""
    result = Localization()
    hosts = list(spec.hosts)
    runner = _ProbeRunner(spec, backend, run_id, stop)
    if singles:
        result.singles = runner.run_all([(h,) for h in hosts], "alone")
        for p in result.singles:
            if not p.ok:
                result.reasons[p.hosts[0]] = f"fails alone: {p.detail}"
    healthy = [h for h in hosts if h.label not in result.reasons]
    pairs = [(healthy[i], healthy[i + 1]) for i in range(0, len(healthy) - 1, 2)]
    result.pairs = runner.run_all(pairs, "pair")
    if len(healthy) % 2 and len(healthy) > 1:  # the odd one out pairs with the first host
        result.pairs += runner.run_all([(healthy[-1], healthy[0])], "pair")
    result.median_busbw_gbps = healthy_median([p.busbw_gbps for p in result.pairs if p.busbw_gbps is not None])
    floor = (result.median_busbw_gbps or 0) * spec.healthcheck.min_busbw_fraction
    for p in result.pairs:
        p.ok = p.ok and p.busbw_gbps is not None and p.busbw_gbps >= floor
    good = [h for h in healthy if all(p.ok for p in result.pairs if h.label in p.hosts)]
    suspects = [h for h in healthy if h not in good]
    if suspects and good:
        repairs = [(s, good[i % len(good)]) for i, s in enumerate(suspects)]
        result.repairs = runner.run_all(repairs, "repair")
        for p in result.repairs:
            p.ok = p.ok and p.busbw_gbps is not None and p.busbw_gbps >= floor
            if not p.ok:
                bw = "failed" if p.busbw_gbps is None else f"{p.busbw_gbps:.3f} GB/s"
                result.reasons[p.hosts[0]] = (f"slow with a known-good host: {bw} vs median "
                                              f"{result.median_busbw_gbps:.3f} GB/s")
    elif suspects:
        for s in suspects:
            result.reasons[s.label] = "every pair is slow or failed: no known-good host to compare with"
    result.bad_hosts = [h.label for h in hosts if h.label in result.reasons]
    return result


def healthy_median(speeds: list[float]) -> Optional[float]:
    """The median of the faster half of the pairs: what this cluster's links can do.

    A plain median is dragged down as soon as half the pairs are slow — with 4 hosts one slow
    host already spoils one of two pairs — so the reference assumes only that most links are
    fine, not that most pairs are.
    """
    if not speeds:
        return None
    top = sorted(speeds, reverse=True)[: (len(speeds) + 1) // 2]
    return statistics.median(top)


class _ProbeRunner:
    """Runs one-rank-per-host health checks on host subsets, several at once, quietly."""

    def __init__(self, spec: ClusterSpec, backend: Backend, run_id: str, stop: threading.Event):
        self.spec, self.backend, self.run_id, self.stop = spec, backend, run_id, stop
        self.count = 0
        self.lock = threading.Lock()

    def run_all(self, groups: list[tuple[HostSpec, ...]], kind: str) -> list[Probe]:
        width = self.spec.healthcheck.pair_parallelism or len(groups)
        with ThreadPoolExecutor(max_workers=max(1, min(width, len(groups)))) as pool:
            return list(pool.map(lambda g: self.run_one(g, kind), groups))

    def run_one(self, group: tuple[HostSpec, ...], kind: str) -> Probe:
        with self.lock:
            self.count += 1
            tag = f"{self.run_id}-{kind}{self.count}"
        hc = self.spec.healthcheck.model_copy(update={"sizes": [self.spec.healthcheck.pair_size],
                                                      "iterations": 3, "min_busbw_gbps": None})
        sub = self.spec.model_copy(update={"hosts": list(group), "nproc_per_node": 1, "healthcheck": hc,
                                           "master": self.spec.master.model_copy(update={"addr": None, "port": None})})
        plan = make_plan(sub, tag, "healthcheck", derive_port(tag), direct=True)
        sink = LineSink(io.StringIO())
        result = self.backend.launch(self.backend.render(plan), sink, self.stop)
        payload = sink.payload("HEALTHCHECK")
        labels = tuple(h.label for h in group)
        if not result.ok or payload is None:
            first = result.first_failure
            return Probe(labels, False, None, first.describe() if first else "no result")
        rows = payload.get("bandwidth") or []
        busbw = rows[-1]["busbw_gbps"] if rows else None
        if len(group) == 1:  # one rank alone has no link to measure: correctness only
            busbw = None
        return Probe(labels, bool(payload.get("ok")), busbw)


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
