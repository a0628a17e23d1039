"""Slurm backend: one batch job runs every stage; ddplaunch submits it, follows it and cancels it.

`run_all` renders the request (`slurm_render.render_sbatch`), writes the script into the run's
record directory, submits it with `sbatch --parsable`, then follows the job: `squeue` for its
state, its output file (tailed, whole lines) for the ranks' lines and the stage/node markers the
script prints. Ctrl-C cancels the job and waits until Slurm has ended it. Every Slurm command
runs with a timeout; `SLURM_CONF` comes from `slurm.conf` in the spec.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

from ddplaunch import runs
from ddplaunch.backends.base import (
    INTERRUPTED, LOST, RUNNING, LineSink, NodeOutcome, StageCallback, StageResult,
    finish_outcome)
from ddplaunch.errors import BackendError
from ddplaunch.plan import LaunchPlan
from ddplaunch.slurm_render import SbatchRequest, render_sbatch, sbatch_options
from ddplaunch.spec import ClusterSpec

#: Seconds between `squeue` polls (`sbatch --wait` polls far too slowly for interactive use).
POLL_INTERVAL = 0.3
#: Timeout of each Slurm client command.
COMMAND_TIMEOUT = 30.0
#: How long `squeue` may keep failing before the job is given up as unreachable.
CONTROLLER_GRACE = 60.0
#: After `scancel`, how long to wait for the job to leave the queue.
CANCEL_WAIT = 120.0
#: srun splits longer output lines into pieces of this many bytes.
SRUN_PIECE = 1024

#: sbatch's complaint -> the spec key that causes it (first match wins).
SBATCH_ERRORS = (
    (re.compile(r"account", re.I), "slurm.account"),  # before partition: "account/partition combination"
    (re.compile(r"partition", re.I), "slurm.partition"),
    (re.compile(r"\bqos\b", re.I), "slurm.qos"),
    (re.compile(r"time limit|--time\b|invalid time", re.I), "slurm.time"),
    (re.compile(r"gres|generic resource|gpu", re.I), "slurm.gpus_per_node"),
    (re.compile(r"cpus-per-task|cpu count|more processors", re.I), "slurm.cpus_per_task"),
    (re.compile(r"node count|nodes|node configuration", re.I), "slurm.nodes"),
    (re.compile(r"configuration source|slurm\.conf|contact slurm controller|controller", re.I), "slurm.conf"),
)

_LABEL_RE = re.compile(r"^\s*(\d+): ?(.*)$")
_JOB_RE = re.compile(r"^DDPLAUNCH_JOB id=(\d+) restarts=(\d+) master=(\S+) nodes=(\S*)")
_STAGE_RE = re.compile(r"^DDPLAUNCH_STAGE (\w+) (begin|end)(?: rc=(\d+))?")
_NODE_RE = re.compile(r"^DDPLAUNCH_NODE stage=(\w+) node=(\d+) host=(\S+) rc=(\d+) t=([\d.]+)")


@dataclass
class SlurmJob:
    """What ddplaunch remembers of a submitted job (`runs/<id>/slurm.json`)."""

    run_id: str
    job_id: str
    output_path: str
    script_path: str
    slurm_conf: Optional[str] = None

    @property
    def output_file(self) -> Path:
        return Path(self.output_path.replace("%j", self.job_id))

    def save(self) -> None:
        path = runs.home() / "runs" / self.run_id / "slurm.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def load(cls, run_id: str) -> "SlurmJob":
        path = runs.home() / "runs" / run_id / "slurm.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise BackendError(f"run {run_id} has no Slurm job ({path} missing): it was never submitted") from None


class SlurmBackend:
    """Submits a run as one batch job and follows it."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        #: SLURM_CONF for every Slurm command (a recorded job's own wins, see `for_job`).
        self.conf = str(spec.resolve(spec.slurm.conf)) if spec.slurm.conf else None

    @classmethod
    def for_job(cls, spec: ClusterSpec, run_id: str) -> tuple["SlurmBackend", "SlurmJob"]:
        """A backend talking to the cluster a recorded run was submitted to, and its job."""
        backend, job = cls(spec), SlurmJob.load(run_id)
        backend.conf = job.slurm_conf or backend.conf
        return backend, job

    #: Both stages run in one batch job (one queue wait); `up` does not gate between them.
    single_submission = True

    # ------------------------------------------------------------------ the contract

    def port_free(self, addr: str, port: int) -> bool:
        return True  # the port is derived from the job id inside the allocation

    def run_all(self, plans: list[LaunchPlan], sink: LineSink, stop: threading.Event,
                on_stage: StageCallback) -> list[StageResult]:
        request = render_sbatch(self.spec, plans[0].run_id, sbatch_options(plans))
        job = self.submit(request)
        sink.note(f"submitted batch job {job.job_id}; output {job.output_file}")
        follower = _Follower(job, {p.stage: p for p in plans}, sink, on_stage,
                             self.spec.slurm.nodes or len(self.spec.hosts))
        return follower.follow(self, stop)

    def down(self, run_id: str) -> list[str]:
        job = SlurmJob.load(run_id)
        self.conf = job.slurm_conf or self.conf
        state = self.job_state(job.job_id)
        if state is None:
            return [f"job {job.job_id}: not in the queue (already ended)"]
        self.cancel(job.job_id)
        return [f"job {job.job_id}: was {state}, cancelled"]

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ effects

    def submit(self, request: SbatchRequest) -> SlurmJob:
        """Write the script, stage its files, `sbatch` it; the job is recorded in the run dir.

        Raises:
            BackendError: sbatch missing or refusing the job; the message names the spec key.
        """
        script = Path(request.script_path)
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(request.script)
        script.chmod(0o600)  # it holds the spec's env, secrets included
        Path(request.log_dir).mkdir(parents=True, exist_ok=True)
        for src, dst in request.uploads:
            shutil.copyfile(src, dst)
        proc = self._slurm(list(request.argv), env=dict(request.env))
        if proc.returncode != 0:
            raise BackendError(describe_sbatch_error(proc.stderr or proc.stdout))
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise BackendError(f"sbatch printed no job id: {proc.stdout.strip()!r} {proc.stderr.strip()!r}")
        job = SlurmJob(run_id=request.run_id, job_id=job_id, output_path=request.output_path,
                       script_path=request.script_path, slurm_conf=dict(request.env).get("SLURM_CONF"))
        job.save()
        return job

    def job_state(self, job_id: str) -> Optional[str]:
        """The job's state while it is in the queue (PENDING, RUNNING, COMPLETING...), None once gone.

        Raises:
            BackendError: squeue fails (controller unreachable).
        """
        proc = self._slurm(["squeue", "-h", "-j", job_id, "-o", "%T"])
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise BackendError(f"squeue failed: {_first_error(proc.stderr)}")
        return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else None

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList...); empty once Slurm forgot it."""
        proc = self._slurm(["scontrol", "show", "job", "-o", job_id])
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def cancel(self, job_id: str, wait: float = CANCEL_WAIT) -> bool:
        """`scancel` the job and wait until it has left the queue (no step process left)."""
        self._slurm(["scancel", job_id])
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if self.job_state(job_id) is None:
                    return True
            except BackendError:
                pass
            time.sleep(POLL_INTERVAL)
        return False

    def _slurm(self, argv: list[str], env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
        full_env = dict(os.environ)
        if self.conf:
            full_env["SLURM_CONF"] = self.conf
        full_env.update(env or {})
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                                  env=full_env, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise BackendError(f"{argv[0]} not found on PATH: the Slurm client commands (sbatch, squeue, "
                               "scontrol, scancel) are needed for backend: slurm; run ddplaunch on a "
                               "login node or install slurm-client") from None
        except subprocess.TimeoutExpired:
            raise BackendError(f"{argv[0]} gave no answer within {COMMAND_TIMEOUT:.0f}s "
                               "(slurmctld down or unreachable? check slurm.conf)") from None


def describe_sbatch_error(stderr: str) -> str:
    """One line naming the spec key behind sbatch's refusal, e.g.
    `slurm.partition: sbatch: error: invalid partition specified: foo`."""
    first = _first_error(stderr)
    for pattern, key in SBATCH_ERRORS:
        if pattern.search(stderr):
            return f"{key}: {first}"
    return f"slurm: sbatch refused the job: {first}"


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()]
    return (errors or lines or ["(no message)"])[0]


# ---------------------------------------------------------------------- following a job


class _OutputTail:
    """Whole lines appended to a job's output file since the last read (it may not exist yet).

    srun cuts a task's lines into 1024-byte pieces and labels each (`0: ...`); a piece of exactly
    that size is held until the rest of its line, from the same node, arrives.
    """

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = path, 0, b""
        self.pieces: dict[str, str] = {}

    def lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        self.offset += len(data)
        chunks = (self.rest + data).split(b"\n")
        self.rest = chunks.pop()
        if final and self.rest:
            chunks.append(self.rest)
            self.rest = b""
        out = []
        for chunk in chunks:
            label = _LABEL_RE.match(chunk.decode("utf-8", "replace"))
            if label is None:
                out.append(chunk.decode("utf-8", "replace").rstrip("\r"))
                continue
            node = label.group(1)
            text = self.pieces.pop(node, "") + label.group(2)
            if len(chunk) - chunk.index(b": ") - 2 == SRUN_PIECE:
                self.pieces[node] = text
            else:
                out.append(f"{node}: {text.rstrip(chr(13))}")
        if final:
            out += [f"{node}: {text}" for node, text in self.pieces.items()]
            self.pieces = {}
        return out


class _Follower:
    """Turns the job's output and Slurm states into per-stage, per-node results."""

    def __init__(self, job: SlurmJob, plans: dict[str, LaunchPlan], sink: LineSink,
                 on_stage: StageCallback, nnodes: int):
        self.job, self.plans, self.sink, self.on_stage = job, plans, sink, on_stage
        self.hosts = [f"node{i}" for i in range(nnodes)]
        self.results: list[StageResult] = []
        self.current: Optional[StageResult] = None
        self.node_ends: dict[int, tuple[int, float]] = {}
        self.restarts = 0

    def follow(self, backend: SlurmBackend, stop: threading.Event) -> list[StageResult]:
        tail = _OutputTail(self.job.output_file)
        last_state, failing_since, interrupted = None, None, False
        while True:
            for line in tail.lines():
                self.feed(line)
            if stop.is_set():
                self.sink.note(f"interrupted: cancelling job {self.job.job_id}")
                if not backend.cancel(self.job.job_id):
                    self.sink.note(f"job {self.job.job_id} still in the queue after {CANCEL_WAIT:.0f}s")
                interrupted = True
                break
            try:
                state = backend.job_state(self.job.job_id)
                failing_since = None
            except BackendError as err:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > CONTROLLER_GRACE:
                    raise BackendError(f"lost track of job {self.job.job_id}: {err}") from None
                state = last_state or "UNKNOWN"
            if state is None:
                break
            if state != last_state:
                self.sink.note(f"job {self.job.job_id}: {state}")
                last_state = state
            stop.wait(POLL_INTERVAL)
        for line in tail.lines(final=True):
            self.feed(line)
        info = backend.job_info(self.job.job_id)
        self.finish(info, interrupted)
        return self.results

    # -- parsing

    def feed(self, raw: str) -> None:
        label = _LABEL_RE.match(raw)
        if label is None:
            self._batch_line(raw)
            return
        node, text = int(label.group(1)), label.group(2)
        marker = _NODE_RE.match(text)
        if marker:
            self.node_ends[int(marker.group(2))] = (int(marker.group(4)), float(marker.group(5)))
            return
        self.sink.emit(node, self._host(node), text)

    def _batch_line(self, raw: str) -> None:
        job, stage = _JOB_RE.match(raw), _STAGE_RE.match(raw)
        if job:
            self.hosts = job.group(4).split(",") or self.hosts
            restarts = int(job.group(2))
            if restarts > self.restarts:
                self.restarts = restarts
                self.sink.note(f"job {self.job.job_id} requeued (restart {restarts}): stages run again")
                self.results, self.current = [], None
            self.sink.note(f"job {self.job.job_id} on {', '.join(self.hosts)}; master {job.group(3)}")
        elif stage and stage.group(2) == "begin":
            self._begin(stage.group(1))
        elif stage:
            self._end(int(stage.group(3) or 0))
        else:
            self.sink.emit(-1, "batch", raw)

    def _host(self, node: int) -> str:
        return self.hosts[node] if node < len(self.hosts) else f"node{node}"

    def _begin(self, stage: str) -> None:
        self.sink.note(f"stage {stage}: {len(self.hosts)} node(s) ({', '.join(self.hosts)})")
        self.node_ends = {}
        self.current = StageResult(stage=stage, outcomes=[
            NodeOutcome(node_rank=i, host=h, state=RUNNING) for i, h in enumerate(self.hosts)])

    def _end(self, rc: int, interrupted: bool = False, why: str = "") -> None:
        """Close the current stage: nodes with an end marker by their exit code, the rest by cause."""
        result, self.current = self.current, None
        if result is None:
            return
        failed = sorted((t, n) for n, (code, t) in self.node_ends.items() if code != 0)
        if failed:
            why = f"ended by Slurm (srun --kill-on-bad-exit) after {self._host(failed[0][1])} (node {failed[0][1]}) failed"
        for o in result.outcomes:
            if o.node_rank in self.node_ends:
                code, ended = self.node_ends[o.node_rank]
                finish_outcome(o, self.sink, code)
                o.ended_at = ended
                continue
            if rc != 0:
                o.state = INTERRUPTED if (interrupted or failed) else LOST
                o.detail = why
            finish_outcome(o, self.sink, None if rc else 0)
        result.interrupted = interrupted
        result.ended_at = time.time()
        self.results.append(result)
        self.on_stage(self.plans.get(result.stage) or next(iter(self.plans.values())), result, self.sink)

    def finish(self, info: dict[str, str], interrupted: bool) -> None:
        """Close the stage in flight, or account for one that never began, from the job's end."""
        state = info.get("JobState", "UNKNOWN")
        reason = info.get("Reason", "None")
        why = (f"interrupted by the user: job {self.job.job_id} cancelled" if interrupted else
               f"job {self.job.job_id} ended {state} (ExitCode {info.get('ExitCode', '?')}"
               f"{'' if reason == 'None' else ', reason ' + reason}); see {self.job.output_file}")
        if self.current is None:
            remaining = [s for s in self.plans if s not in {r.stage for r in self.results}]
            if not remaining or (self.results and not self.results[-1].ok):
                return  # every stage ran, or the script stopped after a failed one
            self._begin(remaining[0])
        self.sink.note(why)
        self._end(1, interrupted=interrupted, why=why)


# ---------------------------------------------------------------------- status and logs of a run


def job_status(spec: ClusterSpec, run_id: str) -> list[str]:
    """`ddplaunch status` lines of a Slurm run: the job id, its state, nodes and exit code."""
    backend, job = SlurmBackend.for_job(spec, run_id)
    state = backend.job_state(job.job_id)
    info = backend.job_info(job.job_id)
    state = state or info.get("JobState") or "ended (no longer known to slurmctld)"
    line = f"  slurm job {job.job_id}: {state}"
    if info.get("NodeList") not in (None, "", "(null)"):
        line += f" on {info['NodeList']}"
    if info.get("ExitCode") and state not in ("PENDING", "RUNNING"):
        line += f", ExitCode {info['ExitCode']}"
    return [line, f"  output: {job.output_file}"]


def job_logs(spec: ClusterSpec, run_id: str, follow: bool = False) -> Iterator[str]:
    """The job's output lines as ddplaunch shows them (`[host:rank] ...`); with `follow`,
    until the job has left the queue."""
    backend, job = SlurmBackend.for_job(spec, run_id)
    tail, hosts = _OutputTail(job.output_file), [f"node{i}" for i in range(spec.slurm.nodes or len(spec.hosts))]
    while True:
        running = follow and backend.job_state(job.job_id) is not None
        for raw in tail.lines(final=not running):
            label, marker = _LABEL_RE.match(raw), _JOB_RE.match(raw)
            if marker:
                hosts = marker.group(4).split(",")
            text = label.group(2) if label else raw
            if text.startswith("DDPLAUNCH_"):
                continue
            host = (hosts[int(label.group(1))] if int(label.group(1)) < len(hosts) else "?") if label else "batch"
            yield text if text.startswith(f"[{host}:") else f"[{host}] {text}"
        if not running:
            return
        time.sleep(POLL_INTERVAL)
