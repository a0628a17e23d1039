"""Slurm backend: the stages run as `srun` steps of one allocation, followed like any backend.

The allocation (allocation.py) is submitted by ddplaunch, or the one it runs inside. Every stage,
pre-flight probe, stack dump and pair probe is a step on exactly the nodes of its plan, so the
gate, the watchdog, exclusion and restart counts work as on SSH. The backend is also a
`Scheduler`: `--detach` submits the allocation with the run's supervisor in its batch script
(detached.py), which runs all of that inside the allocation, with no launcher at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

from ddplaunch.backends.contract import CommandFor, HostResult, JobEnd, Request, RunContext, StopEvent
from ddplaunch.backends.failfast import follow, unanswered, unstarted
from ddplaunch.backends.shell import (describe_reap, free_checkpoints_command, pid_file, reaper_command, runtime_of,
                                      stage_bundle)
from ddplaunch.backends.slurm.allocation import Allocation
from ddplaunch.backends.slurm.client import SlurmClient, SlurmJob, describe_sbatch_error
from ddplaunch.backends.slurm.detached import DetachedRequest, final_state, follow_output, job_active, render_detached
from ddplaunch.backends.slurm.render import (AT_LAUNCH, NODE_ID, NODE_RANK, StepRequest, node_rank_case, pyxis_of,
                                             step_request, task_nodes)
from ddplaunch.backends.slurm.step import SrunStage, SrunStep
from ddplaunch.errors import BackendError, PlanError
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.hostprogram import parse_answer, port_probe
from ddplaunch.plan.launch import LaunchPlan, tool_python
from ddplaunch.plan.shellword import word
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.results import UNREACHABLE, StageResult
from ddplaunch.record.runs import InJob, RunRecord
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: How long a probe step may take beyond its command's own timeout (step launch).
STEP_SLACK = 15.0
#: A probe's code for "Slurm could not start anything on this node".
UNREACHABLE_CODE = -1


class SlurmBackend:
    """Runs plans as srun steps of an allocation (made here, or the one we are inside)."""

    name = "slurm"

    def __init__(self, spec: ClusterSpec, run: RunContext):
        self.spec = spec
        self.client = SlurmClient(str(spec.resolve(spec.slurm.conf)) if spec.slurm.conf else None)
        self.alloc = Allocation(spec, self.client, run)
        self._slurmd_port: Optional[int] = None
        #: the run whose checkpoints `close` frees from the nodes' RAM: set once this backend
        #: launched a stage of a spec with a `checkpoint:` section (None: none, or freed already)
        self._ckpt_run: Optional[str] = None

    # ------------------------------------------------------------------ the Launcher contract

    @property
    def max_parallel(self) -> int:
        """One srun step reaches every node of it at once: the allocation's, once known."""
        return self.alloc.size()

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        return self.alloc.hosts(allocate)

    def spares(self) -> list[HostSpec]:
        return self.alloc.spares()

    def allocation_text(self) -> str:
        return self.alloc.text()

    def render(self, plan: LaunchPlan) -> StepRequest:
        job = self.alloc.job.job_id if self.alloc.job else (self.alloc.inside or AT_LAUNCH)
        return step_request(plan, job, self.spec.slurm.cpus_per_task, pyxis=pyxis_of(self.spec),
                            by_name=self._by_name())

    def _by_name(self) -> bool:
        """Whether the nodes are known by name (a node list, or the allocation's): then each takes
        its node rank by its name; placeholders of a dry run keep the step's numbering."""
        return bool(self.alloc.order or self.alloc.nodelist)

    def launch(self, request: StepRequest, lines: StageLines, stop: StopEvent) -> StageResult:
        plan = request.plan
        if self.spec.checkpoint is not None:
            self._ckpt_run = plan.run_id
        env = dict(request.env)
        if request.upload:
            bundle = stage_bundle([Path(src).read_bytes() for src in request.staged()])
            proc = self.client.run(list(request.upload), stdin=bundle, env=env)
            if proc.returncode != 0:
                why = f"staging the run's files failed: {proc.stderr.strip()[-300:]}"
                result = unstarted(plan, UNREACHABLE, {n.node_rank: why for n in plan.nodes})
                result.rescheduled = self.alloc.requeued()
                return result
        step = SrunStep(self.client, list(request.argv), env, plan.hosts, lines, f"ddplaunch-{plan.stage}", request.job,
                        task_node=task_nodes(plan.hosts, self.alloc.order))
        stage = SrunStage(step, lambda nodes: self._never_started(plan, nodes),
                          lambda node: self._unanswered(plan.hosts[node]),
                          lambda lost: self._after_loss(plan, lost),
                          self.spec.job.stop_grace)
        result = follow(stage, plan, lines, stop, detect=self.spec.recovery.detect_timeout,
                        stop_grace=self.spec.job.stop_grace)
        if stage.rc != 0 and not result.interrupted:
            result.rescheduled = self.alloc.requeued()
        return result

    def reach(self, hosts: list[HostSpec], timeout: float = 30) -> list[HostResult]:
        """A step of `true` on the nodes: one that Slurm cannot start a step on gets its reason."""
        return self.probe(lambda h: "true", timeout=timeout, hosts=hosts)

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        if hosts is not None:
            targets = hosts
        elif self.alloc.job is None and not self.alloc.inside:
            targets = self.hosts(allocate=False)
        else:
            targets = self.hosts(allocate=True)
        cases = "\n".join(f"  {word(h.label)}) {command(h)} ;;" for h in targets)
        script = f'case "$SLURMD_NODENAME" in\n{cases}\n  *) echo "not a node of this run" >&2; exit 97 ;;\nesac\n'
        answers = self._step_run(script, [h.label for h in targets], timeout)
        results: list[HostResult] = []
        for h in targets:
            code, out = answers[h.label]
            if code == UNREACHABLE_CODE:
                results.append(HostResult(h, None, BackendError(f"{h.label}: {out}")))
            else:
                results.append(HostResult(h, (code, out), None))
        return results

    def port_free(self, addr: str, port: int) -> bool:
        host = HostSpec(addr=addr, name=addr)
        probe = port_probe(port)
        (_, answer, err), = self.probe(lambda h: f"{word(tool_python(self.spec, None))} -c {word(probe)}",
                                       timeout=20, hosts=[host])
        return err is not None or answer is None or answer[0] == 0

    def down(self, record: RunRecord) -> list[str]:
        """What is left of the run on its job's nodes ended and its checkpoints freed from their
        RAM (while the job still holds them), then the job (or the run's steps) cancelled."""
        return self._free_recorded(record) + self.cancel(record)

    def _free_recorded(self, record: RunRecord) -> list[str]:
        """With a `checkpoint:` section, one step on every node of the run's running job: the reaper
        ends what is left of the run there, then frees its checkpoints' RAM, each part's newest
        intact sealed version the durable dir lacks persisted first; a line per node. A job that no
        longer runs holds no node to ask (nothing is said: `cancel` says how it ended)."""
        if self.spec.checkpoint is None:
            return []
        job, client = self._recorded_job(record)
        try:
            running = job is not None and client.job_state(job.job_id) == "RUNNING"
            nodes = client.hostnames(client.job_info(job.job_id).get("NodeList", "")) if job and running else []
        except BackendError:
            return []
        if job is None or not nodes:
            return []
        self.alloc.job, self.alloc.order = job, {n: i for i, n in enumerate(nodes)}
        command, nonce = reaper_command(tool_python(self.spec, None), record.run_id, kill=True, term_pid_files=True,
                                        clean=True, containers=runtime_of(self.spec), free_checkpoints=True,
                                        durable=self.spec.checkpoint_durable())
        try:
            results = self.probe(lambda h: command, timeout=45, hosts=[self.alloc.host(n) for n in nodes])
        except BackendError as err:
            return [f"job {job.job_id}: its nodes could not be asked to end the run and free its checkpoints: {err}"]
        return [f"{host.label}: {err}" if err is not None or answer is None else
                f"{host.label}: {describe_reap(parse_answer(answer[1], nonce))}" for host, answer, err in results]

    def close(self) -> None:
        """The run is over: its checkpoints leave the RAM of the nodes that still answer (one step,
        with a `checkpoint:` section), then the allocation ddplaunch made ends."""
        if self._ckpt_run is not None:
            run_id, self._ckpt_run = self._ckpt_run, None
            nodes = [self.alloc.host(n) for n in self.alloc.order if n not in self.alloc.unreachable]
            python = tool_python(self.spec, None)
            command = free_checkpoints_command(python, [(run_id, self.spec.checkpoint_durable())])[0]
            try:
                if nodes:
                    self.probe(lambda h: command, timeout=20, hosts=nodes)
            except BackendError:
                pass  # the allocation is gone (its nodes' RAM with it, where Slurm cleans /dev/shm)
        self.alloc.release()

    # ------------------------------------------------------------------ short commands as steps

    def _unanswered(self, node: str) -> Optional[str]:
        """Why node `node` does not answer a connection to its slurmd (None: it does)."""
        if self._slurmd_port is None:
            self._slurmd_port = self.client.slurmd_port()
        return unanswered(self.client.node_addr(node), self._slurmd_port)

    def _after_loss(self, plan: LaunchPlan, lost: set[int]) -> None:
        """Nodes lost mid-stage: remembered (the allocation ends without waiting for them); what is
        left of the run on the others is ended."""
        self.alloc.unreachable.update(plan.hosts[i] for i in lost)
        self._reap([h for i, h in enumerate(plan.hosts) if i not in lost], plan.run_id)

    def _reap(self, nodes: list[str], run_id: str) -> None:
        """End what is left of the run on `nodes` (by its tag), as a probe step: after a loss, at
        once (the step's tasks had their SIGTERM, LOST_SRUN_S ago)."""
        hosts = [HostSpec(addr=n, name=n) for n in nodes]
        self.probe(lambda h: reaper_command(tool_python(self.spec, None), run_id, kill=True, term_pid_files=True,
                                            clean=True, containers=runtime_of(self.spec), now=True)[0],
                   timeout=45, hosts=hosts)

    def _never_started(self, plan: LaunchPlan, nodes: list[int]) -> set[int]:
        """Of `nodes`, those that wrote no pid file: their setup lines never reached `exec torchrun`."""
        hosts = [plan.nodes[n].host_label for n in nodes]
        by_name = self._by_name()  # as the stage's step named its pid files
        first = f"{node_rank_case(plan)}; " if by_name else ""
        answers = self._step_run(f"{first}[ -f {pid_file(plan.run_id, NODE_RANK if by_name else NODE_ID)} ] && "
                                 "echo DDPLAUNCH_PID_OK || echo DDPLAUNCH_PID_NONE", hosts, 20)
        return {n for n, h in zip(nodes, hosts) if "DDPLAUNCH_PID_NONE" in answers.get(h, (0, ""))[1]}

    def _step_run(self, script: str, hosts: list[str], timeout: float) -> dict[str, tuple[int, str]]:
        """Run `script` (bash, on stdin) as one step on `hosts`; {host: (exit code, output)}."""
        job = self.alloc.job_id()
        hosts = sorted(hosts, key=lambda h: self.alloc.order.get(h, len(self.alloc.order)))  # the step's node order
        argv = ["srun", f"--jobid={job}", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}",
                "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}", "--overlap", "--label",
                "--input=all", f"--time={max(1, int(timeout // 60) + 1)}", "--job-name=ddplaunch-probe",
                "bash", "-c", "exec bash -s"]
        step = SrunStep(self.client, argv, {}, hosts, None, "ddplaunch-probe", job, stdin=script)
        rc = step.wait(timeout=timeout + STEP_SLACK)
        if rc is None:
            step.stop(grace=2)
            return {h: (UNREACHABLE_CODE, f"no answer within {timeout:.0f}s") for h in hosts}
        self.alloc.unreachable.update(step.unreachable)
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

    # ------------------------------------------------------------------ the Scheduler contract

    def render_detached(self, spec_path: str, opts: UpOptions) -> DetachedRequest:
        if self.alloc.inside:
            raise PlanError(f"--detach inside an allocation (SLURM_JOB_ID={self.alloc.inside}): drop --detach to "
                            "run the stages as steps of this allocation, or submit from outside it")
        nodelist, nodes = self.alloc.requested()
        return render_detached(self.spec, self.alloc.run.run_id, spec_path, opts, self.alloc.output_path(), nodelist,
                               nodes, os.environ)

    def submit(self, request: Request, record: RunRecord) -> InJob:
        """Submit the detached job: sbatch with the script on stdin and only the job's environment."""
        assert isinstance(request, DetachedRequest)
        output = self.alloc.output_path()
        Path(output.replace("%j", "x")).parent.mkdir(parents=True, exist_ok=True)
        proc = self.client.run(list(request.argv), stdin=request.script, inherit=False,
                               env=request.process_env(os.environ))
        job_id = proc.stdout.strip().split(";")[0]
        if proc.returncode != 0 or not job_id.isdigit():
            raise BackendError(describe_sbatch_error(proc.stderr or proc.stdout))
        return InJob(job_id, f"submitted Slurm job {job_id}; follow it with `ddplaunch logs {record.run_id} -f`, "
                             f"`ddplaunch status {record.run_id}`; stop it with `ddplaunch down {record.run_id}`")

    def final_state(self, record: RunRecord) -> Optional[JobEnd]:
        job, client = self._recorded_job(record, detached=True)
        if job is None:
            return None
        return final_state(client.job_state(job.job_id), client.job_info(job.job_id))

    def job_running(self, record: RunRecord) -> bool:
        job, client = self._recorded_job(record, detached=True)
        return job is not None and job_active(client.job_state(job.job_id))

    def describe(self, record: RunRecord) -> list[str]:
        job, client = self._recorded_job(record)
        if job is None:
            return []
        info = client.job_info(job.job_id)
        state = client.job_state(job.job_id) or info.get("JobState") or "ended (no longer known to slurmctld)"
        whose = "detached: the run's supervisor runs inside it" if isinstance(record.placement, InJob) else \
            "submitted by this run" if job.owned else "its allocation"
        line = f"  slurm job {job.job_id} ({whose}): {state}"
        if info.get("NodeList") not in (None, "", "(null)"):
            line += f" on {info['NodeList']}"
        return [line] + ([f"  output: {job.output_path}"] if job.output_path else [])

    def log_lines(self, record: RunRecord, follow: bool) -> Optional[Iterator[str]]:
        """A detached run's lines: the record's log, which its supervisor writes, where this machine
        sees it (a shared home; None), else the supervisor's screen in its job's output."""
        job, client = self._recorded_job(record, detached=True)
        if job is None or not job.output_path or record.log_path.exists():
            return None
        return follow_output(Path(job.output_path), lambda: job_active(client.job_state(job.job_id)), follow)

    def cancel(self, record: RunRecord) -> list[str]:
        job, client = self._recorded_job(record)
        if job is None:
            return [f"run {record.run_id}: no Slurm job recorded (nothing was submitted)"]
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

    def _recorded_job(self, record: RunRecord, detached: bool = False) -> tuple[Optional[SlurmJob], SlurmClient]:
        """The run's Slurm job (None: none recorded, or not a detached run when `detached`) and a
        client for the cluster it went to."""
        job = SlurmJob.load(record.dir)
        if job is not None and detached and not isinstance(record.placement, InJob):
            job = None
        return job, SlurmClient(job.slurm_conf or self.client.conf) if job else self.client
