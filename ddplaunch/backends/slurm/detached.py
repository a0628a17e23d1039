"""`up --detach` on Slurm: the run's supervisor runs inside its own allocation.

One batch job holds the run's nodes (the allocation an attached run asks for: the same options,
spares included) and its script runs the supervisor (`ddplaunch supervise`) on the allocation's
first node. The supervisor runs the one run loop exactly as an attached `up` does from inside an
allocation — pre-flight, gates, hang watchdog, recovery onto spares — every stage an srun step of
this job; the job ends when the run ends, whatever became of the launcher. With `slurm.requeue`
the script passes the time-limit warning to the steps and requeues the job; the requeued job's
supervisor takes the same run up again (the ranks resume from their checkpoint).

The validated spec, the spec's path and the command line's options travel in one environment
variable of sbatch's process (`DDPLAUNCH_SUPERVISE`; `--export=ALL` hands sbatch's environment,
and nothing else of the launcher's, to the job): never in the script, which Slurm shows to anyone
who may read the job. Pure rendering here; `follow_output`/`final_state` read the job back.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from ddplaunch.backends.contract import JobEnd
from ddplaunch.backends.slurm.render import allocation_request
from ddplaunch.plan.handoff import SUPERVISE_ENV, encode_run, supervisor_opts
from ddplaunch.plan.shellword import Raw, word
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.results import RunState
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.spec.values import SECRET_SHOWN

#: What the job inherits from the submitting shell besides the run and the spec's `from_env`
#: values (sbatch runs with --export=ALL, so the job gets exactly this environment plus Slurm's).
INHERITED = ("PATH", "HOME", "USER", "LANG", "SLURM_CONF", "DDPLAUNCH_HOME")
#: Final job states (a preempted job that requeues becomes PENDING again).
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")


@dataclass(frozen=True)
class DetachedRequest:
    """`sbatch` of the detached job: argv, the script on its stdin, and its process environment
    (the run for its supervisor and the spec's `from_env` values, never in the script)."""

    run_id: str
    argv: tuple[str, ...]
    script: str
    env: tuple[tuple[str, str], ...]
    #: The names of `env` whose values are secret (`from_env` values): shown as <secret>.
    secret: frozenset[str]
    #: The run as the dry run shows it: the spec redacted, the options.
    shown_run: str

    def text(self) -> str:
        out = [f"# run {self.run_id}: detached; its supervisor runs inside the allocation below, on its first "
               "node, and runs every stage as an srun step of it (script on sbatch's stdin)", shlex.join(self.argv),
               "# environment of the job (sbatch's process environment, never in the script):",
               f"#   {', '.join(INHERITED)}: this shell's (when set; slurm.conf overrides SLURM_CONF)"]
        for k, v in self.env:
            shown = f"<the run for its supervisor: {len(v)} bytes>" if k == SUPERVISE_ENV else \
                SECRET_SHOWN if k in self.secret else v
            out.append(f"#   {k}={word(Raw(shown) if k == SUPERVISE_ENV or k in self.secret else v)}")
        out += [f"#   | {line}" for line in self.script.splitlines()]
        out += [f"# {SUPERVISE_ENV} (secrets shown as {SECRET_SHOWN}):"]
        out += [f"#   {line}" for line in self.shown_run.splitlines()]
        return "\n".join(out) + "\n"

    def process_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """sbatch's whole environment: INHERITED from `environ` (when set), then the request's."""
        env = {k: environ[k] for k in INHERITED if k in environ}
        env.update(self.env)
        return env


def render_detached(spec: ClusterSpec, run_id: str, spec_path: str, opts: UpOptions, output_path: str,
                    nodelist: Optional[list[str]], nodes: int, environ: Mapping[str, str],
                    python: str = sys.executable) -> DetachedRequest:
    """The sbatch request of a detached run (pure but for reading `environ`'s `from_env` values):
    `opts` are the command line's options, `python` the interpreter that
    runs the supervisor on the allocation's first node (this one's: the same path there).

    Raises:
        SpecError: a `from_env` variable is not set in `environ`.
    """
    spec.env_values(environ)  # every from_env variable is set, or the error names it now
    wanted = sorted({v.from_env for v in spec.env.values() if v.from_env is not None})
    handed = supervisor_opts(opts, run_id)
    encoded = encode_run(spec, spec_path, handed)
    alloc = allocation_request(spec, run_id, output_path, nodelist, nodes, supervise=shlex.quote(python))
    opts_ = ["--export=ALL" if o == "--export=NONE" else o for o in alloc.argv]
    shown_spec = spec.model_dump(mode="json", exclude_unset=True)  # what is handed over, secrets shown as such
    if "env" in shown_spec:
        shown_spec["env"] = spec.redacted()["env"]
    shown = {"spec": shown_spec, "spec_path": spec_path, "opts": dataclasses.asdict(handed)}
    return DetachedRequest(run_id=run_id, argv=tuple(opts_), script=alloc.script,
                           env=tuple(sorted([(SUPERVISE_ENV, encoded), *((k, environ[k]) for k in wanted)])),
                           secret=frozenset(wanted), shown_run="\n".join(f"{k}: {json.dumps(v, sort_keys=True)}"
                                                                        for k, v in shown.items()))


# ---------------------------------------------------------------------------- reading the job back


def job_active(state: Optional[str]) -> bool:
    """Whether a job in this squeue state may still write output (squeue may list a finished job
    for a while, in its final state; requeued, it is PENDING again)."""
    return state is not None and state not in ENDED


def follow_output(path: Path, running: Callable[[], bool], follow: bool, poll: float = 0.3) -> Iterator[str]:
    """The job's output lines (the supervisor's screen); with `follow`, until `running()` says the
    job has left the queue."""
    offset, rest = 0, b""
    while True:
        alive = follow and running()
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        offset += len(data)
        *lines, rest = (rest + data).split(b"\n")
        if not alive and rest:
            lines, rest = [*lines, rest], b""
        yield from (line.decode(errors="replace") for line in lines)
        if not alive:
            if not path.exists():
                yield f"[ddplaunch] no job output at {path} (not written yet, or not on a file system this machine sees)"
            return
        time.sleep(poll)


def final_state(job_state: Optional[str], info: Mapping[str, str]) -> Optional[JobEnd]:
    """The run's final state once its job has left the queue (the batch script exits with the
    supervisor's code); None while it is queued or running."""
    if job_active(job_state):
        return None
    slurm = info.get("JobState") or job_state
    if slurm == "CANCELLED":
        return JobEnd(RunState.CANCELLED, "the job was cancelled")
    if slurm:
        return JobEnd(RunState.OK if slurm == "COMPLETED" else RunState.FAILED, f"the job ended {slurm}")
    return JobEnd(RunState.UNKNOWN, "the job is no longer known to slurmctld")
