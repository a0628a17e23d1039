"""`ddplaunch report RUN_ID --html FILE`: one self-contained HTML page of a run, with plots.

Drawn from what the run directory holds — its event log (each rank's step times, stages,
recoveries, stragglers), `healthcheck.json` (busbw per message size; the pair gate's pairs) and
`localize.json` — as inline SVG: no script, no stylesheet or font from the network, nothing to
install to open it. Plots: every rank's compute per step over the run (step time minus its wait at
the collectives: step times are equal on every rank, this singles out a straggler), the
health check's busbw per size, the pair bandwidth matrix as a heatmap, and the timeline of stages,
recoveries and stragglers. Pure: data in, text out.
"""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path
from typing import Any, Optional

from ddplaunch.record.events import (Event, RankSteps, RecoveryStarted, RunEnded, RunStarted, StageEnded, StageStarted,
                                     StragglerNamed, read_events)

W, H, PAD = 760, 260, 48
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _axes(x_label: str, y_label: str, y_max: float, unit: str) -> list[str]:
    out = [f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#333"/>',
           f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>',
           f'<text x="{W // 2}" y="{H - 10}" text-anchor="middle">{_esc(x_label)}</text>',
           f'<text x="12" y="{H // 2}" transform="rotate(-90 12 {H // 2})" text-anchor="middle">{_esc(y_label)}</text>']
    for i in range(5):
        y = H - PAD - i * (H - PAD - 10) / 4
        out.append(f'<text x="{PAD - 4}" y="{y + 4:.0f}" text-anchor="end" font-size="10">'
                   f'{y_max * i / 4:.3g}{unit}</text>')
    return out


def step_plot(events: list[Event]) -> str:
    """Every rank's compute share of its steps over the run (seconds since the run started): step
    times are equal on every rank of a synchronous job, the compute share singles out a straggler."""
    steps = [e for e in events if isinstance(e, RankSteps)]
    if not steps:
        return "<p>No rank reported its steps (the job stepped no torch.optim optimizer, or ran before this ddplaunch).</p>"
    t0 = min(e.t for e in events)
    t_max = max(e.t for e in steps) - t0 or 1.0
    y_max = max(e.step_s - e.wait_s for e in steps) * 1e3 * 1.1 or 1.0
    out = _axes("seconds since the run started", "compute per step (ms)", y_max, "")
    ranks = sorted({e.rank for e in steps})
    for i, rank in enumerate(ranks):
        mine = [e for e in steps if e.rank == rank]
        points = " ".join(f"{PAD + (e.t - t0) / t_max * (W - PAD - 10):.1f},"
                          f"{H - PAD - (e.step_s - e.wait_s) * 1e3 / y_max * (H - PAD - 10):.1f}" for e in mine)
        color = COLORS[i % len(COLORS)]
        out.append(f'<polyline class="rank" data-rank="{rank}" fill="none" stroke="{color}" stroke-width="1.5" '
                   f'points="{points}"><title>rank {rank} ({_esc(mine[-1].host)})</title></polyline>')
    for e in events:
        if isinstance(e, (RecoveryStarted, StragglerNamed)):
            x = PAD + (e.t - t0) / t_max * (W - PAD - 10)
            label = "recovery" if isinstance(e, RecoveryStarted) else f"straggler {e.host}"
            out.append(f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{H - PAD}" stroke="#c00" stroke-dasharray="4"/>'
                       f'<text x="{x + 3:.1f}" y="22" font-size="11" fill="#c00">{_esc(label)}</text>')
    legend = " ".join(f'<span style="color:{COLORS[i % len(COLORS)]}">■ rank {r}</span>' for i, r in enumerate(ranks))
    return _svg(out) + f"<p>{legend}</p>"


def busbw_plot(healthcheck: Optional[dict[str, Any]]) -> str:
    rows = [r for r in (healthcheck or {}).get("bandwidth") or [] if isinstance(r.get("busbw_gbps"), (int, float))]
    if not rows:
        return "<p>No health-check bandwidth in this run.</p>"
    y_max = max(r["busbw_gbps"] for r in rows) * 1.1 or 1.0
    out = _axes("message size", "busbw (GB/s)", y_max, "")
    width = (W - PAD - 20) / len(rows)
    for i, r in enumerate(rows):
        h = r["busbw_gbps"] / y_max * (H - PAD - 10)
        x = PAD + 5 + i * width
        out.append(f'<rect class="busbw" x="{x:.1f}" y="{H - PAD - h:.1f}" width="{width * 0.8:.1f}" height="{h:.1f}" '
                   f'fill="#1f77b4"><title>{_esc(r.get("collective", ""))} {r["bytes"]} B: '
                   f'{r["busbw_gbps"]:.4g} GB/s</title></rect>'
                   f'<text x="{x + width * 0.4:.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">'
                   f'{_size(r["bytes"])}</text>')
    return _svg(out)


def pair_heatmap(pairs: list[dict[str, Any]]) -> str:
    """The pair gate's (or localization's) busbw per host pair against their median."""
    measured = [p for p in pairs if len(p.get("hosts") or []) == 2]
    if not measured:
        return "<p>No pair bandwidth in this run (healthcheck.pairwise, or a localization, measures it).</p>"
    hosts = sorted({h for p in measured for h in p["hosts"]})
    values = [p["busbw_gbps"] for p in measured if isinstance(p.get("busbw_gbps"), (int, float))]
    median = statistics.median(values) if values else 0.0
    cell = min(48, (W - 140) // max(1, len(hosts)))
    out = []
    for i, h in enumerate(hosts):
        out.append(f'<text x="130" y="{40 + i * cell + cell / 2 + 4:.0f}" text-anchor="end">{_esc(h)}</text>'
                   f'<text x="{140 + i * cell + cell / 2:.0f}" y="30" text-anchor="middle">{_esc(h)}</text>')
    for p in measured:
        a, b = (hosts.index(h) for h in p["hosts"])
        bw = p.get("busbw_gbps")
        ratio = bw / median if isinstance(bw, (int, float)) and median else 0.0
        color = f"hsl({max(0.0, min(1.0, ratio)) * 120:.0f},70%,50%)"  # red (slow, failed) to green
        for x, y in ((a, b), (b, a)):
            out.append(f'<rect class="pair" x="{140 + x * cell}" y="{40 + y * cell}" width="{cell - 2}" '
                       f'height="{cell - 2}" fill="{color}"><title>{_esc(" + ".join(p["hosts"]))}: '
                       f'{"failed" if bw is None else f"{bw:.4g} GB/s ({ratio:.2f} x median)"}</title></rect>')
    return _svg(out, height=60 + len(hosts) * cell)


def timeline(events: list[Event]) -> str:
    rows = []
    t0 = min((e.t for e in events), default=0.0)
    for e in events:
        text = ""
        if isinstance(e, StageStarted):
            text = f"stage {e.stage} started on {', '.join(e.hosts)} (master {e.master}:{e.port})"
        elif isinstance(e, StageEnded):
            text = f"stage {e.stage} {'ok' if e.ok else 'ended with a host lost' if e.host_failure else 'FAILED'}"
        elif isinstance(e, RecoveryStarted):
            text = (f"recovery {e.number}: {', '.join(e.lost)} lost; "
                    + ", ".join(f"{a} → {b}" for a, b in e.replaced.items()))
        elif isinstance(e, StragglerNamed):
            text = (f"straggler {e.host} (rank{'s' if len(e.ranks) > 1 else ''} {', '.join(map(str, e.ranks))}): "
                    f"{e.slowdown:.0%} slower since step {e.since_step}")
        elif isinstance(e, RunEnded):
            text = f"run ended: {e.state} (exit {e.exit_code})"
        if text:
            rows.append(f"<tr><td>{e.t - t0:.1f} s</td><td>{_esc(text)}</td></tr>")
    return "<table class='timeline'><tr><th>at</th><th>what</th></tr>" + "".join(rows) + "</table>"


def _size(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n}B"


def _svg(parts: list[str], height: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" '
            f'font-size="12">' + "".join(parts) + "</svg>")


def _json(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def render(run_dir: Path) -> str:
    """The page of the run whose directory is `run_dir`."""
    events = read_events(run_dir)
    healthcheck = _json(run_dir / "healthcheck.json")
    pairs = ((healthcheck or {}).get("pairs") or {}).get("pairs") or []
    localized = _json(run_dir / "localize.json")
    pairs = pairs or ((localized or {}).get("pairs") or []) + ((localized or {}).get("repairs") or [])
    started = next((e for e in events if isinstance(e, RunStarted)), None)
    ended = next((e for e in events if isinstance(e, RunEnded)), None)
    title = f"run {started.run_id if started else run_dir.name}"
    head = (f"{_esc(started.backend)} backend, hosts {_esc(', '.join(started.hosts))}" if started else "")
    state = f"{ended.state} (exit {ended.exit_code})" if ended else "running (no end in its log yet)"
    summary = f"<pre>{_esc(ended.summary)}</pre>" if ended and ended.summary else ""
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + _esc(title) + "</title><style>"
            "body{font-family:sans-serif;margin:24px;max-width:820px}h2{margin-top:28px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            "pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}</style></head><body>"
            f"<h1>{_esc(title)}: {_esc(state)}</h1><p>{head}</p>"
            "<h2>Compute per step of every rank (step time minus wait at the collectives)</h2>"
            + step_plot(events)
            + "<h2>Health check: busbw per message size</h2>" + busbw_plot(healthcheck)
            + "<h2>Pair bandwidth (busbw against the median)</h2>" + pair_heatmap(pairs)
            + "<h2>Timeline</h2>" + timeline(events)
            + ("<h2>Summary</h2>" + summary if summary else "") + "</body></html>\n")
