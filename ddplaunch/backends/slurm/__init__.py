"""Slurm backend: the stages run as `srun` steps of one allocation, followed like any backend.

Without an allocation, ddplaunch submits one (`sbatch`, a script that only holds the nodes; with
`slurm.requeue` it also passes the time-limit warning on and requeues itself), waits until it
runs and cancels it when the run is over. Inside an allocation (SLURM_JOB_ID set: `salloc`, or
an sbatch script) it uses that one: no second job, and ending the run ends its steps only. Every
stage, pre-flight probe, stack dump and pair probe is a step on exactly the nodes of its plan, so
the gate, the watchdog, exclusion and restart counts work as on SSH. `--detach` hands the whole
run to one batch script instead (detached.py): no launcher stays, so none of those run.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from ddplaunch.backends.contract import CommandFor, HostResult
from ddplaunch.backends.slurm.client import POLL_INTERVAL, SlurmClient, SlurmJob, describe_sbatch_error
from ddplaunch.backends.slurm.detached import (DetachedRequest, final_state, follow_output, job_active,
                                               render_detached)
from ddplaunch.backends.slurm.render import (AT_LAUNCH, StepRequest, allocation_request, in_step_order,
                                             step_request)
from ddplaunch.backends.slurm.step import SrunStep
from ddplaunch.console import LineSink
from ddplaunch.errors import BackendError, PlanError
from ddplaunch.hostlist import expand_hostlist
from ddplaunch.hostcmd import port_probe
from ddplaunch.outcomes import finish_outcome
from ddplaunch.plan import LaunchPlan, host_python, host_run_dir, quote
from ddplaunch.results import INTERRUPTED, LOST, RUNNING, UNREACHABLE, NodeOutcome, StageResult, stop_cause
from ddplaunch.spec import ClusterSpec, HostSpec

#: How long a probe step may take beyond its command's own timeout (step launch).
STEP_SLACK = 15.0
#: A probe's code for "Slurm could not start anything on this node".
UNREACHABLE_CODE = -1
#: After a node failed, how long the others may report their own failure before they are stopped.
REPORT_GRACE = 2.0


class SlurmBackend:
    """Runs plans as srun steps of an allocation (made here, or the one we are inside)."""

    name = "slurm"

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.client = SlurmClient(str(spec.resolve(spec.slurm.conf)) if spec.slurm.conf else None)
        self.job: Optional[SlurmJob] = None
        self.run_id: Optional[str] = None
        self.run_dir: Optional[Path] = None
        self.stop_event: Optional[threading.Event] = None
        self.restarts = 0
        #: The allocation's nodes in Slurm's order: a step numbers its nodes ($SLURM_NODEID) this way.
        self.order: dict[str, int] = {}
        self.inside = os.environ.get("SLURM_JOB_ID")
        explicit = "hosts" in spec.model_fields_set
        self.nodelist = [n for h in spec.hosts for n in expand_hostlist(h.label)] if explicit else None

    # ------------------------------------------------------------------ allocation

    def start_run(self, run_id: str, run_dir: Path, stop: threading.Event) -> None:
        self.run_id, self.run_dir, self.stop_event = run_id, run_dir, stop

    def output_path(self) -> str:
        out = Path(self.spec.workdir_path) / self.spec.slurm.output_dir
        return str(out / f"{self.run_id or 'RUN'}-%j.out")

    def allocation_text(self) -> str:
        if self.inside:
            return f"# allocation: this one (SLURM_JOB_ID={self.inside}); every stage is a step of it\n"
        return allocation_request(self.spec, self.run_id or "RUN", self.output_path(), self.nodelist).text()

    @property
    def max_parallel(self) -> int:
        """One srun step reaches every node of it at once: the allocation's, once known."""
        return max(1, len(self.order) or len(self.nodelist or ()) or self.spec.slurm.nodes or 1)

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        if self.nodelist and self.spec.slurm.nodes and self.spec.slurm.nodes != len(self.nodelist):
            raise PlanError(f"slurm.nodes is {self.spec.slurm.nodes} but hosts lists {len(self.nodelist)} node(s): "
                            "hosts are the node list of the allocation; drop one of the two")
        if not allocate and not self.inside:
            if self.nodelist:
                return [HostSpec(addr=n, name=n) for n in self.nodelist]
            # placeholders for a dry run: Slurm names the nodes when it allocates them
            return [HostSpec.model_construct(addr=f"<node{i}>", name=f"<node{i}>")
                    for i in range(self.spec.slurm.nodes or 1)]
        if self.inside:
            names = self.client.hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
            if self.nodelist:
                missing = sorted(set(self.nodelist) - set(names))
                if missing:
                    raise PlanError(f"hosts {', '.join(missing)} are not in this allocation "
                                    f"(SLURM_JOB_ID={self.inside}: {', '.join(names)})")
                names = [n for n in names if n in self.nodelist]
            self.job = self.job or SlurmJob(job_id=self.inside, owned=False, slurm_conf=self.client.conf)
            if self.run_dir is not None:
                self.job.save(self.run_dir)
            self.order = {n: i for i, n in enumerate(names)}
            return [HostSpec(addr=n, name=n) for n in names]
        if self.job is None:
            self._submit()
        info = self._wait_running()
        names = self.client.hostnames(info.get("NodeList", ""))
        self.order = {n: i for i, n in enumerate(names)}
        return [HostSpec(addr=n, name=n) for n in names]

    def _submit(self) -> None:
        out = Path(self.output_path().replace("%j", "x")).parent
        out.mkdir(parents=True, exist_ok=True)
        request = allocation_request(self.spec, self.run_id or "RUN", self.output_path(), self.nodelist)
        proc = self.client.run(list(request.argv), stdin=request.script)
        if proc.returncode != 0:
            raise BackendError(describe_sbatch_error(proc.stderr or proc.stdout))
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise BackendError(f"sbatch printed no job id: {proc.stdout.strip()!r} {proc.stderr.strip()!r}")
        self.job = SlurmJob(job_id=job_id, owned=True, slurm_conf=self.client.conf,
                            output_path=self.output_path().replace("%j", job_id))
        if self.run_dir is not None:
            self.job.save(self.run_dir)

    def _wait_running(self) -> dict[str, str]:
        """Wait until the allocation runs (again, after a requeue); `scontrol show job` of it."""
        assert self.job is not None
        told = None
        while True:
            if self.stop_event is not None and self.stop_event.is_set():
                raise KeyboardInterrupt
            info = self.client.job_info(self.job.job_id)
            state = info.get("JobState", "UNKNOWN")
            if state == "RUNNING":
                self.restarts = int(info.get("Restarts", "0") or 0)
                return info
            if state in ("CANCELLED", "FAILED", "TIMEOUT", "COMPLETED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
                         "OUT_OF_MEMORY", "PREEMPTED") or not info:
                raise BackendError(f"allocation job {self.job.job_id} ended {state} before it ran "
                                   f"(reason {info.get('Reason', '?')}); see {self.job.output_path}")
            if state != told:
                told = state
            time.sleep(POLL_INTERVAL)

    def _requeued(self) -> bool:
        """Whether the allocation was requeued (the holder passes on the time-limit warning and
        requeues itself once the steps have ended; `scontrol requeue` does it at once)."""
        if self.job is None or not self.job.owned:
            return False
        deadline = time.monotonic() + (self.spec.slurm.signal_seconds + 10 if self._preempt_seen() else 2)
        while time.monotonic() < deadline:
            info = self.client.job_info(self.job.job_id)
            if int(info.get("Restarts", "0") or 0) > self.restarts or \
                    info.get("JobState", "") in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
                return True
            time.sleep(POLL_INTERVAL)
        return False

    def _preempt_seen(self) -> bool:
        path = self.job.output_path if self.job else None
        try:
            text = Path(path).read_text(errors="replace") if path else ""
        except OSError:
            return False
        marks = [line for line in text.splitlines() if line.startswith(("DDPLAUNCH_ALLOCATION", "DDPLAUNCH_PREEMPT"))]
        return bool(marks) and marks[-1].startswith("DDPLAUNCH_PREEMPT")

    # ------------------------------------------------------------------ stages

    def render(self, plan: LaunchPlan) -> StepRequest:
        job = self.job.job_id if self.job else (self.inside or AT_LAUNCH)
        return step_request(in_step_order(plan, self.order), job, self.spec.slurm.cpus_per_task)

    def launch(self, request: StepRequest, sink: LineSink, stop: threading.Event) -> StageResult:
        plan = request.plan
        hosts = plan.hosts
        outcomes = [NodeOutcome(node_rank=i, host=h, state=RUNNING) for i, h in enumerate(hosts)]
        result = StageResult(stage=plan.stage, outcomes=outcomes)
        env = dict(request.env)
        for src, argv in request.uploads:
            proc = self.client.run(list(argv), stdin=Path(src).read_text(), env=env)
            if proc.returncode != 0:
                for o in outcomes:
                    o.state, o.detail, o.ended_at = UNREACHABLE, f"staging {Path(src).name} failed: " \
                        f"{proc.stderr.strip()[-300:]}", time.time()
                result.requeued = self._requeued()
                result.ended_at = time.time()
                return result
        for h in hosts:
            sink.state(h, f"running {plan.stage}")
        step = SrunStep(self.client, list(request.argv), env, hosts, sink, f"ddplaunch-{plan.stage}", request.job)
        cause, failed_at = None, None
        while step.poll() is None:
            if step.first_failure is not None and cause is None:
                cause, failed_at = f"{step.host(step.first_failure)} (node {step.first_failure}) failed", time.time()
                sink.note(f"{cause}: stopping every other node")
            if failed_at is not None and time.time() - failed_at > REPORT_GRACE:
                # the others had a moment to report their own failures (a rank that failed at the
                # same time is then told apart from one that only saw its peer die); now stop them
                sink.mute(set(range(len(hosts))) - {step.first_failure})
                for o in outcomes:
                    if o.node_rank not in step.ends:
                        o.state, o.detail = INTERRUPTED, f"stopped by ddplaunch: {cause}"
                step.stop()
                break
            if stop.is_set():
                result.interrupted = stop_cause(stop) is None
                cause = stop_cause(stop) or "interrupted by the user"
                sink.note(f"{cause}: stopping every node (SIGTERM to the step's tasks)")
                sink.mute(set(range(len(hosts))))
                step.stop()
                for o in outcomes:
                    if o.node_rank not in step.ends:
                        o.state, o.detail = INTERRUPTED, f"stopped by ddplaunch: {cause}"
                break
            time.sleep(0.1)
        rc = step.wait(timeout=60)
        failed = step.first_failure
        never = self._never_started(plan) if rc != 0 else set()
        for o in outcomes:
            code, how, when = step.ends.get(o.node_rank, (None, "", time.time()))
            o.ended_at = when
            if o.node_rank in never:
                o.state, o.never_started = INTERRUPTED, True
                o.detail = "its setup lines were still running when the step ended"
                sink.note(f"{o.host} (node {o.node_rank}): torchrun never started (blocked before launch)")
            elif o.state == INTERRUPTED:
                pass
            elif code is not None:
                finish_outcome(o, sink, code)
                continue
            elif rc == 0:
                finish_outcome(o, sink, 0)
                continue
            elif failed is not None:
                o.state = INTERRUPTED
                o.detail = f"stopped by ddplaunch after {step.host(failed)} (node {failed}) failed"
            else:
                o.state, o.detail = LOST, f"srun ended with {rc}: {how or 'no exit status for this node'}"
            finish_outcome(o, sink, code)
        if rc != 0 and not result.interrupted:
            result.requeued = self._requeued()
        result.ended_at = time.time()
        return result

    def _never_started(self, plan: LaunchPlan) -> set[int]:
        """Nodes that wrote no pid file: their setup lines never reached `exec torchrun`."""
        run_dir = host_run_dir(plan.run_id)
        answers = self._step_run(f"[ -f {run_dir}/node$SLURM_NODEID.pid ] && echo DDPLAUNCH_PID_OK || "
                                 "echo DDPLAUNCH_PID_NONE", plan.hosts, 20)
        return {i for i, h in enumerate(plan.hosts) if "DDPLAUNCH_PID_NONE" in answers.get(h, (0, ""))[1]}

    # ------------------------------------------------------------------ short commands

    def _step_run(self, script: str, hosts: list[str], timeout: float) -> dict[str, tuple[int, str]]:
        """Run `script` (bash, on stdin) as one step on `hosts`; {host: (exit code, output)}."""
        job = self._job_id()
        hosts = sorted(hosts, key=lambda h: self.order.get(h, len(self.order)))  # the step's node order
        argv = ["srun", f"--jobid={job}", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}",
                "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}", "--overlap", "--label",
                "--input=all", f"--time={max(1, int(timeout // 60) + 1)}", "--job-name=ddplaunch-probe",
                "bash", "-c", "exec bash -s"]
        step = SrunStep(self.client, argv, {}, hosts, None, "ddplaunch-probe", job, stdin=script)
        rc = step.wait(timeout=timeout + STEP_SLACK)
        if rc is None:
            step.stop(grace=2)
            return {h: (UNREACHABLE_CODE, f"no answer within {timeout:.0f}s") for h in hosts}
        if step.unreachable and len(step.unreachable) < len(hosts):
            # srun aborts the whole step when it cannot start on one node: ask the others again
            rest = [h for h in hosts if h not in step.unreachable]
            answers = self._step_run(script, rest, timeout)
            answers.update({h: (UNREACHABLE_CODE, f"Slurm cannot start a step there: {why}")
                            for h, why in step.unreachable.items()})
            return answers
        answers = {}
        for i, h in enumerate(hosts):
            if h in step.unreachable:
                answers[h] = (UNREACHABLE_CODE, f"Slurm cannot start a step there: {step.unreachable[h]}")
            else:
                code = step.ends.get(i, (0, "", 0.0))[0]
                answers[h] = (rc if code is None else code, "\n".join(step.output.get(i, [])))
        return answers

    def _job_id(self) -> str:
        if self.job is None:
            if self.inside:
                return self.inside
            raise BackendError("no Slurm allocation yet")
        return self.job.job_id

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        targets = list(self.hosts(allocate=False) if hosts is None and self.job is None and not self.inside
                       else hosts if hosts is not None else self._known_hosts())
        cases = "\n".join(f"  {quote(h.label)}) {command(h)} ;;" for h in targets)
        script = f'case "$SLURMD_NODENAME" in\n{cases}\n  *) echo "not a node of this run" >&2; exit 97 ;;\nesac\n'
        answers = self._step_run(script, [h.label for h in targets], timeout)
        results: list[HostResult] = []
        for h in targets:
            code, out = answers[h.label]
            if code == UNREACHABLE_CODE:
                results.append((h, None, BackendError(f"{h.label}: {out}")))
            else:
                results.append((h, (code, out), None))
        return results

    def _known_hosts(self) -> list[HostSpec]:
        return self.hosts(allocate=True)

    def port_free(self, addr: str, port: int) -> bool:
        host = HostSpec(addr=addr, name=addr)
        probe = port_probe(port)
        (_, answer, err), = self.probe(lambda h: f"{quote(host_python(self.spec, None))} -c {quote(probe)}",
                                       timeout=20, hosts=[host])
        return err is not None or answer is None or answer[0] == 0

    # ------------------------------------------------------------------ records

    def status(self, record: dict) -> list[str]:
        job, client = self._recorded_job(record)
        if job is None:
            return []
        info = client.job_info(job.job_id)
        state = client.job_state(job.job_id) or info.get("JobState") or "ended (no longer known to slurmctld)"
        whose = "detached: its batch script runs every stage" if record.get("extra", {}).get("detached") else \
            "submitted by this run" if job.owned else "its allocation"
        line = f"  slurm job {job.job_id} ({whose}): {state}"
        if info.get("NodeList") not in (None, "", "(null)"):
            line += f" on {info['NodeList']}"
        return [line] + ([f"  output: {job.output_path}"] if job.output_path else [])

    def logs(self, record: dict, follow: bool) -> Optional[Iterator[str]]:
        """A detached run's lines come from its job's output (the record has none)."""
        job, client = self._recorded_job(record, detached=True)
        if job is None or not job.output_path:
            return None
        return follow_output(Path(job.output_path), lambda: job_active(client.job_state(job.job_id)), follow)

    def down(self, record: dict) -> list[str]:
        job, client = self._recorded_job(record)
        if job is None:
            return [f"run {record['run_id']}: no Slurm job recorded (nothing was submitted)"]
        if not job.owned:
            steps = client.run(["squeue", "-s", "-h", "-j", job.job_id, "-o", "%i %j"]).stdout.split("\n")
            ours = [s.split()[0] for s in steps if len(s.split()) == 2 and s.split()[1].startswith("ddplaunch-")]
            for step in ours:
                client.run(["scancel", step])
            return [f"allocation {job.job_id}: cancelled {len(ours)} step(s) of this run; the allocation stays"]
        state = client.job_state(job.job_id)
        if state is None:
            return [f"job {job.job_id}: not in the queue (already ended)"]
        client.cancel(job.job_id)
        return [f"job {job.job_id}: was {state}, cancelled"]

    def render_detached(self, plans: list[LaunchPlan]) -> DetachedRequest:
        if self.inside:
            raise PlanError(f"--detach inside an allocation (SLURM_JOB_ID={self.inside}): drop --detach to run "
                            "the stages as steps of this allocation, or submit from outside it")
        return render_detached(self.spec, plans, self.output_path(), self.nodelist)

    def detach(self, request: DetachedRequest, run_dir: Path) -> str:
        """Submit the detached job: sbatch with the script on stdin and only the job's environment."""
        Path(self.output_path().replace("%j", "x")).parent.mkdir(parents=True, exist_ok=True)
        proc = self.client.run(list(request.argv), stdin=request.script, inherit=False,
                               env=request.process_env(os.environ))
        job_id = proc.stdout.strip().split(";")[0]
        if proc.returncode != 0 or not job_id.isdigit():
            raise BackendError(describe_sbatch_error(proc.stderr or proc.stdout))
        SlurmJob(job_id=job_id, owned=True, slurm_conf=self.client.conf,
                 output_path=self.output_path().replace("%j", job_id)).save(run_dir)
        return (f"submitted Slurm job {job_id}; follow it with `ddplaunch logs {run_dir.name} -f`, "
                f"`ddplaunch status {run_dir.name}`; stop it with `ddplaunch down {run_dir.name}`")

    def final_state(self, record: dict) -> Optional[str]:
        job, client = self._recorded_job(record, detached=True)
        if job is None:
            return None
        return final_state(job.output_path, client.job_state(job.job_id), client.job_info(job.job_id))

    def _recorded_job(self, record: dict, detached: bool = False) -> tuple[Optional[SlurmJob], SlurmClient]:
        """The run's Slurm job (None: none recorded, or not a detached run when `detached`) and a
        client for the cluster it went to."""
        job = SlurmJob.load(Path(_run_dir(record)))
        if job is not None and detached and not record.get("extra", {}).get("detached"):
            job = None
        return job, SlurmClient(job.slurm_conf or self.client.conf) if job else self.client

    def close(self) -> None:
        """End the allocation ddplaunch made (never one it runs inside): SIGTERM to the holding
        script, which exits 0 (the job ends COMPLETED); scancel if it does not go."""
        if self.job is None or not self.job.owned:
            return
        try:
            self.client.run(["scancel", "--batch", "--signal=TERM", self.job.job_id])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self.client.job_state(self.job.job_id) in (None, "COMPLETED", "CANCELLED", "FAILED"):
                    return
                time.sleep(POLL_INTERVAL)
            self.client.cancel(self.job.job_id, wait=60)
        except BackendError:
            pass


def _run_dir(record: dict) -> str:
    from ddplaunch.runs import home

    return str(home() / "runs" / record["run_id"])
