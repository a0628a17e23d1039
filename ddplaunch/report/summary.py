"""A run's summary, from the one fold of its events (record/view.py): the text people read after
a run — the first failing host and rank with its own last lines, then every host's outcome, the
recoveries, stragglers and dropped spares, where the wall time went (report/goodput.py) — and
`--json`'s object. What a launch's end says of it (`stage_verdict`) is said the same way here and
on the run page.
Pure: a view in, text out.
"""

from __future__ import annotations

import json

from ddplaunch.plan.launch import Stage
from ddplaunch.record.events import HostBack
from ddplaunch.record.incidents import Recovery
from ddplaunch.record.results import STATE_ORDER, NodeState, StageResult, job_failure
from ddplaunch.record.view import RunView
from ddplaunch.report.goodput import ledger, save_advice, worth_saying


def summarize(report: RunView, tail_lines: int = 10) -> str:
    """The human summary of a run, worst news first."""
    out = [f"stopped by the {report.blocked} gate: no job was started"] if report.blocked else []
    for stage in report.stages:
        out += _stage_lines(stage, tail_lines)
    if report.recoveries:
        out.append(f"recovered from {_failures(report.recoveries)}:")
        for r in report.recoveries:
            out.append(f"  {r.describe()}")
            out.append(f"    after {r.since()}: {r.phases()}")
    if report.unrecovered:
        out.append(f"not recovered: {report.unrecovered}")
    out += [f"straggler: {s.describe()}" for s in report.stragglers]
    out += [f"spare {label} dropped while it waited: {why}" for label, why in report.spares_dropped.items()]
    out += [f"{back.host} came back as a spare ({back_why(back)})" for back in report.hosts_back]
    out += _durable(report)
    spent = worth_saying(report)
    if spent is not None:
        out.append(spent.line())
        out += save_advice(report, spent)
    code = report.exit_code
    out.append(f"run {report.run_id}: {'ok' if code == 0 else 'interrupted' if code == 130 else 'FAILED'} "
               f"(exit {code})")
    return "\n".join(out)


def back_why(back: HostBack) -> str:
    """`healthy for 30s`, or `readmitted by ddplaunch hosts clear`: why a lost host is a spare again."""
    return "readmitted by `ddplaunch hosts clear`" if back.cleared else f"healthy for {back.healthy_s:.0f}s"


def _durable(report: RunView) -> list[str]:
    """`checkpoint step 60 durable (1.2s after the job ended)`: the last job launch's newest
    ddplaunch.checkpoint save, as its rank 0 said at its exit."""
    jobs = [s for s in report.stages if s.stage == Stage.JOB and s.progress is not None]
    said = jobs[-1].progress.durable if jobs and jobs[-1].progress is not None else None
    if said is None:
        return []
    if said.failed:
        return [f"checkpoint step {said.step} NOT durable: {said.failed}"]
    return [f"checkpoint step {said.step} durable ({said.after_s:.1f}s after the job ended)"]


def _failures(recoveries: list[Recovery]) -> str:
    """`2 host failures and 1 job failure` (hosts lost together in one recovery count each)."""
    jobs = sum(1 for r in recoveries if r.failure)
    hosts = sum(max(1, len(r.lost)) for r in recoveries if not r.failure and not r.grown)
    counts = [(hosts, "host"), (jobs, "job")]
    failures = " and ".join(f"{n} {kind} failure{'s' if n > 1 else ''}" for n, kind in counts if n)
    grown = sum(1 for r in recoveries if r.grown)
    return failures + (f" (grown back {'once' if grown == 1 else f'{grown} times'} after)" if grown else "")


def stage_verdict(stage: StageResult) -> str:
    """How a launch ended: `ok`, `recovered (recovery N)`, `restarted (relaunch N)`, `INTERRUPTED`
    or `FAILED` — the summary's word and the run page's alike."""
    if stage.ok:
        return "ok"
    if stage.recovered:
        word = "recovered (recovery" if stage.lost_hosts else "restarted (relaunch"  # a restart lost no host
        return f"{word} {stage.recovered})"
    return "INTERRUPTED" if stage.interrupted else "FAILED"


def _stage_lines(stage: StageResult, tail_lines: int) -> list[str]:
    """One stage's part of the summary: one line when it went well (or was recovered)."""
    seconds = f"{stage.ended_at - stage.started_at:.1f}s" if stage.ended_at else ""
    took = f" in {seconds}" if seconds else ""
    restarts = ", ".join(f"{o.host} {o.restarts}x" for o in stage.outcomes if o.restarts)
    restarts = f"; workers restarted: {restarts}" if restarts else ""
    if stage.ok:
        return [f"stage {stage.stage}: ok on all {len(stage.outcomes)} node(s){took}{restarts}"]
    if stage.recovered:
        lost = ", ".join(f"{o.host} (node {o.node_rank})" for o in stage.lost_hosts)
        if lost:
            return [f"stage {stage.stage}: lost {lost}{took}: {stage_verdict(stage)}"]
        first = stage.first_failure  # a restart: what failed
        what = job_failure(first)[0] if first is not None else "failed"
        return [f"stage {stage.stage}: {what}{f' after {seconds}' if seconds else ''}: {stage_verdict(stage)}"]
    bad = [o for o in stage.outcomes if o.state != NodeState.OK]
    out = [f"stage {stage.stage}: {stage_verdict(stage)} on {len(bad)} of {len(stage.outcomes)} node(s){took}{restarts}"]
    out += [f"  missing host: {o.describe()}" for o in stage.outcomes if o.never_started]
    out += [f"  {line}" for line in stage.diagnosis]
    first = stage.first_failure
    if first is not None:
        out.append(f"  first failure: {first.describe()}")
        if first.cause:
            out.append(f"  rank {first.failed_rank} on {first.host} said:")
            out += [f"    {line}" for line in first.cause[-tail_lines:]]
        elif first.tail:
            out.append(f"  last lines from {first.host}:")
            out += [f"    {line}" for line in first.tail[-tail_lines:]]
    out.append("  every node:")
    for o in sorted(stage.outcomes, key=lambda o: (STATE_ORDER.index(o.state)
                                                    if o.state in STATE_ORDER else 0, o.node_rank)):
        out.append(f"    {o.describe()}")
    return out


def summary_json(report: RunView) -> str:
    """The machine-readable summary printed by `--json` (docs/check-schema.json)."""
    health, spent = report.healthcheck, ledger(report)
    return json.dumps({"run_id": report.run_id, "exit_code": report.exit_code, "blocked": report.blocked,
                       "goodput": spent.to_dict() if spent is not None else None,
                       "preflight": report.preflight.to_dict() if report.preflight is not None else None,
                       "healthcheck": health.to_dict() if health is not None else None,
                       "localization": report.localization.to_dict() if report.localization is not None else None,
                       "excluded": report.excluded, "recoveries": [r.to_dict() for r in report.recoveries],
                       "unrecovered": report.unrecovered, "stragglers": [s.to_dict() for s in report.stragglers],
                       "spares_dropped": report.spares_dropped,
                       "hosts_back": [{"host": b.host, "healthy_s": b.healthy_s, "cleared": b.cleared}
                                      for b in report.hosts_back],
                       "stages": [s.to_dict() for s in report.stages]}, indent=2, sort_keys=True)
