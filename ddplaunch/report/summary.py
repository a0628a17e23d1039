"""A run's outcome as data (`RunReport`), its summary and its exit code, computed in one place.

`summarize` turns stage results into the text users read after a run: the first failing host
and rank with its last lines, then every host's outcome. `exit_code` maps results to 0/1/130;
`summary_json` is what `--json` prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from ddplaunch.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from ddplaunch.record.incidents import Recovery
from ddplaunch.record.incidents import Straggler
from ddplaunch.record.results import STATE_ORDER, StageResult


@dataclass
class RunReport:
    """The outcome of one `up` or `check`."""

    run_id: str
    final_stage: str = "job"
    stages: list[StageResult] = field(default_factory=list)
    healthcheck: Optional[dict[str, Any]] = None
    preflight: Optional[dict[str, Any]] = None
    localization: Optional[dict[str, Any]] = None
    excluded: list[str] = field(default_factory=list)
    #: What stopped the run before its last stage ("pre-flight", "health check"), if anything.
    blocked: Optional[str] = None
    #: Host failures the run survived (recovery.Recovery), and why it did not survive one.
    recoveries: list[Recovery] = field(default_factory=list)
    unrecovered: Optional[str] = None
    #: Hosts named slower than their peers while the job ran (stragglers.Straggler).
    stragglers: list[Straggler] = field(default_factory=list)
    #: Spares that stopped answering while they waited, dropped (label -> why).
    spares_dropped: dict[str, str] = field(default_factory=dict)
    #: Wall time of the run.
    wall_s: float = 0.0
    #: A dry run's text: exactly what `up` would execute (ddplaunch.up(..., dry_run=True)).
    plan_text: Optional[str] = None

    @property
    def exit_code(self) -> int:
        """0, 1 or 130, as `ddplaunch up` exits (a dry run: 0, it ran nothing)."""
        if self.plan_text is not None:
            return 0
        return exit_code(self.stages, self.final_stage, self.blocked)


def exit_code(stages: list[StageResult], final_stage: str = "job", blocked: Optional[str] = None) -> int:
    """130 when the user interrupted; 0 when the last stage ran and passed and no gate stopped
    the run (a failed health check whose bad hosts were excluded does not count); else 1."""
    if any(s.interrupted for s in stages):
        return EXIT_INTERRUPTED
    if blocked or not stages or stages[-1].stage != final_stage:
        return EXIT_FAILURE
    return EXIT_OK if stages[-1].ok else EXIT_FAILURE


def summarize(report: RunReport, tail_lines: int = 10) -> str:
    """The human summary of a run, worst news first."""
    out = [f"stopped by the {report.blocked} gate: no job was started"] if report.blocked else []
    for stage in report.stages:
        out += _stage_lines(stage, tail_lines)
    if report.recoveries:
        n = len(report.recoveries)
        out.append(f"recovered from {n} host failure{'s' if n > 1 else ''}:")
        for r in report.recoveries:
            out.append(f"  {r.describe()}")
            out.append(f"    after the host was last heard from: {r.phases()}")
    if report.unrecovered:
        out.append(f"not recovered: {report.unrecovered}")
    out += [f"straggler: {s.describe()}" for s in report.stragglers]
    out += [f"spare {label} dropped while it waited: {why}" for label, why in report.spares_dropped.items()]
    training = sum(s.progress.training_s for s in report.stages if s.progress is not None)
    if training >= 1 and report.wall_s:
        out.append(f"training time: {_duration(training)} of {_duration(report.wall_s)} wall "
                   f"({100 * training / report.wall_s:.0f}% effective)")
    code = report.exit_code
    out.append(f"run {report.run_id}: {'ok' if code == 0 else 'interrupted' if code == 130 else 'FAILED'} "
               f"(exit {code})")
    return "\n".join(out)


def _stage_lines(stage: StageResult, tail_lines: int) -> list[str]:
    """One stage's part of the summary: one line when it went well (or was recovered)."""
    took = f" in {stage.ended_at - stage.started_at:.1f}s" if stage.ended_at else ""
    restarts = ", ".join(f"{o.host} {o.restarts}x" for o in stage.outcomes if o.restarts)
    restarts = f"; workers restarted: {restarts}" if restarts else ""
    if stage.ok:
        return [f"stage {stage.stage}: ok on all {len(stage.outcomes)} node(s){took}{restarts}"]
    if stage.recovered:
        lost = ", ".join(f"{o.host} (node {o.node_rank})" for o in stage.lost_hosts)
        return [f"stage {stage.stage}: lost {lost}{took}: recovered (recovery {stage.recovered})"]
    bad = [o for o in stage.outcomes if o.state != "ok"]
    verdict = "INTERRUPTED" if stage.interrupted else "FAILED"
    out = [f"stage {stage.stage}: {verdict} on {len(bad)} of {len(stage.outcomes)} node(s){took}{restarts}"]
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


def _duration(seconds: float) -> str:
    """`41s`, `3m10s`, `2h05m`."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def summary_json(report: RunReport) -> str:
    """The machine-readable summary printed by `--json`."""
    return json.dumps({"run_id": report.run_id, "exit_code": report.exit_code, "blocked": report.blocked,
                       "preflight": report.preflight, "healthcheck": report.healthcheck,
                       "localization": report.localization, "excluded": report.excluded,
                       "recoveries": [r.to_dict() for r in report.recoveries], "unrecovered": report.unrecovered,
                       "stragglers": [s.to_dict() for s in report.stragglers],
                       "spares_dropped": report.spares_dropped,
                       "stages": [s.to_dict() for s in report.stages]}, indent=2, sort_keys=True)
