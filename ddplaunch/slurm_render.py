"""Pure rendering of the sbatch request of a `backend: slurm` run.

`render_sbatch(spec, run_id, opts)` turns the spec's `slurm:` section, env, setup and stages into
one batch script (slurm/ddp.sbatch.j2) and the exact `sbatch` command that submits it. Nothing
here runs anything: `--dry-run` prints `request.render()`, the backend executes the same request.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import jinja2

from ddplaunch import runs
from ddplaunch.plan import (
    HEALTHCHECK_SOURCE, LaunchPlan, Raw, _healthcheck_args, _node_env, host_python, is_secret, quote)
from ddplaunch.spec import ClusterSpec

TEMPLATE = "ddp.sbatch.j2"
#: torchrun forwards these to its workers; SIGUSR2 is the preemption warning (NCCL owns SIGUSR1).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
#: Set per node inside the srun step, so they are not exported by the batch shell.
_PER_NODE = ("DDPLAUNCH_HOST", "DDPLAUNCH_STAGE", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")


@dataclass(frozen=True)
class SbatchOptions:
    """What the command line adds: the stages to run and the job's arguments."""

    stages: tuple[str, ...] = ("healthcheck", "job")
    job_args: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class SbatchRequest:
    """A rendered submission: write `script` to `script_path`, copy `uploads`, run `argv` with `env`."""

    run_id: str
    script: str
    #: The same script with secret env values shown as `***` (what the dry run prints).
    shown_script: str
    script_path: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    output_path: str
    log_dir: str
    uploads: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def command_line(self) -> str:
        """The submit command as one shell line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)

    def render(self) -> str:
        """The dry-run text: the script, the files staged for it and the sbatch command."""
        out = [f"# run {self.run_id}: batch script {self.script_path}", self.shown_script.rstrip("\n"), ""]
        out += [f"# upload {src} -> {dst}" for src, dst in self.uploads]
        out.append(f"# output: {self.output_path}")
        out.append(f"# submit: {self.command_line()}")
        return "\n".join(out) + "\n"


def sbatch_options(plans: list[LaunchPlan]) -> SbatchOptions:
    """The options of the plans `up` made (one per stage): one batch job runs them all."""
    job_args = None
    for plan in plans:
        if plan.stage == "job":
            argv = list(plan.nodes[0].argv)
            job_args = tuple(argv[argv.index("--log-dir") + 3:])  # after the log dir and the script
    return SbatchOptions(stages=tuple(p.stage for p in plans), job_args=job_args)


def template_dir() -> Path:
    """slurm/ next to the package (source tree) or inside it (installed wheel: ddplaunch/slurm)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "slurm", here.parent / "slurm"):
        if (candidate / TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"{TEMPLATE} not found in {here / 'slurm'} or {here.parent / 'slurm'}")


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                              undefined=jinja2.StrictUndefined, autoescape=False,
                              trim_blocks=True, keep_trailing_newline=True)


def sbatch_lines(spec: ClusterSpec, run_id: str, output_path: str) -> list[str]:
    """Every `#SBATCH` option, sorted: the same spec always gives the same header."""
    s = spec.slurm
    lines = [f"--chdir={spec.workdir_path}", f"--job-name={run_id}",
             f"--nodes={s.nodes or len(spec.hosts)}", "--ntasks-per-node=1",
             f"--output={output_path}", "--open-mode=append"]
    for key in ("partition", "account", "qos", "time"):
        value = getattr(s, key)
        if value:
            lines.append(f"--{key}={value}")
    if s.gpus_per_node:
        lines.append(f"--gres=gpu:{s.gpus_per_node}")
    if s.cpus_per_task:
        lines.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.requeue:
        # A warning ahead of the time limit to the batch shell, which passes it to every rank
        # and requeues the job (USR1 belongs to NCCL).
        lines += ["--requeue", f"--signal=B:USR2@{s.signal_seconds}"]
    lines += [extra.strip().removeprefix("#SBATCH").strip() for extra in s.sbatch_extra]
    return sorted(lines)


def render_sbatch(spec: ClusterSpec, run_id: str, opts: SbatchOptions = SbatchOptions(),
                  script_path: Optional[str] = None) -> SbatchRequest:
    """The batch script and sbatch command of one run.

    Args:
        spec: a validated spec (any backend; its `slurm:` section shapes the allocation).
        run_id: the run id; it names the job and its files.
        opts: stages and job arguments (`job_args` replaces `job.args`).
        script_path: where the script is written (default: the run's record directory).
    Returns:
        The request; `render()` is the dry-run text.
    """
    workdir = Path(spec.workdir_path)
    out_dir = workdir / spec.slurm.output_dir
    output_path = str(out_dir / f"{run_id}-%j.out")
    log_dir = str(out_dir / run_id)
    script_path = script_path or str(runs.home() / "runs" / run_id / "job.sbatch")
    python = host_python(spec, spec.hosts[0])
    stage_env = {name: {k: v for k, v in _node_env(spec, run_id, name, spec.hosts[0])
                        if k not in _PER_NODE or k in spec.env} for name in opts.stages}
    # exported once by the batch shell: what every stage shares; the rest in each stage's step
    env = dict(set.intersection(*(set(e.items()) for e in stage_env.values())))
    env["DDPLAUNCH_LOG_DIR"] = log_dir
    env_items = sorted(env.items())
    stages = [_stage(spec, run_id, name, offset, python, sorted(set(stage_env[name].items()) - set(env_items)))
              for offset, name in enumerate(opts.stages)]
    job_args = list(spec.job.args if opts.job_args is None else opts.job_args)
    argv = ("sbatch", "--parsable", script_path, *job_args)
    submit_env = (("SLURM_CONF", str(spec.resolve(spec.slurm.conf))),) if spec.slurm.conf else ()
    request_text = {}
    for shown in (False, True):
        request_text[shown] = _environment().get_template(TEMPLATE).render(
            run_id=run_id, spec_name=spec.name,
            submit=" ".join(shlex.quote(a) for a in argv),
            sbatch_lines=sbatch_lines(spec, run_id, output_path),
            setup=list(spec.setup),
            env=[(k, "***" if shown and is_secret(k) and v else quote(v)) for k, v in env_items],
            stages=stages, requeue=spec.slurm.requeue, signal_seconds=spec.slurm.signal_seconds)
    uploads = ((str(HEALTHCHECK_SOURCE), f"{log_dir}/healthcheck.py"),) if "healthcheck" in opts.stages else ()
    return SbatchRequest(run_id=run_id, script=request_text[False], shown_script=request_text[True],
                         script_path=script_path, argv=argv, env=submit_env, output_path=output_path,
                         log_dir=log_dir, uploads=uploads)


@dataclass(frozen=True)
class _Stage:
    name: str
    body: str


def _stage(spec: ClusterSpec, run_id: str, name: str, offset: int, python: str,
           extra_env: list[tuple[str, str]]) -> _Stage:
    """One stage's srun body: `bash -c BODY` on every node, the node rank from $SLURM_NODEID."""
    if name == "healthcheck":
        script: str = Raw('"$DDPLAUNCH_LOG_DIR"/healthcheck.py')
        args = _healthcheck_args(spec, Raw('"$DDPLAUNCH_LOG_DIR"'))
        max_restarts = 0
    else:
        script, args, max_restarts = spec.job.script, [Raw('"$@"')], spec.job.max_restarts
    argv = [python, "-m", "torch.distributed.run",
            Raw('--nnodes="$SLURM_NNODES"'), Raw('--node-rank="$SLURM_NODEID"'),
            f"--nproc-per-node={_nproc(spec)}" if spec.nproc_per_node != "auto" or spec.slurm.gpus_per_node
            else Raw('--nproc-per-node="${SLURM_GPUS_ON_NODE:-1}"'),
            Raw('--master-addr="$MASTER_ADDR"'), Raw(f'--master-port=$((MASTER_PORT + {offset}))'),
            f"--rdzv-id={run_id}", f"--rdzv-conf=timeout={spec.rdzv_timeout}",
            f"--max-restarts={max_restarts}", "--tee=3",
            Raw(f'--log-dir="$DDPLAUNCH_LOG_DIR/torchrun-{name}-node$SLURM_NODEID"')]
    if spec.slurm.requeue:
        argv.append(f"--signals-to-handle={SIGNALS_TO_HANDLE}")
    argv += [script, *args]
    lines = [f'export DDPLAUNCH_STAGE={name} DDPLAUNCH_HOST="$(hostname)"']
    if spec.slurm.requeue:
        lines.insert(0, "trap : USR2  # the preemption warning is for torchrun and the ranks, not this shell")
    lines += [f"export {k}={quote(v)}" for k, v in extra_env]
    if "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" not in spec.env:
        lines.append('export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[$(hostname):\\${rank}] "')
    words = [quote(a) for a in argv]
    # one option per line: `python -m torch.distributed.run`, the options, the script and its args
    groups = [" ".join(words[:3]), *words[3:-len(args) - 1], " ".join(words[-len(args) - 1:])]
    lines.append(" \\\n  ".join(groups))
    lines.append("rc=$?")
    lines.append(f'echo "DDPLAUNCH_NODE stage={name} node=$SLURM_NODEID host=$(hostname) rc=$rc t=$(date +%s.%N)"')
    lines.append('exit "$rc"')
    return _Stage(name=name, body=shlex.quote("\n".join(lines)))


def _nproc(spec: ClusterSpec) -> int:
    if spec.nproc_per_node != "auto":
        return int(spec.nproc_per_node)
    return int(spec.slurm.gpus_per_node or 1)
