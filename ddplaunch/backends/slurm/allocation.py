"""The nodes a Slurm run holds: an allocation ddplaunch submits and ends, or the one it runs in.

Without an allocation, ddplaunch submits one (`sbatch`, a script that only holds the nodes; with
`slurm.requeue` it also passes the time-limit warning on and requeues itself), waits until it
runs, and ends it when the run is over. Inside an allocation (SLURM_JOB_ID set: `salloc`, or an
sbatch script) it uses that one: no second job, and ending the run ends its steps only.

Spares (`recovery.spares`) are nodes the allocation holds beside the run's: named ones, or a
count of its first nodes — the first holds the batch script, whose node cannot fail without
ending the allocation, so it is kept out of the job until it is the last spare needed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from ddplaunch.backends.contract import RunContext
from ddplaunch.backends.slurm.client import POLL_INTERVAL, SlurmClient, SlurmJob, describe_sbatch_error, job_output
from ddplaunch.backends.slurm.render import allocation_request
from ddplaunch.errors import BackendError, PlanError
from ddplaunch.record.events import Allocated
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: Job states in which an allocation will never run (again).
ENDED = ("CANCELLED", "FAILED", "TIMEOUT", "COMPLETED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
         "PREEMPTED")


class Allocation:
    """The job whose nodes every stage runs on."""

    def __init__(self, spec: ClusterSpec, client: SlurmClient, run: RunContext):
        self.spec, self.client, self.run = spec, client, run
        self.job: Optional[SlurmJob] = None
        self.restarts = 0
        #: The allocation's nodes in Slurm's order: a step numbers its nodes ($SLURM_NODEID) this way.
        self.order: dict[str, int] = {}
        self.inside = os.environ.get("SLURM_JOB_ID")
        explicit = "hosts" in spec.model_fields_set
        self.nodelist = [h.label for h in spec.hosts] if explicit else None  # hostlists expanded by the spec
        spares = spec.recovery.spares
        self.spare_names = [h.label for h in spares] if isinstance(spares, list) else []
        #: What the spec says of a node beyond its name (its own `nproc`), by name.
        listed = [*(spec.hosts if explicit else []), *(spares if isinstance(spares, list) else [])]
        self.given = {h.label: h for h in listed}
        #: The allocation's nodes held as spares, once it runs.
        self.spare_nodes: list[str] = []
        #: Nodes Slurm could not start a step on: the job stays COMPLETING until they answer.
        self.unreachable: set[str] = set()

    def requested(self) -> tuple[Optional[list[str]], int]:
        """(--nodelist, --nodes) of the allocation: the named hosts and spares, and every node."""
        names = (self.nodelist or []) + self.spare_names
        active = len(self.nodelist) if self.nodelist else (self.spec.slurm.nodes or 1)
        return names or None, active + self.spec.recovery.spare_count

    def output_path(self) -> str:
        return job_output(self.spec, self.run.run_id)

    def text(self) -> str:
        if self.inside:
            return f"# allocation: this one (SLURM_JOB_ID={self.inside}); every stage is a step of it\n"
        return allocation_request(self.spec, self.run.run_id, self.output_path(), *self.requested()).text()

    def size(self) -> int:
        """The allocation's node count, as far as known."""
        return max(1, len(self.order) or self.requested()[1])

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        """The allocation's nodes (submitting it and waiting for it to run, unless `allocate` is
        False: then as far as known without asking anyone, for the dry run)."""
        if self.nodelist and self.spec.slurm.nodes and self.spec.slurm.nodes != len(self.nodelist):
            raise PlanError(f"slurm.nodes is {self.spec.slurm.nodes} but hosts lists {len(self.nodelist)} node(s): "
                            "hosts are the node list of the allocation; drop one of the two")
        if not allocate and not self.inside:
            if self.nodelist:
                return [self.host(n) for n in self.nodelist]
            # placeholders for a dry run: Slurm names the nodes when it allocates them
            return [HostSpec.model_construct(addr=f"<node{i}>", name=f"<node{i}>")
                    for i in range(self.spec.slurm.nodes or 1)]
        names = self._inside_nodes(record=allocate) if self.inside else self._own_nodes()
        self.order = {n: i for i, n in enumerate(names)}
        if self.spare_names:
            self.spare_nodes = [n for n in names if n in self.spare_names]
        else:
            free = [n for n in names if not self.nodelist or n not in self.nodelist]
            self.spare_nodes = free[:self.spec.recovery.spare_count]
        return [self.host(n) for n in names if n not in self.spare_nodes and (not self.nodelist or n in self.nodelist)]

    def spares(self) -> list[HostSpec]:
        """The nodes held as spares (known once the allocation runs)."""
        return [self.host(n) for n in self.spare_nodes]

    def host(self, node: str) -> HostSpec:
        """Node `node` as a host of the plan: its name, and its process count where the spec gives one."""
        given = self.given.get(node)
        return HostSpec(addr=node, name=node, nproc=given.nproc if given is not None else None)

    def _inside_nodes(self, record: bool) -> list[str]:
        assert self.inside is not None
        names = self.client.hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
        missing = sorted(set(self.nodelist or ()) | set(self.spare_names) - set(names))
        if missing:
            raise PlanError(f"hosts {', '.join(missing)} are not in this allocation "
                            f"(SLURM_JOB_ID={self.inside}: {', '.join(names)})")
        self.job = self.job or SlurmJob(job_id=self.inside, owned=False, slurm_conf=self.client.conf)
        known = SlurmJob.load(self.run.run_dir)
        # a dry run says nothing; a detached run's job is its record's (the job is the run's own:
        # `down` cancels it whole)
        if record and (known is None or known.job_id != self.inside):
            self.run.say(Allocated(self.inside, owned=False))
        return names

    def _own_nodes(self) -> list[str]:
        if self.job is None:
            self._submit()
        return self.client.hostnames(self._wait_running().get("NodeList", ""))

    def _submit(self) -> None:
        out = Path(self.output_path().replace("%j", "x")).parent
        out.mkdir(parents=True, exist_ok=True)
        request = allocation_request(self.spec, self.run.run_id, self.output_path(), *self.requested())
        proc = self.client.run(list(request.argv), stdin=request.script)
        if proc.returncode != 0:
            raise BackendError(describe_sbatch_error(proc.stderr or proc.stdout))
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise BackendError(f"sbatch printed no job id: {proc.stdout.strip()!r} {proc.stderr.strip()!r}")
        self.job = SlurmJob(job_id=job_id, owned=True, slurm_conf=self.client.conf,
                            output_path=self.output_path().replace("%j", job_id))
        self.run.say(Allocated(job_id, owned=True, output_path=self.job.output_path))

    def _wait_running(self) -> dict[str, str]:
        """Wait until the allocation runs (again, after a requeue); `scontrol show job` of it."""
        assert self.job is not None
        while True:
            if self.run.stop.is_set():
                raise KeyboardInterrupt
            info = self.client.job_info(self.job.job_id)
            state = info.get("JobState", "UNKNOWN")
            if state == "RUNNING":
                self.restarts = int(info.get("Restarts", "0") or 0)
                return info
            if state in ENDED or not info:
                raise BackendError(f"allocation job {self.job.job_id} ended {state} before it ran "
                                   f"(reason {info.get('Reason', '?')}); see {self.job.output_path}")
            time.sleep(POLL_INTERVAL)

    def job_id(self) -> str:
        if self.job is None:
            if self.inside:
                return self.inside
            raise BackendError("no Slurm allocation yet")
        return self.job.job_id

    def requeued(self) -> bool:
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

    def release(self) -> None:
        """End the allocation ddplaunch made (never one it runs inside): SIGTERM to the holding
        script, which exits 0 (the job ends COMPLETED); scancel if it does not go."""
        if self.job is None or not self.job.owned:
            return
        try:
            self.client.run(["scancel", "--batch", "--signal=TERM", self.job.job_id])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                state = self.client.job_state(self.job.job_id)
                if state in (None, "COMPLETED", "CANCELLED", "FAILED"):
                    return
                if state == "COMPLETING" and self.unreachable:
                    return  # ended; Slurm lets it go once the dead node answers or is marked down
                time.sleep(POLL_INTERVAL)
            self.client.cancel(self.job.job_id, wait=60)
        except BackendError:
            pass
