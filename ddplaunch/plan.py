"""Pure launch planning: spec + run id -> per-node torchrun commands.

Nothing here touches the network, the file system or the clock. `make_plan` returns a frozen
`LaunchPlan`: per node, the working directory, setup lines, environment and ONE structured
torchrun invocation (`TorchrunArgs`, script and its arguments as fields). Every backend renders
these same objects (`NodeCommand.shell_line()` for a shell on a host, `backends.slurm.render.step_template` for one
srun step over many nodes); nothing parses an argv back.

Environment values never go on a command line: `NodeCommand.env_text()` is the 0600 file the
backend writes on each host (secrets included) and the line sources it.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

from ddplaunch.errors import PlanError
from ddplaunch.examples import example_path
from ddplaunch.spec import ClusterSpec, HostSpec, parse_size

#: Master ports are derived from the run id inside this range (below Linux's ephemeral range).
PORT_RANGE = (20000, 32000)
#: Where each host keeps its run directory (pid files, env files, torchrun logs, staged files).
HOST_RUN_ROOT = ".ddplaunch/runs"
HOSTSIDE = Path(__file__).with_name("hostside")
HEALTHCHECK_SOURCE = HOSTSIDE / "healthcheck.py"
ENTRY_SOURCE = HOSTSIDE / "entry.py"
STAGES = ("healthcheck", "job")
#: How a secret value appears in anything shown or stored.
SECRET_SHOWN = "<secret>"
#: torchrun forwards these to its workers; SIGUSR2 is Slurm's preemption warning (NCCL owns SIGUSR1).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


class Raw(str):
    """A shell fragment built by ddplaunch itself (never from user input): left unquoted."""


def quote(word: str) -> str:
    """`shlex.quote` for user data; `Raw` fragments pass through."""
    return word if isinstance(word, Raw) else shlex.quote(word)


@dataclass(frozen=True)
class TorchrunArgs:
    """One torchrun invocation's options. `node_rank` may be a `Raw` shell expression (a Slurm
    step resolves it per node). Forwarded signals include SIGUSR2, Slurm's preemption warning."""

    nnodes: int
    node_rank: Union[int, str]
    nproc_per_node: str
    master_addr: str
    master_port: int
    rdzv_id: str
    rdzv_timeout: int
    max_restarts: int
    log_dir: str
    signals_to_handle: Optional[str] = None

    def words(self) -> list[str]:
        out = ["-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
               "--node-rank", self.node_rank if isinstance(self.node_rank, str) else str(self.node_rank),
               "--nproc-per-node", self.nproc_per_node,
               "--master-addr", self.master_addr, "--master-port", str(self.master_port),
               "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"timeout={self.rdzv_timeout}",
               "--max-restarts", str(self.max_restarts), "--tee", "3", "--log-dir", self.log_dir]
        if self.signals_to_handle:
            out += ["--signals-to-handle", self.signals_to_handle]
        return out


@dataclass(frozen=True)
class NodeCommand:
    """What runs on one node: `cd workdir; . envfile; setup; exec python [torchrun] script args`."""

    stage: str
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
    run_dir: str
    host: Optional[HostSpec] = None

    @property
    def pid_file(self) -> str:
        return Raw(f"{self.run_dir}/node{self.node_rank}.pid") if isinstance(self.node_rank, int) \
            else Raw(f"{self.run_dir}/node$SLURM_NODEID.pid")

    @property
    def env_file(self) -> str:
        rank = self.node_rank if isinstance(self.node_rank, int) else "$SLURM_NODEID"
        return Raw(f"{self.run_dir}/{self.stage}-node{rank}.env")

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def argv(self) -> list[str]:
        """python [-m torch.distributed.run OPTIONS] SCRIPT ARGS, as words (Raw ones unquoted)."""
        head = [self.python, *self.torchrun.words()] if self.torchrun else [self.python, "-u"]
        return [*head, self.script, *self.args]

    def env_text(self, secrets: frozenset[str] = frozenset(), mask: bool = False) -> str:
        """The node's environment file: `export K='v'` lines (secrets shown as <secret> with mask)."""
        lines = []
        for k, v in self.env:
            shown = Raw(SECRET_SHOWN) if mask and k in secrets else v
            lines.append(f"export {k}={quote(shown)}")
        return "\n".join(lines) + "\n"

    def shell_line(self, env_source: bool = True) -> str:
        """The one command line for `bash -c` on the host; every user value is quoted.

        `echo $$` records the shell's PID, which `exec` hands to torchrun; with a pty that
        makes torchrun the session leader, so a dropped connection HUPs it.
        """
        parts = [f"cd {quote(self.workdir)}"]
        if env_source:
            parts.append(f". {self.env_file}")
        parts += list(self.setup)
        parts.append(f"echo $$ > {self.pid_file}")
        parts.append("exec " + " ".join(quote(a) for a in self.argv()))
        return " && ".join(parts)


@dataclass(frozen=True)
class LaunchPlan:
    """One stage (health check or job) of one run, for every node."""

    run_id: str
    stage: str
    backend: str
    master_addr: str
    master_port: int
    nproc_per_node: Union[int, str]
    nodes: tuple[NodeCommand, ...]
    #: (local source, path relative to the host run directory) copied before launch.
    uploads: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    #: Env names whose values are secret (never shown or stored).
    secrets: frozenset[str] = frozenset()

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> Optional[int]:
        """Total ranks, or None when `nproc_per_node: auto` is resolved on the hosts."""
        return self.nnodes * self.nproc_per_node if isinstance(self.nproc_per_node, int) else None

    @property
    def hosts(self) -> list[str]:
        return [n.host_label for n in self.nodes]


def derive_port(run_id: str, attempt: int = 0) -> int:
    """A master port that is a pure function of the run id (and a retry counter)."""
    digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).digest()
    lo, hi = PORT_RANGE
    return lo + int.from_bytes(digest[:4], "big") % (hi - lo)


def master_addr(spec: ClusterSpec) -> str:
    """`master.addr`, else the first host (localhost as 127.0.0.1, which torchrun binds)."""
    if spec.master.addr:
        return spec.master.addr
    addr = spec.hosts[0].addr
    return "127.0.0.1" if addr == "localhost" else addr


def host_run_dir(run_id: str) -> str:
    """The run directory on a host, as a shell word ($HOME expands there)."""
    return Raw(f'"$HOME"/{HOST_RUN_ROOT}/{run_id}')


def host_python(spec: ClusterSpec, host: Optional[HostSpec]) -> str:
    """The interpreter on `host`: `hosts[].python`, else `python`, else the one running ddplaunch
    (right for local runs and hosts sharing this file system, like the simulated cluster)."""
    return (host.python if host else None) or spec.python or sys.executable


def make_plan(spec: ClusterSpec, run_id: str, stage: str, port: int,
              job_args: Optional[list[str]] = None, direct: bool = False,
              environ: Optional[Mapping[str, str]] = None, inline_healthcheck: bool = False,
              pairwise: bool = False) -> LaunchPlan:
    """Build the launch plan of one stage.

    Args:
        spec: the validated cluster spec (for Slurm: `hosts` are the allocated nodes, in order).
        run_id: unique id of this `up` (letters, digits and `._-`).
        stage: "healthcheck" or "job".
        port: the master port (see `derive_port`; the caller checks it is free).
        job_args: arguments that replace `job.args` (from `up -- ARGS`).
        direct: one rank per host started without torchrun, the torchrun env contract set by
            the plan itself (half the processes: used for the localization's pair probes).
        environ: the launcher's environment, for `env: {X: {from_env: Y}}` (None: os.environ).
        inline_healthcheck: the job's workers run the health check first, in the same launch.
        pairwise: the health check also tests host pairs in-process (and names slow hosts).
    Returns:
        The plan; `render_plan([plan])` is its dry-run text.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    run_dir = host_run_dir(run_id)
    hc_upload = (str(HEALTHCHECK_SOURCE), "healthcheck.py")
    if stage == "healthcheck":
        script: str = Raw(f"{run_dir}/healthcheck.py")
        args = healthcheck_args(spec, run_dir, pairwise)
        uploads: tuple[tuple[str, str], ...] = (hc_upload,)
        max_restarts = 0
    else:
        script, args, uploads = spec.job.script, list(spec.job.args if job_args is None else job_args), ()
        max_restarts = spec.job.max_restarts
        try:
            example = example_path(spec.job.script)
        except ValueError as err:
            raise PlanError(f"job.script: {err}") from None
        if example is not None:  # a job shipped with ddplaunch: staged on each host like the health check
            script, uploads = Raw(f"{run_dir}/{example.name}"), ((str(example), example.name),)
        # every rank runs the user's script through the entry script: the health check first when
        # inline, then the script as __main__, then (job.fast_exit) no interpreter finalization
        head = healthcheck_args(spec, run_dir, pairwise) if inline_healthcheck else ["--no-healthcheck"]
        head += [] if spec.job.fast_exit else ["--finalize"]
        args = [*head, "--", script, *args]
        script = Raw(f"{run_dir}/entry.py")
        uploads = ((str(ENTRY_SOURCE), "entry.py"), hc_upload, *uploads)
    addr = master_addr(spec)
    user_env = spec.env_values(environ if environ is not None else _os_environ())
    nodes = []
    for rank, host in enumerate(spec.hosts):
        python = host_python(spec, host)
        env = node_env(spec, run_id, stage, host.label, user_env)
        torchrun = None
        if direct:
            env = dict(env, RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank),
                       WORLD_SIZE=str(len(spec.hosts)), LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=addr, MASTER_PORT=str(port))
        else:
            torchrun = TorchrunArgs(
                nnodes=len(spec.hosts), node_rank=rank, nproc_per_node=_nproc_word(spec, python),
                master_addr=addr, master_port=port, rdzv_id=run_id, rdzv_timeout=spec.rdzv_timeout,
                max_restarts=max_restarts, log_dir=Raw(f"{run_dir}/torchrun-{stage}-node{rank}"),
                signals_to_handle=SIGNALS_TO_HANDLE)
        nodes.append(NodeCommand(
            stage=stage, node_rank=rank, host_label=host.label, workdir=spec.workdir_path,
            setup=tuple(spec.setup), env=tuple(sorted(env.items())), python=python, torchrun=torchrun,
            script=script, args=tuple(args), run_dir=run_dir, host=host))
    return LaunchPlan(run_id=run_id, stage=stage, backend=spec.backend, master_addr=addr,
                      master_port=port, nproc_per_node=1 if direct else spec.nproc_per_node,
                      nodes=tuple(nodes), uploads=uploads, secrets=spec.secret_names())


def _os_environ() -> Mapping[str, str]:
    import os

    return os.environ


def _nproc_word(spec: ClusterSpec, python: str) -> str:
    if spec.nproc_per_node != "auto":
        return str(spec.nproc_per_node)
    probe = "import torch; print(torch.cuda.device_count() or 1)"
    return Raw(f'"$({quote(python)} -c {quote(probe)})"')


def healthcheck_args(spec: ClusterSpec, run_dir: str, pairwise: bool = False) -> list[str]:
    """The health check's options from the spec's `healthcheck:` section."""
    hc = spec.healthcheck
    args = ["--backend", spec.dist_backend,
            "--sizes", ",".join(str(parse_size(s)) for s in hc.sizes),
            "--iters", str(hc.iterations), "--timeout", str(hc.timeout),
            "--collectives", ",".join(hc.collectives),
            "--json", Raw(f"{run_dir}/healthcheck.json")]
    if hc.min_busbw_gbps is not None:
        args += ["--min-busbw-gbps", str(hc.min_busbw_gbps)]
    if pairwise and len(spec.hosts) > 1:
        args += ["--pairwise", "--pair-size", str(parse_size(hc.pair_size)),
                 "--pair-parallelism", str(hc.pair_parallelism), "--min-busbw-fraction", str(hc.min_busbw_fraction)]
    return args


def node_env(spec: ClusterSpec, run_id: str, stage: str, label: str,
             user_env: Mapping[str, str]) -> dict[str, str]:
    """Every environment variable of one node's processes: ddplaunch's run tags, then the spec's."""
    env = {
        "DDPLAUNCH_RUN_ID": run_id,
        "DDPLAUNCH_STAGE": stage,
        "DDPLAUNCH_HOST": label,
        "DDPLAUNCH_DIST_TIMEOUT": str(spec.dist_timeout),
        "DDPLAUNCH_DIST_BACKEND": spec.dist_backend,
        # torchrun's own prefix for every worker line: [host:global rank]
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[{label}:${{rank}}] ",
        # the agent copies every worker line (--tee) through its own stdout, block-buffered on a
        # pipe (local, srun): lines would arrive late and could set off the hang watchdog
        "PYTHONUNBUFFERED": "1",
    }
    if spec.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = spec.socket_ifname
        env["NCCL_SOCKET_IFNAME"] = spec.socket_ifname
    if spec.job.debug_collectives and stage == "job":
        # PyTorch checks that every rank calls the same collective with matching shapes
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    env.update(user_env)  # the user's values win
    return env


def render_plan(plans: list[LaunchPlan]) -> str:
    """The dry-run text of shell backends: for each stage and node, the environment file the
    backend writes (secret values shown as <secret>) and the exact line it executes."""
    out = []
    for plan in plans:
        world = plan.world_size if plan.world_size is not None else "auto"
        port_note = " (port derived from the run id, checked free at launch)"
        out.append(f"# run {plan.run_id} stage {plan.stage}: backend {plan.backend}, "
                   f"{plan.nnodes} node(s) x {plan.nproc_per_node} proc = world {world}, "
                   f"master {plan.master_addr}:{plan.master_port}{port_note}")
        for src, dst in plan.uploads:
            out.append(f"# upload {src} -> <host run dir>/{dst}")
        for node in plan.nodes:
            out.append(f"# node {node.node_rank} on {node.host_label}: {node.env_file} (mode 0600) holds")
            out += [f"#   {line}" for line in node.env_text(plan.secrets, mask=True).splitlines()]
            out.append(node.shell_line())
    return "\n".join(out) + "\n"
