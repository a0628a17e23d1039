"""`up --detach` on Slurm: one batch job whose script runs every stage as an srun step itself.

Pure rendering (`render_detached`) and reading the job's output back (`follow_output`,
`final_state`). The steps are the attached ones (`render.step_request`): the same torchrun line,
node rank and host from the step; only the master differs — the allocation's first node, found by
the script (`scontrol show hostnames`), so the plan's master address is a shell reference.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import jinja2

from ddplaunch.backends.shell import stage_bundle
from ddplaunch.backends.slurm.render import (StepRequest, pyxis_of, sbatch_options, step_request, template_dir,
                                             upload_step)
from ddplaunch.backends.slurm.step import LabelledLines
from ddplaunch.plan import LaunchPlan
from ddplaunch.shellword import Raw, word
from ddplaunch.spec import ClusterSpec
from ddplaunch.specvalues import SECRET_SHOWN
from ddplaunch.torchrun_logs import HEARTBEAT, PAYLOAD_RE

DETACHED_TEMPLATE = "detached.sbatch.j2"
#: The master of a detached run: set by the batch script to the allocation's first node.
MASTER = Raw('"$DDPLAUNCH_MASTER_ADDR"')
#: What the job inherits from the submitting shell besides the plan's environment (sbatch runs
#: with --export=ALL, so the job gets exactly this environment plus Slurm's own variables).
INHERITED = ("PATH", "HOME", "USER", "LANG", "SLURM_CONF")
#: Options of an attached step that name the allocation from outside; inside the batch job srun
#: takes the job from SLURM_JOB_ID and uses every node of it.
_OUTSIDE = ("--jobid=", "--nodelist=")
#: Final job states (a preempted job that requeues becomes PENDING again).
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")
_START_RE = re.compile(r"^DDPLAUNCH_DETACHED job=(\d+) restarts=(\d+) nodes=(\S*)$")
_STAGE_RE = re.compile(r"^DDPLAUNCH_STAGE (\S+) (begin|end rc=(\d+))$")
_END_RE = re.compile(r"^DDPLAUNCH_DETACHED_END rc=(\d+)(?: (.*))?$")


@dataclass(frozen=True)
class Payload:
    """A file staged in every node's run directory: one base64 line in the script, fed to the
    upload step (`srun --input=all`), so it needs no shared file system."""

    source: str
    data: str

    def shown(self) -> str:
        raw = Path(self.source).read_bytes()
        return f"<base64 of {Path(self.source).name}: {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()[:16]}>"


@dataclass(frozen=True)
class DetachedRequest:
    """`sbatch` of the detached job: argv, the script on its stdin, and its process environment
    (the plan's env, secrets included, never in the script; `--export=ALL` hands it to the job)."""

    plans: tuple[LaunchPlan, ...]
    argv: tuple[str, ...]
    script: str
    #: The script as shown: each base64 payload replaced by one line naming its file and hash.
    shown_script: str
    env: tuple[tuple[str, str], ...]

    @property
    def plan(self) -> LaunchPlan:
        """The last stage (the job)."""
        return self.plans[-1]

    def text(self) -> str:
        secrets = frozenset().union(*(p.secrets for p in self.plans))
        out = [f"# run {self.plans[0].run_id}: detached, stages {', '.join(p.stage for p in self.plans)} "
               "in one batch job (script on sbatch's stdin)", shlex.join(self.argv),
               "# environment of the job (sbatch's process environment, never in the script):"]
        out.append(f"#   {', '.join(INHERITED)}: this shell's (when set; slurm.conf overrides SLURM_CONF)")
        out += [f"#   {k}={word(Raw(SECRET_SHOWN) if k in secrets else v)}" for k, v in self.env]
        out += [f"#   | {line}" for line in self.shown_script.splitlines()]
        return "\n".join(out) + "\n"

    def process_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """sbatch's whole environment: INHERITED from `environ` (when set), then the plan's."""
        env = {k: environ[k] for k in INHERITED if k in environ}
        env.update(self.env)
        return env


def detached_plan(plan: LaunchPlan) -> LaunchPlan:
    """The plan with its master the allocation's first node, as the batch script finds it."""
    nodes = tuple(replace(n, torchrun=n.torchrun and replace(n.torchrun, master_addr=MASTER)) for n in plan.nodes)
    return replace(plan, master_addr=MASTER, nodes=nodes)


def inside_job(argv: tuple[str, ...], kill_on_bad_exit: bool = False) -> str:
    """An attached step's srun argv as a line of the batch script: the options that name the
    allocation from outside dropped; with `kill_on_bad_exit`, one failing node ends the step (no
    launcher stays to stop the others)."""
    words = [a for a in argv if not a.startswith(_OUTSIDE)]
    if kill_on_bad_exit:
        words = ["--kill-on-bad-exit=1" if a.startswith("--kill-on-bad-exit=") else a for a in words]
    return shlex.join(words)


def _stage_exports(steps: list[StepRequest], common: dict[str, str]) -> list[list[str]]:
    """Per stage, the script lines that set the variables not common to every stage (ddplaunch's
    own: DDPLAUNCH_STAGE, TORCH_DISTRIBUTED_DEBUG); the spec's env is the same in every stage."""
    names = sorted({k for s in steps for k, _ in s.env} - set(common))
    out = []
    for step in steps:
        env = dict(step.env)
        if any(k in step.plan.secrets for k in names):
            raise ValueError("a secret differs between stages; it would have to be written into the script")
        out.append([f"export {k}={word(env[k])}" if k in env else f"unset {k}" for k in names])
    return out


def render_detached(spec: ClusterSpec, plans: list[LaunchPlan], output_path: str,
                    nodelist: Optional[list[str]]) -> DetachedRequest:
    """The sbatch request of a detached run: every stage of `plans`, in order (pure)."""
    steps = [step_request(detached_plan(p), "", spec.slurm.cpus_per_task, heartbeat=False, pyxis=pyxis_of(spec))
             for p in plans]
    common = dict(steps[0].env)
    for s in steps[1:]:
        common = {k: v for k, v in common.items() if dict(s.env).get(k) == v}
    staged: dict[str, str] = {}  # every stage's files, each once: name in the run dir -> source
    for p in plans:
        for src, dst in p.uploads:
            staged.setdefault(dst, src)
    payloads = [Payload(src, stage_bundle([Path(src).read_bytes()]).rstrip("\n")) for src in staged.values()]
    upload = inside_job(upload_step(steps[0].argv[:-3], plans[0].run_id, list(staged)))
    exports = _stage_exports(steps, common)
    stages = [{"name": s.plan.stage, "exports": e, "srun": inside_job(s.argv, kill_on_bad_exit=True)}
              for s, e in zip(steps, exports)]
    opts = ["--export=ALL" if o == "--export=NONE" else o
            for o in sbatch_options(spec, plans[0].run_id, output_path, nodelist)]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
                             keep_trailing_newline=True)
    template = env.get_template(DETACHED_TEMPLATE)

    def script(data: Callable[[Payload], str]) -> str:
        return template.render(run_id=plans[0].run_id, upload=upload, payloads=[data(p) for p in payloads],
                               names=", ".join(shlex.quote(Path(p.source).name) for p in payloads), stages=stages,
                               requeue=spec.slurm.requeue, signal_seconds=spec.slurm.signal_seconds)

    return DetachedRequest(plans=tuple(plans), argv=("sbatch", "--parsable", *sorted(opts)),
                           script=script(lambda p: p.data), shown_script=script(Payload.shown),
                           env=tuple(sorted(common.items())))


# ---------------------------------------------------------------------------- reading the job back


class OutputReader:
    """The job's output file as ddplaunch shows a run: `[host:rank] ...` from the ranks, `[host]`
    for other lines of a node, `[ddplaunch] ...` for the script's own markers."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = path, 0, b""
        self.lines, self.hosts = LabelledLines(), []  # type: LabelledLines, list[str]

    def read(self, final: bool = False) -> list[str]:
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
            line = self.lines.feed(chunk)
            if line is not None:
                out += self._shown(*line)
        for node, text in self.lines.rest() if final else []:
            out += self._shown(node, text)
        return out

    def _shown(self, node: Optional[int], text: str) -> list[str]:
        if node is not None:
            if PAYLOAD_RE.search(text) or text == HEARTBEAT:
                return []
            host = self.hosts[node] if node < len(self.hosts) else f"node{node}"
            return [text if text.startswith(f"[{host}:") else f"[{host}] {text}"]
        start, stage, end = _START_RE.match(text), _STAGE_RE.match(text), _END_RE.match(text)
        if start:
            self.hosts = [h for h in start.group(3).split(",") if h]
            again = f" (restart {start.group(2)})" if start.group(2) != "0" else ""
            return [f"[ddplaunch] job {start.group(1)}{again} on {', '.join(self.hosts)}; "
                    f"master {self.hosts[0] if self.hosts else '?'}"]
        if stage:
            return [f"[ddplaunch] stage {stage.group(1)}: " +
                    ("begins" if stage.group(2) == "begin" else f"ended, exit {stage.group(3)}")]
        if end:
            return [f"[ddplaunch] run ended: exit {end.group(1)}" + (f" ({end.group(2)})" if end.group(2) else "")]
        return [f"[{'srun' if text.startswith('srun:') else 'batch'}] {text}"] if text.strip() else []


def job_active(state: Optional[str]) -> bool:
    """Whether a job in this squeue state may still write output (squeue may list a finished job
    for a while, in its final state; requeued, it is PENDING again)."""
    return state is not None and state not in ENDED


def follow_output(path: Path, running: Callable[[], bool], follow: bool, poll: float = 0.3) -> Iterator[str]:
    """The job's output lines; with `follow`, until `running()` says the job has left the queue."""
    reader = OutputReader(path)
    while True:
        alive = follow and running()
        yield from reader.read(final=not alive)
        if not alive:
            if not path.exists():
                yield f"[ddplaunch] no job output at {path} (not written yet, or not on a file system this machine sees)"
            return
        time.sleep(poll)


def final_state(path: Optional[str], job_state: Optional[str], info: Mapping[str, str]) -> Optional[str]:
    """The run's final state once the job has left the queue: ok/failed from the script's own end
    marker, else from Slurm (cancelled, timeout, ...); None while it is queued or running."""
    if job_active(job_state):
        return None
    slurm = info.get("JobState") or job_state
    if slurm == "CANCELLED":
        return "cancelled"
    ends = []
    try:
        ends = [m for m in map(_END_RE.match, Path(path).read_text(errors="replace").splitlines()) if m] if path else []
    except OSError:
        pass
    if ends and slurm in (None, "COMPLETED", "FAILED"):
        return "ok" if ends[-1].group(1) == "0" else "failed"
    if slurm:
        return "ok" if slurm == "COMPLETED" else "failed"
    return "ended (state unknown: the job is no longer known to slurmctld and left no end marker)"
