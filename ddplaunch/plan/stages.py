"""Which launches a command makes, and on which hosts (pure).

`UpOptions` is what the `up`/`check` command line adds to the spec; `stages_of` the launches in
order (the job with the health check inline, or a health check of its own first); `plan_stage`
one launch's plan as `up`, `check` and the dry run make it; `exclude_hosts` the spec without
--exclude'd hosts; `preflight_wanted` whether the pre-flight runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ddplaunch.errors import PlanError
from ddplaunch.plan.emulation import Emulation
from ddplaunch.plan.launch import LaunchPlan, PlanContext, Stage, StageOptions, make_plan
from ddplaunch.spec.model import ClusterSpec


@dataclass
class UpOptions:
    """What the `up`/`check` command line adds to the spec."""

    skip_healthcheck: bool = False
    healthcheck_only: bool = False
    job_args: Optional[list[str]] = None
    run_id: Optional[str] = None
    detach: bool = False
    exclude: list[str] = field(default_factory=list)
    verbose: bool = False
    #: emulated ranks in place of torchrun and the job (`up --emulate N`)
    emulate: Optional[Emulation] = None

    def __post_init__(self) -> None:
        if isinstance(self.emulate, dict):  # handed over as data (plan/handoff.py)
            self.emulate = Emulation(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.emulate.items()})


def healthcheck_wanted(spec: ClusterSpec, opts: UpOptions) -> bool:
    """The health check runs (never with emulated ranks: they import no torch)."""
    return spec.healthcheck.enabled and not opts.skip_healthcheck and opts.emulate is None


def stages_of(spec: ClusterSpec, opts: UpOptions) -> list[Stage]:
    """The launches `up` makes, in order: one ("job", the health check inline) unless the spec
    asks for the health check as a launch of its own (`healthcheck.launch: separate`)."""
    if opts.healthcheck_only:
        if not healthcheck_wanted(spec, opts):
            raise PlanError("nothing to run: the health check is disabled (healthcheck.enabled: false) "
                            "and `check` runs no job")
        return [Stage.HEALTHCHECK]
    if healthcheck_wanted(spec, opts) and spec.healthcheck.launch == "separate":
        return [Stage.HEALTHCHECK, Stage.JOB]
    return [Stage.JOB]


def plan_stage(spec: ClusterSpec, run_id: str, stage: Stage, port: int, opts: UpOptions,
               recovery: int = 0) -> LaunchPlan:
    """One launch's plan: `check` always tests host pairs; `up` when `healthcheck.pairwise`.

    `check` with one process per host starts the health check directly (the torchrun env contract
    set by the launcher, as the localization launches do): a torchrun agent would import torch a
    second time on every host, about 40 % of a 4-host check here, to start one process. The
    pre-flight has already checked torch and the master's port; `up` always runs torchrun.
    """
    inline = stage is Stage.JOB and healthcheck_wanted(spec, opts) and spec.healthcheck.launch == "inline"
    how = StageOptions(direct=opts.healthcheck_only and spec.nproc_per_node == 1, inline_healthcheck=inline,
                       pairwise=opts.healthcheck_only or spec.healthcheck.pairwise, recovery=recovery)
    return make_plan(PlanContext(spec, run_id, opts.job_args, opts.emulate), stage, port, how)


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
