"""`ddplaunch report RUN_ID --html FILE`: one self-contained HTML page of a run, with plots.

Drawn from the run's event log alone, folded (record/view.py), as inline SVG: no script, no
stylesheet or font from the network, nothing to install to open it. Plots: where the wall time went
(the goodput ledger, report/goodput.py, as one stacked bar), every rank's compute
per step over the run (step time minus its wait at the collectives: step times are equal on
every rank, this singles out a straggler), the health check's busbw per size, the pair bandwidth
matrix as a heatmap, and the timeline of stages, recoveries and stragglers — each stage's verdict
and the run's end in the summary's own words (`stage_verdict`, the same typed state). `render` is
pure (a view and the ranks' timing reports in, text out); `page_of` reads a run directory.
"""

from __future__ import annotations

import html
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from ddplaunch.output.console import hosts_named
from ddplaunch.record.diagnosis import HealthVerdict, Probe
from ddplaunch.record.events import StepWindow, events_from
from ddplaunch.record.view import RunView
from ddplaunch.report.goodput import CAUSES, duration, ledger
from ddplaunch.report.summary import back_why, stage_verdict, summarize

W, H, PAD = 760, 260, 48
#: Windows of steps plotted at most (a day of them is thousands: an even spread of them).
MAX_WINDOWS = 600
#: The ledger's causes, training green and the losses warm.
CAUSE_COLORS = {"startup": "#9e9e9e", "training": "#2ca02c", "checkpoint": "#8c564b", "redone": "#ff7f0e",
                "slow": "#bcbd22", "detection": "#d62728", "recovery": "#9467bd", "other": "#c7c7c7"}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _axes(x_label: str, y_label: str, y_max: float, unit: str,
          y_ticks: Sequence[tuple[float, str]] = (), x_ticks: Sequence[tuple[float, str]] = ()) -> list[str]:
    """Both axes with their labels; ticks at fractions (0-1) of each axis with their labels (the
    y axis: five from 0 to `y_max` unless `y_ticks` says)."""
    out = [f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#333"/>',
           f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>',
           f'<text x="{W // 2}" y="{H - 10}" text-anchor="middle">{_esc(x_label)}</text>',
           f'<text x="12" y="{H // 2}" transform="rotate(-90 12 {H // 2})" text-anchor="middle">{_esc(y_label)}</text>']
    for at, label in y_ticks or [(i / 4, f"{y_max * i / 4:.3g}{unit}") for i in range(5)]:
        y = H - PAD - at * (H - PAD - 10)
        out.append(f'<line class="tick" x1="{PAD - 3}" y1="{y:.1f}" x2="{PAD}" y2="{y:.1f}" stroke="#333"/>'
                   f'<text x="{PAD - 5}" y="{y + 4:.0f}" text-anchor="end" font-size="10">{_esc(label)}</text>')
    for at, label in x_ticks:
        x = PAD + at * (W - PAD - 10)
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{H - PAD}" x2="{x:.1f}" y2="{H - PAD + 3}" stroke="#333"/>'
                   f'<text x="{x:.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{_esc(label)}</text>')
    return out


def _time_ticks(span: float) -> list[tuple[float, str]]:
    """Five ticks over `span` seconds, in the summary's units (`0s`, `1m30s`, `2h07m`)."""
    return [(i / 4, duration(span * i / 4)) for i in range(5)]


def _ratio_ticks(highest: float) -> tuple[float, list[tuple[float, str]]]:
    """An axis of ratios from 0 past `highest`, in round steps (1, 2, 2.5 or 5 times a power of
    ten), at most six ticks: (its top, its ticks as fractions of it with labels)."""
    least = max(highest, 1e-9) / 5
    decade = 10.0 ** math.floor(math.log10(least))
    step = next(m * decade for m in (1, 2, 2.5, 5, 10) if m * decade >= least)
    n = max(1, math.ceil(highest / step))
    return n * step, [(i / n, f"{i * step:g}x") for i in range(n + 1)]


def _slowest(part: list[float]) -> float:
    """A host's slowest rank's compute in a window (its ranks' median in a log that lacks it)."""
    return part[3] if len(part) > 3 else part[0]


def step_plot(view: RunView, windows: Sequence[StepWindow]) -> str:
    """Each host's compute per step (its slowest rank's: step time minus wait at the collectives)
    against the median host's, per window of steps, over the run: the band of every host (lowest
    to highest) and the median, and a line of its own for a host named a straggler. Step times
    are equal on every rank of a synchronous job: the compute share singles out the straggler."""
    rows = [(w.t, w.hosts) for w in windows if len(w.hosts) >= 1]
    if not rows:
        return "<p>No window of steps was judged (the job stepped no torch.optim optimizer, or ran too few steps).</p>"
    t0 = min([t for t, _ in rows] + ([view.started.t] if view.started is not None else []))
    t_max = max(t for t, _ in rows) - t0 or 1.0
    ratios = [{h: _slowest(v) / med for h, v in hosts.items()} for _, hosts in rows
              if (med := statistics.median(_slowest(v) for v in hosts.values())) > 0]
    y_max, y_ticks = _ratio_ticks(max(max(r.values()) for r in ratios) * 1.05 if ratios else 2.0)
    out = _axes("time since the run started", "compute / the median host's", y_max, "x",
                y_ticks=y_ticks, x_ticks=_time_ticks(t_max))

    def xy(t: float, ratio: float) -> str:
        return f"{PAD + (t - t0) / t_max * (W - PAD - 10):.1f},{H - PAD - ratio / y_max * (H - PAD - 10):.1f}"
    times = [t for (t, hosts) in rows if statistics.median(_slowest(v) for v in hosts.values()) > 0]
    band = [xy(t, max(r.values())) for t, r in zip(times, ratios)] + \
        [xy(t, min(r.values())) for t, r in reversed(list(zip(times, ratios)))]
    out.append(f'<polygon class="band" fill="#1f77b4" fill-opacity="0.2" stroke="none" points="{" ".join(band)}">'
               '<title>every host, lowest to highest</title></polygon>')
    out.append(f'<polyline class="median" fill="none" stroke="#1f77b4" stroke-width="1.5" '
               f'points="{" ".join(xy(t, 1.0) for t in times)}"><title>the median host</title></polyline>')
    for i, s in enumerate(view.stragglers):
        points = " ".join(xy(t, r[s.host]) for t, r in zip(times, ratios) if s.host in r)
        color = COLORS[(i + 3) % len(COLORS)]
        out.append(f'<polyline class="host" data-host="{_esc(s.host)}" fill="none" stroke="{color}" '
                   f'stroke-width="2" points="{points}"><title>{_esc(s.host)}</title></polyline>')
    marks = [(r.detected_at, "recovery") for r in view.recoveries] + \
        [(s.named_at, f"straggler {s.host}") for s in view.stragglers]
    for at, label in marks:
        x = PAD + (at - t0) / t_max * (W - PAD - 10)
        right = x > W * 0.7  # a label near the right edge ends at its line, inside the plot
        anchor = ' text-anchor="end"' if right else ""
        out.append(f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{H - PAD}" stroke="#c00" stroke-dasharray="4"/>'
                   f'<text x="{x - 3 if right else x + 3:.1f}" y="22" font-size="11" fill="#c00"{anchor}>'
                   f'{_esc(label)}</text>')
    return _svg(out) + f"<p>{len(rows)} windows of steps; the band spans every host</p>"


def busbw_plot(healthcheck: HealthVerdict | None) -> str:
    rows = healthcheck.bandwidth if healthcheck is not None else []
    if not rows:
        return "<p>No health-check bandwidth in this run.</p>"
    # a log axis, a decade per tick: small messages' busbw is a thousandth of large ones'
    positive = [r.busbw_gbps for r in rows if r.busbw_gbps > 0] or [1.0]
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)) + 1e-9)
    high = max(high, low + 1)

    def up(gbps: float) -> float:  # 0-1 of the axis
        return (math.log10(gbps) - low) / (high - low) if gbps > 0 else 0.0
    ticks = [((d - low) / (high - low), f"{10.0 ** d:g}") for d in range(low, high + 1)]
    out = _axes("message size", "busbw (GB/s, log scale)", 0, "", y_ticks=ticks)
    width = (W - PAD - 20) / len(rows)
    for i, r in enumerate(rows):
        h = max(1.0, up(r.busbw_gbps) * (H - PAD - 10))
        x = PAD + 5 + i * width
        out.append(f'<rect class="busbw" x="{x:.1f}" y="{H - PAD - h:.1f}" width="{width * 0.8:.1f}" height="{h:.1f}" '
                   f'fill="#1f77b4"><title>{_esc(r.collective)} {r.bytes} B: '
                   f'{r.busbw_gbps:.4g} GB/s</title></rect>'
                   f'<text x="{x + width * 0.4:.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">'
                   f'{_size(r.bytes)}</text>')
    return _svg(out)


def pair_heatmap(pairs: Sequence[Probe]) -> str:
    """The pair gate's (or localization's) busbw per host pair against their median."""
    measured = [p for p in pairs if len(p.hosts) == 2]
    if not measured:
        return "<p>No pair bandwidth in this run (healthcheck.pairwise, or a localization, measures it).</p>"
    hosts = sorted({h for p in measured for h in p.hosts})
    values = [p.busbw_gbps for p in measured if p.busbw_gbps is not None]
    median = statistics.median(values) if values else 0.0
    cell = min(48, (W - 140) // max(1, len(hosts)))
    out = []
    for i, h in enumerate(hosts):
        out.append(f'<text x="130" y="{40 + i * cell + cell / 2 + 4:.0f}" text-anchor="end">{_esc(h)}</text>'
                   f'<text x="{140 + i * cell + cell / 2:.0f}" y="30" text-anchor="middle">{_esc(h)}</text>')
    for p in measured:
        a, b = (hosts.index(h) for h in p.hosts)
        bw = p.busbw_gbps
        ratio = bw / median if bw is not None and median else 0.0
        color = f"hsl({max(0.0, min(1.0, ratio)) * 120:.0f},70%,50%)"  # red (slow, failed) to green
        for x, y in ((a, b), (b, a)):
            out.append(f'<rect class="pair" x="{140 + x * cell}" y="{40 + y * cell}" width="{cell - 2}" '
                       f'height="{cell - 2}" fill="{color}"><title>{_esc(" + ".join(p.hosts))}: '
                       f'{"failed" if bw is None else f"{bw:.4g} GB/s ({ratio:.2f} x median)"}</title></rect>')
    return _svg(out, height=60 + len(hosts) * cell)


def goodput_bar(view: RunView) -> str:
    """The goodput ledger of an ended run as one bar: each cause's share of the wall time, in the
    order of a run's life, with a legend (and each part's seconds on hover)."""
    spent = ledger(view)
    if spent is None or spent.wall_s <= 0:
        return "<p>no ledger yet: the run has not ended</p>"
    width, x, out, legend = W - PAD - 10, float(PAD), [], []
    for cause in CAUSES:
        seconds = spent.parts[cause]
        if seconds <= 0:
            continue
        w = seconds / spent.wall_s * width
        share = f"{cause} {duration(seconds)} ({seconds / spent.wall_s:.0%})"
        out.append(f'<rect class="cause" data-cause="{cause}" x="{x:.1f}" y="10" width="{w:.1f}" height="28" '
                   f'fill="{CAUSE_COLORS[cause]}"><title>{_esc(share)}</title></rect>')
        x += w
        legend.append(share)
    for i, share in enumerate(legend):
        lx, ly = PAD + (i % 3) * (width // 3), 58 + (i // 3) * 18
        cause = share.split(" ", 1)[0]
        out.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{CAUSE_COLORS[cause]}"/>'
                   f'<text x="{lx + 16}" y="{ly}">{_esc(share)}</text>')
    return _svg(out, height=66 + (len(legend) + 2) // 3 * 18) + f"<p>{_esc(spent.line())}</p>"


def timeline(view: RunView) -> str:
    """What happened when, in the summary's words: launches, their ends, recoveries, stragglers."""
    t0 = view.started.t if view.started is not None else min(
        [launch.started.t for launch in view.launches], default=0.0)
    rows: list[tuple[float, str]] = []
    for launch in view.launches:
        e = launch.started
        rows.append((e.t, f"stage {e.stage} started on {hosts_named(e.hosts)} (master {e.master}:{e.port})"))
        if launch.result is not None:
            rows.append((launch.result.ended_at or e.t, f"stage {e.stage} {stage_verdict(launch.result)}"))
    for r in view.recoveries:
        rows.append((r.detected_at, f"restart (relaunch {r.number}): {r.failure}" if r.failure else
                     f"grown back (relaunch {r.number}): {r.describe()}" if r.grown else
                     f"recovery {r.number}: {', '.join(r.lost)} lost; "
                     + ", ".join(f"{a} → {b}" for a, b in r.replaced.items())))
    rows += [(b.t, f"{b.host} back as a spare ({back_why(b)})") for b in view.hosts_back]
    for s in view.stragglers:
        rows.append((s.named_at, f"straggler {s.host} (rank{'s' if len(s.ranks) > 1 else ''} "
                     f"{', '.join(map(str, s.ranks))}): {s.slowdown:.0%} slower since step {s.since_step}"))
    if view.ended is not None:
        rows.append((view.ended.t, f"run ended: {view.ended.state} (exit {view.ended.exit_code})"))
    cells = "".join(f"<tr><td>{at - t0:.1f} s</td><td>{_esc(text)}</td></tr>" for at, text in sorted(rows))
    return "<table class='timeline'><tr><th>at</th><th>what</th></tr>" + cells + "</table>"


def _size(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n}B"


def _svg(parts: list[str], height: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" '
            f'font-size="12">' + "".join(parts) + "</svg>")


def render(view: RunView, windows: Sequence[StepWindow] = ()) -> str:
    """The page of a run: its fold, and every window of steps judged, in order."""
    health = view.healthcheck
    pairs = list(health.pairs.pairs) if health is not None and health.pairs is not None else []
    loc = view.localization
    pairs = pairs or ([*loc.pairs, *loc.repairs] if loc is not None else [])
    title = f"run {view.run_id}"
    started = view.started
    head = f"{_esc(started.backend)} backend, hosts {_esc(hosts_named(started.hosts))}" if started else ""
    state = f"{view.ended.state} (exit {view.ended.exit_code})" if view.ended else "running (no end in its log yet)"
    summary = f"<pre>{_esc(summarize(view))}</pre>" if view.ended else ""
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + _esc(title) + "</title><style>"
            "body{font-family:sans-serif;margin:24px;max-width:820px}h2{margin-top:28px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            "pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}</style></head><body>"
            f"<h1>{_esc(title)}: {_esc(state)}</h1><p>{head}</p>"
            "<h2>Where the wall time went (goodput)</h2>" + goodput_bar(view)
            + "<h2>Compute per step of every host against the median host's (step time minus wait at the collectives)</h2>"
            + step_plot(view, windows)
            + "<h2>Health check: busbw per message size</h2>" + busbw_plot(health)
            + "<h2>Pair bandwidth (busbw against the median)</h2>" + pair_heatmap(pairs)
            + "<h2>Timeline</h2>" + timeline(view)
            + ("<h2>Summary</h2>" + summary if summary else "") + "</body></html>\n")


def page_of(run_dir: Path) -> str:
    """The page of the run whose directory is `run_dir` (its event log, read once, an event at a
    time: of a day's windows of steps at most MAX_WINDOWS are kept, evenly spread)."""
    view, windows = RunView(), _Spread(MAX_WINDOWS)
    for event in events_from(run_dir):
        view.add(event)
        if isinstance(event, StepWindow):
            windows.add(event)
    view.run_id = view.run_id or run_dir.name
    return render(view, windows.kept)


class _Spread:
    """Every `stride`-th of what is added, at most `cap` of them: past `cap`, every other one kept
    is dropped and the stride doubles (evenly spread over everything added, whatever its length)."""

    def __init__(self, cap: int):
        self.cap, self.stride, self.seen = cap, 1, 0
        self.kept: list[StepWindow] = []

    def add(self, item: StepWindow) -> None:
        if self.seen % self.stride == 0:
            self.kept.append(item)
            if len(self.kept) > self.cap:
                self.kept, self.stride = self.kept[::2], self.stride * 2
        self.seen += 1
