"""Pure launch planning: spec + run id -> per-node torchrun command lines.

Nothing here touches the network, the file system or the clock. `make_plan` returns a
frozen `LaunchPlan` whose `NodeCommand.shell_line()` is the exact line a backend runs
(`bash -c LINE` locally, over SSH remotely); `render_plan` is what `--dry-run` prints.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ddplaunch.spec import ClusterSpec, HostSpec, parse_size

#: Master ports are derived from the run id inside this range (below Linux's ephemeral range).
PORT_RANGE = (20000, 32000)
#: Where each host keeps its run directory (pid files, torchrun logs, staged files).
HOST_RUN_ROOT = ".ddplaunch/runs"
HEALTHCHECK_SOURCE = Path(__file__).with_name("hostside") / "healthcheck.py"
STAGES = ("healthcheck", "job")
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|API_?KEY|PRIVATE", re.IGNORECASE)


class Raw(str):
    """A shell fragment built by ddplaunch itself (never from user input): left unquoted."""


def quote(word: str) -> str:
    """`shlex.quote` for user data; `Raw` fragments pass through."""
    return word if isinstance(word, Raw) else shlex.quote(word)


@dataclass(frozen=True)
class NodeCommand:
    """What runs on one host: `cd workdir; setup; exec env ... torchrun ...`."""

    node_rank: int
    host: HostSpec
    workdir: str
    setup: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    run_dir: str

    @property
    def pid_file(self) -> str:
        return f"{self.run_dir}/node{self.node_rank}.pid"

    def shell_line(self) -> str:
        """The one command line for `bash -c` on the host; every user value is quoted.

        `echo $$` records the shell's PID, which `exec` hands to torchrun; with a pty that
        makes torchrun the session leader, so a dropped connection HUPs it.
        """
        parts = [f"mkdir -p {self.run_dir}", f"cd {quote(self.workdir)}"]
        parts += list(self.setup)
        parts.append(f"echo $$ > {self.pid_file}")
        env = " ".join(f"{k}={quote(v)}" for k, v in self.env)
        parts.append(f"exec env {env} " + " ".join(quote(a) for a in self.argv))
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

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> Optional[int]:
        """Total ranks, or None when `nproc_per_node: auto` is resolved on the hosts."""
        return self.nnodes * self.nproc_per_node if isinstance(self.nproc_per_node, int) else None


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


def make_plan(spec: ClusterSpec, run_id: str, stage: str, port: int,
              job_args: Optional[list[str]] = None, direct: bool = False) -> LaunchPlan:
    """Build the launch plan of one stage.

    Args:
        spec: the validated cluster spec.
        run_id: unique id of this `up` (letters, digits and dashes).
        stage: "healthcheck" or "job".
        port: the master port (see `derive_port`; the caller checks it is free).
        job_args: arguments that replace `job.args` (from `up -- ARGS`).
        direct: one rank per host started without torchrun, the torchrun env contract set by
            the plan itself (half the processes: used for the localization's pair probes).
    Returns:
        The plan; `render_plan(plan)` is its dry-run text.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    run_dir = host_run_dir(run_id)
    if stage == "healthcheck":
        script: str = Raw(f"{run_dir}/healthcheck.py")
        args = _healthcheck_args(spec, run_dir)
        uploads = ((str(HEALTHCHECK_SOURCE), "healthcheck.py"),)
        max_restarts = 0
    else:
        script, args, uploads = spec.job.script, list(spec.job.args if job_args is None else job_args), ()
        max_restarts = spec.job.max_restarts
    addr = master_addr(spec)
    nodes = []
    for rank, host in enumerate(spec.hosts):
        python = host_python(spec, host)
        env = _node_env(spec, run_id, stage, host)
        if direct:
            argv = [python, "-u", script, *args]
            env = tuple(sorted(dict(env, RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank),
                                    WORLD_SIZE=str(len(spec.hosts)), LOCAL_WORLD_SIZE="1",
                                    MASTER_ADDR=addr, MASTER_PORT=str(port)).items()))
        else:
            argv = [python, "-m", "torch.distributed.run",
                    "--nnodes", str(len(spec.hosts)), "--node-rank", str(rank),
                    "--nproc-per-node", _nproc_word(spec, python),
                    "--master-addr", addr, "--master-port", str(port),
                    "--rdzv-id", run_id, "--rdzv-conf", f"timeout={spec.rdzv_timeout}",
                    "--max-restarts", str(max_restarts),
                    "--tee", "3", "--log-dir", Raw(f"{run_dir}/torchrun-{stage}-node{rank}"),
                    script, *args]
        nodes.append(NodeCommand(
            node_rank=rank, host=host, workdir=spec.workdir_path, setup=tuple(spec.setup),
            env=env, argv=tuple(argv), run_dir=run_dir))
    return LaunchPlan(run_id=run_id, stage=stage, backend=spec.backend, master_addr=addr,
                      master_port=port, nproc_per_node=1 if direct else spec.nproc_per_node,
                      nodes=tuple(nodes), uploads=uploads)


def host_python(spec: ClusterSpec, host: HostSpec) -> str:
    """The interpreter on `host`: `hosts[].python`, else `python`, else the one running ddplaunch
    (right for local runs and hosts sharing this file system, like the simulated cluster)."""
    import sys

    return host.python or spec.python or sys.executable


def _nproc_word(spec: ClusterSpec, python: str) -> str:
    if spec.nproc_per_node != "auto":
        return str(spec.nproc_per_node)
    probe = "import torch; print(torch.cuda.device_count() or 1)"
    return Raw(f'"$({quote(python)} -c {quote(probe)})"')


def _healthcheck_args(spec: ClusterSpec, run_dir: str) -> list[str]:
    hc = spec.healthcheck
    args = ["--backend", spec.dist_backend,
            "--sizes", ",".join(str(parse_size(s)) for s in hc.sizes),
            "--iters", str(hc.iterations), "--timeout", str(hc.timeout),
            "--json", Raw(f"{run_dir}/healthcheck.json")]
    if hc.min_busbw_gbps is not None:
        args += ["--min-busbw-gbps", str(hc.min_busbw_gbps)]
    return args


def _node_env(spec: ClusterSpec, run_id: str, stage: str, host: HostSpec) -> tuple[tuple[str, str], ...]:
    env = {
        "DDPLAUNCH_RUN_ID": run_id,
        "DDPLAUNCH_STAGE": stage,
        "DDPLAUNCH_HOST": host.label,
        "DDPLAUNCH_DIST_TIMEOUT": str(spec.dist_timeout),
        "DDPLAUNCH_DIST_BACKEND": spec.dist_backend,
        # torchrun's own prefix for every worker line: [host:global rank]
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[{host.label}:${{rank}}] ",
    }
    if spec.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = spec.socket_ifname
        env["NCCL_SOCKET_IFNAME"] = spec.socket_ifname
    if spec.job.debug_collectives and stage == "job":
        # PyTorch checks that every rank calls the same collective with matching shapes
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    env.update(spec.env)  # the user's values win
    return tuple(sorted(env.items()))


def is_secret(name: str) -> bool:
    """Env names whose values ddplaunch never prints (tokens, passwords, keys)."""
    return bool(SECRET_NAME.search(name))


def render_plan(plans: list[LaunchPlan]) -> str:
    """The dry-run text: for each stage and node, the exact line the backend executes.

    Values of secret env names (`is_secret`) are shown as `***`; nothing else differs.
    """
    out = []
    for plan in plans:
        world = plan.world_size if plan.world_size is not None else "auto"
        out.append(f"# run {plan.run_id} stage {plan.stage}: backend {plan.backend}, "
                   f"{plan.nnodes} node(s) x {plan.nproc_per_node} proc = world {world}, "
                   f"master {plan.master_addr}:{plan.master_port}")
        for src, dst in plan.uploads:
            out.append(f"# upload {src} -> <host run dir>/{dst}")
        for node in plan.nodes:
            line = node.shell_line()
            for k, v in node.env:
                if is_secret(k) and v:
                    line = line.replace(f" {k}={quote(v)} ", f" {k}=*** ")
            out.append(f"# node {node.node_rank} on {node.host.label}")
            out.append(line)
    return "\n".join(out) + "\n"
