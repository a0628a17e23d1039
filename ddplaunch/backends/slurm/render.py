"""Pure rendering of what the Slurm backend executes: the allocation request and one srun step
per stage (or, detached, one batch script that runs every stage itself).

The step's command is the plan's node command with the node rank and host taken from the step
($SLURM_NODEID, $SLURMD_NODENAME): the same torchrun invocation as every other backend. No user
value is written into a script: Slurm options travel as sbatch/srun arguments (no shell), the
environment in the step's process environment (secrets never on a command line).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import jinja2

from ddplaunch.backends.shell import pid_file, shell_line, stage_files
from ddplaunch.plan.container import pyxis_options
from ddplaunch.plan.hostwords import HostWord
from ddplaunch.plan.launch import LaunchPlan, NodeCommand, agent_name, container_name, host_run_dir, in_run_dir
from ddplaunch.plan.shellword import Raw, word
from ddplaunch.spec.model import ClusterSpec, ContainerSpec
from ddplaunch.spec.values import RUNTIMES, SECRET_SHOWN

ALLOCATION_TEMPLATE = "allocation.sbatch.j2"
#: How a value known only once the allocation exists appears in a dry run.
AT_LAUNCH = "<allocated at launch>"


def template_dir() -> Path:
    """slurm/ next to the package (source tree) or inside it (installed wheel: ddplaunch/slurm)."""
    pkg = Path(__file__).resolve().parents[2]
    for candidate in (pkg / "slurm", pkg.parent / "slurm"):
        if (candidate / ALLOCATION_TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"{ALLOCATION_TEMPLATE} not found in {pkg / 'slurm'} or {pkg.parent / 'slurm'}")


@dataclass(frozen=True)
class AllocationRequest:
    """`sbatch` of the allocation that holds the nodes (None of it in in-allocation mode)."""

    script: str
    argv: tuple[str, ...]

    def text(self) -> str:
        return (f"# allocation: sbatch (script on stdin)\n{shlex.join(self.argv)}\n"
                + "".join(f"#   | {line}\n" for line in self.script.splitlines()))


def sbatch_options(spec: ClusterSpec, run_id: str, output_path: str, nodelist: Optional[list[str]],
                   nodes: Optional[int] = None) -> list[str]:
    """Every sbatch option of the allocation, sorted: the same spec always gives the same request.
    `nodelist` names nodes the allocation must hold, `nodes` how many it holds (default: the
    list's, else `slurm.nodes`); a run that survives host losses asks `--no-kill`, so a failing
    node does not end the allocation."""
    s = spec.slurm
    nodes = nodes or (len(nodelist) if nodelist else s.nodes or 1)
    opts = [f"--job-name={run_id}", f"--nodes={nodes}",
            "--ntasks-per-node=1", f"--output={output_path}", "--open-mode=append", "--export=NONE"]
    for key in ("partition", "account", "qos", "time"):
        value = getattr(s, key)
        if value:
            opts.append(f"--{key}={value}")
    if nodelist:
        opts.append(f"--nodelist={','.join(nodelist)}")
    if s.exclude:
        opts.append(f"--exclude={','.join(s.exclude)}")
    if s.gpus_per_node:
        opts.append(f"--gres=gpu:{s.gpus_per_node}")
    if s.cpus_per_task:
        opts.append(f"--cpus-per-task={s.cpus_per_task}")
    if spec.recovery.max_host_failures:
        opts.append("--no-kill")
    if s.requeue:
        # A warning ahead of the time limit to the batch shell, which passes it to every step
        # and requeues the job (USR1 belongs to NCCL).
        opts += ["--requeue", f"--signal=B:USR2@{s.signal_seconds}"]
    opts += [extra.strip().removeprefix("#SBATCH").strip() for extra in s.sbatch_extra]
    return sorted(opts)


def allocation_request(spec: ClusterSpec, run_id: str, output_path: str, nodelist: Optional[list[str]],
                       nodes: Optional[int] = None, supervise: Optional[str] = None) -> AllocationRequest:
    """The allocation's sbatch: its script holds the nodes for a launcher elsewhere or, with
    `supervise` (the shell word of a python with ddplaunch), runs the run's supervisor itself."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
                             keep_trailing_newline=True)
    script = env.get_template(ALLOCATION_TEMPLATE).render(
        run_id=run_id, requeue=spec.slurm.requeue, signal_seconds=spec.slurm.signal_seconds, supervise=supervise)
    # The allocation outlives a node's failure (--no-kill): ddplaunch names the lost host itself and
    # ends or heals the run; Slurm's own kill would race it and cancel the healthy nodes' steps too.
    opts = set(sbatch_options(spec, run_id, output_path, nodelist, nodes)) | {"--no-kill"}
    return AllocationRequest(script=script, argv=("sbatch", "--parsable", *sorted(opts)))


def node_rank_case(plan: LaunchPlan) -> str:
    """The step's first line when its nodes are known by name: each node sets `r` to its own node
    rank. A step numbers its nodes in the allocation's order ($SLURM_NODEID), which is not the
    plan's once a spare took a lost node's place: by name, every survivor keeps its node rank and
    the master moves only when it was lost."""
    cases = " ".join(f"{word(n.host_label)}) r={n.node_rank};;" for n in plan.nodes)
    return f'case "$SLURMD_NODENAME" in {cases} esac'


def task_nodes(hosts: Sequence[str], order: dict[str, int]) -> dict[int, int]:
    """{the step's task id: the plan's node index}: a step numbers its nodes in the allocation's
    `order` (its tasks too, one per node)."""
    by_step = sorted(range(len(hosts)), key=lambda i: order.get(hosts[i], len(order)))
    return {task: node for task, node in enumerate(by_step)}


#: A step's node number, as the step's shell sees it; and the node rank a node found by its name.
NODE_ID = Raw("$SLURM_NODEID")
NODE_RANK = Raw("$r")


#: On a mixed fleet, the step's shell sets this variable to its node's process count first.
NPROC = Raw('"$n"')


def step_template(plan: LaunchPlan, by_name: bool = False) -> NodeCommand:
    """The one command an srun step runs on every node of `plan`: node 0's command with the node
    rank and host taken from the step (and the process count, where nodes differ: `node_counts`).
    `by_name`: the node rank is the one `node_rank_case` set (else the step's node number)."""
    node = plan.nodes[0]
    host = Raw('"$SLURMD_NODENAME"')
    rank = f'"{NODE_RANK if by_name else NODE_ID}"'
    env = dict(node.env)
    env["DDPLAUNCH_HOST"] = host
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = Raw('"[$SLURMD_NODENAME:\\${rank}] "')
    if "DDPLAUNCH_AGENT" in env:
        env["DDPLAUNCH_AGENT"] = Raw(word(agent_name(plan.run_id, plan.stage, "")) + host)
    if "GROUP_RANK" in env:  # the node's rank, where no torchrun says it (started directly, emulated)
        env["GROUP_RANK"] = Raw(rank)
    if "RANK" in env:  # started directly: one rank per node (the emulator gives each of its ranks its own)
        env["RANK"] = Raw(rank)
    mixed = len({str(n.nproc) for n in plan.nodes}) > 1
    if mixed:
        env["OMP_NUM_THREADS"] = Raw('"$(c=$(nproc); echo $(( c / n > 1 ? c / n : 1 )))"')
    torchrun = node.torchrun and replace(
        node.torchrun, node_rank=Raw(rank),
        nproc_per_node=NPROC if mixed else node.torchrun.nproc_per_node,
        log_dir=Raw(word(in_run_dir(plan.run_id, f"torchrun-{plan.stage}-node")) + rank))
    container = node.container and replace(
        node.container, name=Raw(word(container_name(plan.run_id, plan.stage, "")) + rank))
    return replace(node, host_label=host, env=tuple(sorted(env.items())), torchrun=torchrun, host=None,
                   container=container)


def node_counts(plan: LaunchPlan) -> list[str]:
    """On a mixed fleet (nodes with different process counts), the step's first line: each node
    sets `n` to its own count by its name; else nothing."""
    if len({str(n.nproc) for n in plan.nodes}) <= 1:
        return []
    cases = " ".join(f"{word(n.host_label)}) n={word(n.torchrun.nproc_per_node if n.torchrun else str(n.nproc))};;"
                     for n in plan.nodes)
    return [f'case "$SLURMD_NODENAME" in {cases} esac']


@dataclass(frozen=True)
class StepRequest:
    """One stage as an srun step of the allocation: argv, the process environment, and the
    upload step that stages the plan's files in each node's run directory first."""

    plan: LaunchPlan
    job: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    #: The srun argv that stages the plan's files in each node's run directory, reading
    #: `shell.stage_bundle` of them on its stdin (empty: nothing to stage).
    upload: tuple[str, ...] = ()

    def staged(self) -> list[str]:
        """The local files the upload step stages, in the order it reads them."""
        return [src for src, _ in self.plan.uploads]

    def text(self) -> str:
        plan = self.plan
        out = [f"# run {plan.run_id} stage {plan.stage}: backend slurm, {plan.layout()}, master "
               f"{plan.master_addr}:{plan.master_port} (port derived from the run id, checked free at launch)"]
        if self.upload:
            names = ", ".join(Path(src).name for src in self.staged())
            out.append(f"# upload {names} to every node (one base64 line each, on the stdin of:)")
            out.append(shlex.join(_marked(self.upload)))
        out.append("# environment of every node (srun's process environment, never its command line):")
        out += [f"#   {k}={word(Raw(SECRET_SHOWN) if k in plan.secrets else v)}" for k, v in self.env]
        out.append(shlex.join(_marked(self.argv)))
        return "\n".join(out) + "\n"


def _marked(argv: tuple[str, ...]) -> list[str]:
    """The argv as shown: the job id is only known at launch, so it is marked, never printed."""
    return [f"--jobid={AT_LAUNCH}" if a.startswith("--jobid=") else a for a in argv]


def upload_step(srun: Sequence[str], run_id: str, names: Sequence[str]) -> tuple[str, ...]:
    """The srun argv (from a stage step's own options) that stages the files `names` in every
    node's run directory, reading them as base64 lines on its stdin (`shell.stage_bundle`)."""
    base = [a for a in srun if not a.startswith(("--job-name", "--kill", "--label"))]
    return tuple(base + ["--input=all", "--job-name=ddplaunch-upload", "bash", "-c", stage_files(run_id, names)])


def pyxis_of(spec: ClusterSpec) -> Optional[ContainerSpec]:
    """The spec's container when srun runs it itself (pyxis), else None."""
    return spec.container if spec.container is not None and RUNTIMES[spec.container.runtime].in_step else None


def step_request(plan: LaunchPlan, job: str, cpus_per_task: Optional[int] = None,
                 heartbeat: bool = True, pyxis: Optional[ContainerSpec] = None, by_name: bool = False) -> StepRequest:
    """The srun step of one stage in job `job` (an id, or AT_LAUNCH in a dry run); `heartbeat`:
    each node says it lives every second (for the launcher's watcher; a detached run has none);
    `by_name`: the nodes are known (allocated), each takes its node rank by its name."""
    node = step_template(plan, by_name)
    node_id = NODE_RANK if by_name else NODE_ID
    # values each node finds itself (its name, its cores) are exported by the step's shell; the
    # rest travel in srun's process environment
    per_node = {k: v if isinstance(v, Raw) else Raw(word(v)) for k, v in node.env if isinstance(v, (Raw, HostWord))}
    common = tuple((k, v) for k, v in node.env if k not in per_node)
    run_dir = word(host_run_dir(plan.run_id))
    body = [node_rank_case(plan)] if by_name else []
    body.append(f"(umask 077 && mkdir -p {run_dir} && rm -f {pid_file(plan.run_id, node_id)})")
    body += node_counts(plan)
    body.append("export " + " ".join(f"{k}={v}" for k, v in sorted(per_node.items())))
    body.append(shell_line(node, env_source=False, node_id=node_id, heartbeat=heartbeat))
    nodes = ",".join(plan.hosts)
    srun = ["srun", f"--jobid={job}", f"--nodes={plan.nnodes}", f"--ntasks={plan.nnodes}",
            "--ntasks-per-node=1", f"--nodelist={nodes}", "--kill-on-bad-exit=0", "--label", "--overlap",
            f"--job-name=ddplaunch-{plan.stage}", "--export=ALL"]
    if cpus_per_task:
        srun.append(f"--cpus-per-task={cpus_per_task}")
    if pyxis is not None:  # the whole step runs in the image
        srun += pyxis_options(pyxis, node.workdir)
    upload = upload_step(srun, plan.run_id, [dst for _, dst in plan.uploads]) if plan.uploads else ()
    return StepRequest(plan=plan, job=job, argv=tuple(srun + ["bash", "-c", " && ".join(body)]), env=common,
                       upload=upload)
