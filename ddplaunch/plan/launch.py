"""Launch planning: spec + run id -> per-node commands, as data.

Nothing here touches the network or the clock, writes anything or runs anything, and nothing
here is shell. What it reads besides its arguments: where the shipped example jobs are (a
`job.script: example:NAME` is found there) and, unless `environ` is given, this process's
environment (`env: {X: {from_env: Y}}`). `make_plan` returns a frozen `LaunchPlan` — per node, the working directory, the user's setup
lines, the environment and ONE structured invocation (`TorchrunArgs`, the script and its
arguments as fields) — and each backend renders it for what it drives (backends/shell.py: a
`bash -c` line, an env file and a pid file; the Slurm backend: one srun step for every node).
Values only the host can know are typed words the renderers resolve there: `HostPath` (a file of
the run in the host's home), `GpuCount` (`nproc_per_node: auto`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Mapping, Optional, Union

from ddplaunch.errors import PlanError
from ddplaunch.plan.ckptplan import KEY_ENV, NODE_ENV, checkpoint_args, checkpoint_env, replica_env, watched
from ddplaunch.plan.container import ContainerRun, container_run
from ddplaunch.plan.emulation import Emulation
from ddplaunch.plan.hostwords import CpuShare, GpuCount, HostPath
from ddplaunch.spec.examples import example_path
from ddplaunch.spec.model import ClusterSpec, HostSpec, parse_size

#: Master ports are derived from the run id inside this range (below Linux's ephemeral range).
PORT_RANGE = (20000, 32000)
#: Where each host keeps its run directory (pid files, env files, torchrun logs, staged files),
#: relative to the home directory of the user ddplaunch runs as there.
HOST_RUN_ROOT = ".ddplaunch/runs"
HOSTSIDE = Path(__file__).parent.parent / "hostside"
ENTRY_SOURCE = HOSTSIDE / "entry.py"
#: What the entry script loads beside it: every rank's step timing.
ENTRY_SOURCES = (ENTRY_SOURCE, HOSTSIDE / "payloads.py", HOSTSIDE / "steptiming.py")
#: The node agent (hostside/agent.py): beside torchrun on every node, the ranks' reports folded per host.
AGENT_SOURCE = HOSTSIDE / "agent.py"
AGENT_SOURCES = (AGENT_SOURCE, HOSTSIDE / "fold.py", HOSTSIDE / "payloads.py", HOSTSIDE / "procs.py",
                 HOSTSIDE / "ckpt" / "replicas.py", HOSTSIDE / "ckpt" / "layout.py")
#: `checkpoint.watch`: the agent's watch over the job's dir, the entry's restore before the job.
WATCH_SOURCES = tuple(HOSTSIDE / "ckpt" / name for name in ("jobfiles.py", "jobwatch.py", "restore.py"))
#: The health check and the modules it imports, staged together on every host.
HEALTHCHECK_SOURCES = tuple(HOSTSIDE / name for name in ("healthcheck.py", "collectives.py", "pairs.py"))
#: `up --emulate`'s ranks (plan/emulation.py).
EMULATOR_SOURCE = HOSTSIDE / "emulator.py"
class Stage(StrEnum):
    """A launch of the run: the health check on its own (`healthcheck.launch: separate`, `check`),
    or the job (with the health check inline before it, by default)."""

    HEALTHCHECK = "healthcheck"
    JOB = "job"


STAGES = tuple(Stage)
#: torchrun forwards these to its workers; SIGUSR2 is Slurm's preemption warning (NCCL owns SIGUSR1).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


def host_run_dir(run_id: str) -> HostPath:
    """The run directory on a host."""
    return HostPath(f"{HOST_RUN_ROOT}/{run_id}")


def in_run_dir(run_id: str, name: str) -> HostPath:
    """A file of the run directory on a host."""
    return HostPath(f"{HOST_RUN_ROOT}/{run_id}/{name}")


@dataclass(frozen=True)
class TorchrunArgs:
    """One torchrun invocation's options. `node_rank` may be a word a backend's renderer resolves
    per node (a Slurm step). Forwarded signals include SIGUSR2, Slurm's preemption warning.
    torchrun never restarts its workers (`--max-restarts 0`): its restarts are per node and fall
    out of step across hosts; `job.max_restarts` relaunches every host together (run/recovery.py)."""

    nnodes: int
    node_rank: Union[int, str]
    nproc_per_node: str
    master_addr: str
    master_port: int
    rdzv_id: str
    rdzv_timeout: int
    log_dir: str
    signals_to_handle: Optional[str] = None

    def words(self) -> list[str]:
        out = ["-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
               "--node-rank", self.node_rank if isinstance(self.node_rank, str) else str(self.node_rank),
               "--nproc-per-node", self.nproc_per_node,
               "--master-addr", self.master_addr, "--master-port", str(self.master_port),
               "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"timeout={self.rdzv_timeout}",
               "--max-restarts", "0", "--tee", "3", "--log-dir", self.log_dir]
        if self.signals_to_handle:
            out += ["--signals-to-handle", self.signals_to_handle]
        return out


@dataclass(frozen=True)
class NodeCommand:
    """What runs on one node: in `workdir`, with `env`, after `setup`: python [torchrun] script args."""

    stage: Stage
    node_rank: int
    host_label: str
    workdir: str
    setup: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    python: str
    #: None: started directly, one rank per host, the torchrun env contract set in `env`.
    torchrun: Optional[TorchrunArgs]
    script: str
    args: tuple[str, ...]
    run_id: str
    host: Optional[HostSpec] = None
    #: Processes on this node: a count, or "auto" (its GPUs, found there).
    nproc: Union[int, str] = 1
    #: The container torchrun runs in (plan/container.py), if any.
    container: Optional[ContainerRun] = None
    #: The node agent's command (python, agent.py, options), started beside torchrun on the host
    #: itself; its name and its parent's pid are the shell's to add. None: no agent (direct starts).
    agent: Optional[tuple[Union[str, HostPath], ...]] = None

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def argv(self) -> list[str]:
        """[the container runtime's command] python [-m torch.distributed.run OPTIONS] SCRIPT ARGS,
        as words (typed words included)."""
        head = [self.python, *self.torchrun.words()] if self.torchrun else [self.python, "-u"]
        return [*(self.container.words() if self.container else []), *head, self.script, *self.args]


@dataclass(frozen=True)
class LaunchPlan:
    """One stage (health check or job) of one run, for every node."""

    run_id: str
    stage: Stage
    backend: str
    master_addr: str
    master_port: int
    nodes: tuple[NodeCommand, ...]
    #: (local source, name in the host run directory) copied before launch.
    uploads: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    #: Env names whose values are secret (never shown or stored).
    secrets: frozenset[str] = frozenset()
    #: Whether the launch runs the health check (its own stage, or inline before the job).
    healthcheck: bool = False

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> Optional[int]:
        """Total ranks, or None when a node's `auto` count is resolved on its host."""
        counts = [n.nproc for n in self.nodes]
        return sum(c for c in counts if isinstance(c, int)) if all(isinstance(c, int) for c in counts) else None

    def layout(self) -> str:
        """`3 node(s) x 2 proc = world 6`, or `3 node(s) with 1+3+1 procs = world 5` on a mixed fleet."""
        counts = [str(n.nproc) for n in self.nodes]
        world = self.world_size if self.world_size is not None else "auto"
        if len(set(counts)) <= 1:
            return f"{self.nnodes} node(s) x {counts[0] if counts else 0} proc = world {world}"
        return f"{self.nnodes} node(s) with {'+'.join(counts)} procs = world {world}"

    @property
    def hosts(self) -> list[str]:
        return [n.host_label for n in self.nodes]


def derive_port(run_id: str, attempt: int = 0) -> int:
    """A master port that is a pure function of the run id (and a retry counter)."""
    digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).digest()
    lo, hi = PORT_RANGE
    return lo + int.from_bytes(digest[:4], "big") % (hi - lo)


def stage_port_key(run_id: str, stage: Stage) -> str:
    """What a stage's master port is derived from (`derive_port`)."""
    return f"{run_id}:{stage.value}"


def rendezvous_addr(host: HostSpec) -> str:
    """The address the other hosts reach `host` by: what the backend found (an ssh config alias's
    address), else `addr` (localhost as 127.0.0.1, which torchrun binds)."""
    if host.reach:
        return host.reach
    return "127.0.0.1" if host.addr == "localhost" else host.addr


def master_addr(spec: ClusterSpec) -> str:
    """`master.addr`, else the first host's rendezvous address."""
    if spec.master.addr:
        return spec.master.addr
    return rendezvous_addr(spec.hosts[0])


def host_python(spec: ClusterSpec, host: Optional[HostSpec]) -> str:
    """The interpreter the ranks run with on `host`: `hosts[].python`, else `python`, else the one
    running ddplaunch (right for local runs and hosts sharing this file system, like the simulated
    cluster); in a container the image's (`python:`, else python3)."""
    fallback = "python3" if spec.container else sys.executable
    return (host.python if host else None) or spec.python or fallback


def tool_python(spec: ClusterSpec, host: Optional[HostSpec]) -> str:
    """The interpreter ddplaunch's own programs (probe, reaper, stack dump: standard library only)
    run with on `host` itself: the ranks' one, except with a container, where that is the image's
    and the host's own python3 runs them."""
    return "python3" if spec.container else host_python(spec, host)


@dataclass(frozen=True)
class _Program:
    """What a stage's workers run: script, arguments, staged files."""

    script: str
    args: list[str]
    uploads: tuple[tuple[str, str], ...]


def _program(run: PlanContext, stage: Stage, how: StageOptions) -> _Program:
    """The stage's program: the health check on its own, or the job through the entry script."""
    spec, run_id = run.spec, run.run_id
    healthcheck = tuple((str(src), src.name) for src in HEALTHCHECK_SOURCES)
    agent = tuple((str(src), src.name) for src in AGENT_SOURCES if src not in ENTRY_SOURCES)
    if stage is Stage.HEALTHCHECK:
        return _Program(in_run_dir(run_id, "healthcheck.py"), healthcheck_args(spec, run_id, how.pairwise),
                        healthcheck + tuple((str(src), src.name) for src in AGENT_SOURCES))
    script: str = spec.job.script
    uploads: tuple[tuple[str, str], ...] = ()
    try:
        example = example_path(spec.job.script)
    except ValueError as err:
        raise PlanError(f"job.script: {err}") from None
    if example is not None:  # a job shipped with ddplaunch: staged on each host like the health check
        script, uploads = in_run_dir(run_id, example.name), ((str(example), example.name),)
    # every rank runs the user's script through the entry script: the health check first when
    # inline, then the script as __main__, then (job.fast_exit) no interpreter finalization
    head = healthcheck_args(spec, run_id, how.pairwise) if how.inline_healthcheck else ["--no-healthcheck"]
    head += [] if spec.job.fast_exit else ["--finalize"]
    resume = spec.job.resume_args if how.recovery else []  # a relaunch tells the job to resume
    job_args = checkpoint_args(spec, [*(spec.job.args if run.job_args is None else run.job_args), *resume])
    args = [*head, "--", script, *job_args]
    watch = tuple((str(src), src.name) for src in WATCH_SOURCES) if watched(spec) else ()
    return _Program(in_run_dir(run_id, "entry.py"), args,
                    (*((str(src), src.name) for src in ENTRY_SOURCES), *agent, *watch, *healthcheck, *uploads))


def agent_name(run_id: str, stage: Stage, host: str) -> str:
    """The name of a node's agent (its socket's, in the abstract namespace), in its ranks' environment."""
    return f"{run_id}.{stage.value}.{host}"


def container_name(run_id: str, stage: Stage, node: object) -> str:
    """`ddp-RUN-STAGE-nNODE`: a run's containers are told apart from everyone else's."""
    return f"ddp-{run_id}-{stage.value}-n{node}"


@dataclass(frozen=True)
class PlanContext:
    """What every launch of one run is planned from: the validated spec (for Slurm: `hosts` are
    the allocated nodes, in order), the run id (letters, digits and `._-`), the arguments that
    replace `job.args` (`up -- ARGS`), emulated ranks in place of torchrun and the job
    (`up --emulate`), and the launcher's environment for `env: {X: {from_env: Y}}` (None:
    os.environ)."""

    spec: ClusterSpec
    run_id: str
    job_args: Optional[list[str]] = None
    emulate: Optional[Emulation] = None
    environ: Optional[Mapping[str, str]] = None


@dataclass(frozen=True)
class StageOptions:
    """How one launch starts its ranks, as its caller decides (`plan_stage`, the localization)."""

    #: One rank per host started without torchrun, the torchrun env contract set by the plan
    #: itself (half the processes: the localization's pair probes, a one-process `check`).
    direct: bool = False
    #: The job's workers run the health check first, in the same launch.
    inline_healthcheck: bool = False
    #: The health check also tests host pairs in-process (and names slow hosts).
    pairwise: bool = False
    #: How many host failures the run has survived: a relaunch after one tells the job
    #: (DDPLAUNCH_RECOVERY=N, and `job.resume_args` after its arguments) to resume from its
    #: latest checkpoint.
    recovery: int = 0


def make_plan(run: PlanContext, stage: Stage, port: int, how: StageOptions = StageOptions()) -> LaunchPlan:
    """Build the launch plan of one stage.

    Args:
        run: the run's spec, id, job arguments, emulation and launcher environment.
        stage: the health check on its own, or the job.
        port: the master port (see `derive_port`; the caller checks it is free).
        how: how this launch starts its ranks (direct, health check inline, pairwise, recovery).
    Returns:
        The plan; a backend's `render(plan).text()` is its dry-run text.
    """
    spec = run.spec
    program = _program(run, stage, how) if run.emulate is None else _emulated(run.run_id, run.emulate, len(spec.hosts))
    addr = master_addr(spec)
    user_env = spec.env_values(os.environ if run.environ is None else run.environ)
    where = _Where(run, stage, how, addr, port, user_env)
    nodes = [_node(where, program, rank, host) for rank, host in enumerate(spec.hosts)]
    return LaunchPlan(run_id=run.run_id, stage=stage, backend=spec.backend, master_addr=addr, master_port=port,
                      nodes=tuple(nodes), uploads=program.uploads, secrets=spec.secret_names() | {KEY_ENV},
                      healthcheck=stage is Stage.HEALTHCHECK or how.inline_healthcheck)


@dataclass(frozen=True)
class _Where:
    """What every node of one launch shares."""

    run: PlanContext
    stage: Stage
    how: StageOptions
    addr: str
    port: int
    user_env: dict[str, str]


def _node(where: _Where, program: _Program, rank: int, host: HostSpec) -> NodeCommand:
    """Node `rank`'s command: its environment, its agent, torchrun's arguments (or none: direct
    ranks, emulated ones)."""
    spec, run_id, stage = where.run.spec, where.run.run_id, where.stage
    emulate, direct = where.run.emulate, where.how.direct
    python = host_python(spec, host)
    nproc = 1 if direct else emulate.ranks_per_host if emulate is not None else spec.nproc_of(host)
    env = node_env(spec, run_id, stage, host.label, where.user_env, nproc)
    if where.how.recovery:
        env["DDPLAUNCH_RECOVERY"] = str(where.how.recovery)
    if stage is Stage.JOB and not direct and emulate is None:  # the node's agent copies saves to buddies
        env.update(replica_env(spec, rank, [rendezvous_addr(h) for h in spec.hosts], where.port,
                               os.environ if where.run.environ is None else where.run.environ))
        env.update({NODE_ENV: str(rank)} if watched(spec) else {})  # the agent's watch: which node's dir
    torchrun, agent = None, None
    if not direct:  # the node's agent: its ranks report to it (hostside/agent.py)
        env["DDPLAUNCH_AGENT"] = agent_name(run_id, stage, host.label)
        # -S: standard library only, so no site-packages to scan nor .pth files to run at its start
        agent = (tool_python(spec, host), "-S", in_run_dir(run_id, AGENT_SOURCE.name),
                 "--window", str(spec.stragglers.window))
    if emulate is not None:  # the emulator starts the node's ranks itself, as torchrun would
        env.update(GROUP_RANK=str(rank), MASTER_ADDR=where.addr, MASTER_PORT=str(where.port))
    elif direct:
        env = dict(env, RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank),
                   WORLD_SIZE=str(len(spec.hosts)), LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=where.addr, MASTER_PORT=str(where.port))
    else:
        torchrun = TorchrunArgs(
            nnodes=len(spec.hosts), node_rank=rank,
            # in a container the host counts its GPUs itself (`python:` is the image's)
            nproc_per_node=GpuCount("" if spec.container else python) if nproc == "auto" else str(nproc),
            master_addr=where.addr, master_port=where.port, rdzv_id=run_id, rdzv_timeout=spec.rdzv_timeout,
            log_dir=in_run_dir(run_id, f"torchrun-{stage}-node{rank}"),
            signals_to_handle=SIGNALS_TO_HANDLE)
    return NodeCommand(
        stage=stage, node_rank=rank, host_label=host.label, workdir=spec.workdir_path,
        setup=tuple(spec.setup), env=tuple(sorted(env.items())), python=python, torchrun=torchrun,
        script=program.script, args=tuple(program.args), run_id=run_id, host=host, nproc=nproc,
        container=_container(spec, run_id, stage, rank, env), agent=agent)


def _emulated(run_id: str, emulate: Emulation, nnodes: int) -> _Program:
    """The program of an emulated job: the emulator, with the entry's and the agent's files."""
    sources = (EMULATOR_SOURCE, *ENTRY_SOURCES, *(s for s in AGENT_SOURCES if s not in ENTRY_SOURCES))
    return _Program(in_run_dir(run_id, EMULATOR_SOURCE.name), emulate.args(nnodes),
                    tuple((str(src), src.name) for src in sources))


def _container(spec: ClusterSpec, run_id: str, stage: Stage, rank: int, env: Mapping[str, str]
               ) -> Optional[ContainerRun]:
    """The node's container, if the spec has one: workdir, the run directory and the job script's
    own directory (when it is elsewhere) bound; every variable of `env` passed by name."""
    if spec.container is None:
        return None
    extra = []
    script = spec.job.script
    if os.path.isabs(script) and not script.startswith(spec.workdir_path.rstrip("/") + "/"):
        folder = os.path.dirname(script)
        extra.append(f"{folder}:{folder}:ro")
    return container_run(spec.container, run_id, container_name(run_id, stage, rank), spec.workdir_path,
                         host_run_dir(run_id), list(env), extra)


def healthcheck_args(spec: ClusterSpec, run_id: str, pairwise: bool = False) -> list[str]:
    """The health check's options from the spec's `healthcheck:` section."""
    hc = spec.healthcheck
    args = ["--backend", spec.dist_backend,
            "--sizes", ",".join(str(parse_size(s)) for s in hc.sizes),
            "--iters", str(hc.iterations), "--timeout", str(hc.timeout),
            "--collectives", ",".join(hc.collectives),
            "--json", in_run_dir(run_id, "healthcheck.json")]
    if hc.min_busbw_gbps is not None:
        args += ["--min-busbw-gbps", str(hc.min_busbw_gbps)]
    if pairwise and len(spec.hosts) > 1:
        args += ["--pairwise", "--pair-size", str(parse_size(hc.pair_size)),
                 "--pair-parallelism", str(hc.pair_parallelism), "--min-busbw-fraction", str(hc.min_busbw_fraction)]
    return args


def node_env(spec: ClusterSpec, run_id: str, stage: Stage, label: str,
             user_env: Mapping[str, str], nproc: Union[int, str] = 1) -> dict[str, str]:
    """Every environment variable of one node's processes (`nproc` of them): ddplaunch's run tags,
    then the spec's."""
    env = {
        "DDPLAUNCH_RUN_ID": run_id,
        "DDPLAUNCH_STAGE": stage.value,
        "DDPLAUNCH_HOST": label,
        "DDPLAUNCH_DIST_TIMEOUT": str(spec.dist_timeout),
        "DDPLAUNCH_DIST_BACKEND": spec.dist_backend,
        # torchrun's own prefix for every worker line: [host:global rank]
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[{label}:${{rank}}] ",
        # the agent copies every worker line (--tee) through its own stdout, block-buffered on a
        # pipe (local, srun): lines would arrive late and could set off the hang watchdog
        "PYTHONUNBUFFERED": "1",
    }
    if spec.job.stop_grace != 30:  # torchrun's default; its SIGKILL follows its SIGTERM this much later
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(spec.job.stop_grace)
    if isinstance(nproc, int) and nproc > 1:
        env["OMP_NUM_THREADS"] = CpuShare(str(nproc))
    if spec.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = spec.socket_ifname
        env["NCCL_SOCKET_IFNAME"] = spec.socket_ifname
    if spec.job.debug_collectives and stage is Stage.JOB:
        # PyTorch checks that every rank calls the same collective with matching shapes
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    env.update(checkpoint_env(spec))
    env.update(user_env)  # the user's values win
    return env
