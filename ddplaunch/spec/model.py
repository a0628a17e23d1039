"""The cluster spec: validated data, nothing else.

The pydantic v2 models of a cluster.yaml (a frozen `ClusterSpec`) and the checks of single
values; spec/load.py reads a file into one, mapping every problem to `file:line: key.path:
problem (hint)`. After loading, ddplaunch trusts the spec. Secrets in `env:` are data too:
`secret_names()`, `env_values(environ)` and `redacted()`. Which backends exist, and what each
cannot honour, is the registry's (spec/registry.py).
"""

from __future__ import annotations

import collections
import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ddplaunch.errors import SpecError
from ddplaunch.spec import registry
from ddplaunch.spec.ckptsection import CHECKPOINT_DIR_WORD, CheckpointSpec, CheckpointTier
from ddplaunch.spec.hostlist import expand_hosts
from ddplaunch.spec.values import (SECRET_SHOWN, Arg, EnvName, HostAddr, HostName, Interpreter, Line, Mount,
                                   Runtime, SbatchOption, SlurmName, SlurmNames, SlurmTime, UserEnvName, UserName,
                                   is_secret_name, is_secret_value, parse_size)
from ddplaunch.spec.yamlsafe import show

__all__ = ["CHECKPOINT_DIR_WORD", "CheckpointSpec", "CheckpointTier", "ClusterSpec", "parse_size"]

# --------------------------------------------------------------------------- the model


class _Strict(BaseModel):
    """Base of every spec section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _nproc_value(value: Any) -> Any:
    """A process count: a positive integer, or `auto` (the host's GPUs, at least one)."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer or 'auto', got {show(repr(value))}")
    return value


Nproc = Annotated[Union[int, Literal["auto"]], BeforeValidator(_nproc_value)]


class HostSpec(_Strict):
    """One machine. A plain string in YAML is shorthand for `{addr: STRING}`."""

    addr: HostAddr
    name: Optional[HostName] = None
    user: Optional[UserName] = None
    port: Optional[int] = Field(default=None, ge=1, le=65535)
    python: Optional[Interpreter] = None
    #: processes on this host (a mixed fleet); default: the spec's `nproc_per_node`
    nproc: Optional[Nproc] = None
    #: The address the other hosts reach this one by, where `addr` is a name only the launcher
    #: knows (an ssh config alias): found by the SSH backend, never read from a spec.
    reach: Optional[str] = Field(default=None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, dict) and "reach" in value:
            raise ValueError("unknown key 'reach' (the SSH backend finds a host's address itself; to set the "
                             "master's, use master.addr)")
        return {"addr": value} if isinstance(value, str) else value

    @property
    def label(self) -> str:
        """The name shown in logs and reports (`name`, else `addr`)."""
        return self.name or self.addr


class MasterSpec(_Strict):
    """Where rank 0's TCPStore listens. Defaults: first host, a port derived from the run id."""

    addr: Optional[HostAddr] = None
    port: Optional[int] = Field(default=None, ge=1, le=65535)


Collective = Literal["all_reduce", "all_gather", "reduce_scatter"]


class HealthcheckSpec(_Strict):
    """The all_reduce health check that runs before the job."""

    enabled: bool = True
    #: a latency size and a bandwidth size: every size costs O(world) per collective on Gloo; a
    #: sweep (``[4K, 64K, 1M, 8M]``) is for when the table is the point
    sizes: list[Union[int, str]] = Field(default_factory=lambda: list[Union[int, str]](["4K", "8M"]))
    iterations: int = Field(default=3, ge=1)
    timeout: int = Field(default=60, ge=1, description="seconds for init and each collective")
    min_busbw_gbps: Optional[float] = Field(default=None, gt=0)
    pairwise: bool = False
    pair_size: Union[int, str] = "16M"
    pair_parallelism: int = Field(default=0, ge=0)
    min_busbw_fraction: float = Field(default=0.5, gt=0, le=1)
    on_fail: Literal["stop", "exclude"] = "stop"
    #: Checked exactly and timed (FSDP's traffic is all_gather and reduce_scatter).
    collectives: list[Collective] = \
        Field(default_factory=lambda: list[Collective](["all_reduce"]), min_length=1)
    #: inline: every worker runs the health check, then the job, in one torchrun launch;
    #: separate: the health check is a launch of its own before the job's.
    launch: Literal["inline", "separate"] = "inline"

    @field_validator("sizes")
    @classmethod
    def _sizes_parse(cls, sizes: list[Union[int, str]]) -> list[Union[int, str]]:
        if not sizes:
            raise ValueError("needs at least one size, e.g. [4K, 1M]")
        for size in sizes:
            parse_size(size)
        return sizes

    @field_validator("pair_size")
    @classmethod
    def _pair_size(cls, size: Union[int, str]) -> Union[int, str]:
        parse_size(size)
        return size


class PreflightSpec(_Strict):
    """Host checks before anything starts (see ddplaunch/diagnose/preflight.py)."""

    enabled: Optional[bool] = None
    max_clock_skew: float = Field(default=5.0, gt=0)
    min_free_disk_gb: float = Field(default=1.0, ge=0)
    #: seconds the hosts have to reach the master's port (the master listens that long per wave
    #: of the launcher's fan-out; every probe ends as soon as all hosts got through)
    timeout: float = Field(default=15.0, gt=0, le=3600)


class JobSpec(_Strict):
    """The training script, and how a failed job is relaunched."""

    script: Line = "jobs/toy_ddp.py"
    args: list[Arg] = Field(default_factory=list)
    #: appended to the job's arguments on every relaunch (a host failure's recovery, a restart),
    #: e.g. nanoGPT's [--init_from=resume]: a job that needs telling to resume from its checkpoint
    resume_args: list[Arg] = Field(default_factory=list)
    #: relaunches of the whole job on the same hosts after its own failure (run/recovery.py)
    max_restarts: int = Field(default=0, ge=0)
    hang_timeout: Optional[float] = Field(default=None, gt=0)
    debug_collectives: bool = False
    #: After the script returned: leave without interpreter finalization (torch's Gloo threads
    #: sometimes abort there, turning a finished job into a failed one). false: exit normally.
    fast_exit: bool = True
    #: Seconds between SIGTERM and SIGKILL when ddplaunch stops a run: what a job gets to
    #: checkpoint (torchrun's own grace for its workers too: TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
    stop_grace: int = Field(default=30, ge=1, le=3600)

    @field_validator("args", "resume_args", mode="before")
    @classmethod
    def _args_str(cls, args: Any) -> Any:
        return [str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a for a in args] \
            if isinstance(args, list) else args


class ContainerSpec(_Strict):
    """Every rank inside the user's image (plan/container.py renders each runtime's command)."""

    #: an image name (registry or local); apptainer: a .sif path or docker://...; enroot: a .sqsh or a name
    image: Line
    runtime: Runtime = Runtime.DOCKER
    mounts: list[Mount] = Field(default_factory=list)
    #: extra flags for the runtime's run command (`--shm-size=8g` replaces the host IPC default)
    options: list[Arg] = Field(default_factory=list)
    pull: Literal["missing", "always", "never"] = "missing"


class RecoverySpec(_Strict):
    """Self-healing: how many host losses a run survives, and with what (run/loop.py, run/recovery.py)."""

    #: host losses a run survives; 0: the run fails and names the lost host
    max_host_failures: int = Field(default=0, ge=0)
    #: hosts held in reserve, pre-flighted with the others; a backend that allocates its nodes
    #: (slurm) also takes a count of extra nodes for the allocation to hold
    spares: Union[int, list[HostSpec]] = Field(default_factory=list)
    #: without a spare left, go on with the survivors while at least this many remain
    min_hosts: Optional[int] = Field(default=None, ge=1)
    #: seconds a node may say nothing (its shell's heartbeat comes every second) before its host
    #: is probed, and lost if it does not answer (SSH: and a peer cannot reach it either)
    detect_timeout: float = Field(default=2.0, gt=0, le=600)
    #: seconds a host the run lost must answer the supervisor's probes before it is the run's spare
    #: again (its bad-host entry cleared; `ddplaunch hosts clear HOST` readmits it at its next
    #: answer); a host lost twice in a run is not taken back; 0: lost hosts never come back
    rejoin_after: float = Field(default=30.0, ge=0, le=86400)
    #: a host named a straggler is swapped for a spare at the job's next checkpoint (a planned
    #: recovery within max_host_failures); without a spare it is only named
    evict_stragglers: bool = False
    #: seconds a host a run named lost, cut off, failing the health check, or evicted as a
    #: straggler is remembered (0: never): the next `up` skips it or refuses (run/hostmemory.py)
    remember_bad_hosts: float = Field(default=86400.0, ge=0)
    #: the file they are remembered in (default $DDPLAUNCH_HOME/host-health.json); a team's shared
    #: path is safe for concurrent runs
    host_health_file: Optional[Line] = None

    @field_validator("spares", mode="before")
    @classmethod
    def _spare_lists(cls, spares: Any) -> Any:
        if isinstance(spares, bool) or isinstance(spares, int) and spares < 0:
            raise ValueError("must be a list of hosts or (slurm) a count of extra nodes >= 0")
        return expand_hosts(spares) if isinstance(spares, list) else spares

    @property
    def spare_count(self) -> int:
        return self.spares if isinstance(self.spares, int) else len(self.spares)


class SupervisorSpec(_Strict):
    """The run's supervisor and the hosts' side of it (ssh): how long a node runs on without it."""

    #: seconds a node's ranks run on without hearing from the supervisor (it renews every node's
    #: lease every lease/4 s, at most 30 s); then the node stops them itself (SIGTERM to torchrun,
    #: SIGKILL after job.stop_grace): no rank outlives a dead, frozen or cut-off supervisor by more.
    #: Long enough for a laptop's network to come back; the supervisor suspects itself meanwhile.
    lease: float = Field(default=120.0, ge=5, le=86400)
    #: a host that runs the run's supervisor instead of this machine (a head or login node), so the
    #: run outlives this machine and its network; reached as the hosts are (ssh:, the ssh config).
    #: Its `python` (default: this machine's, at the same path) must have ddplaunch, and the spec's files (job script,
    #: hosts file, ssh key) must be at the same paths there (a shared home). `up` hands the run
    #: over and follows it from there; `attach`, `status`, `logs`, `down` run there over SSH.
    host: Optional[HostSpec] = None


class StragglerSpec(_Strict):
    """Stragglers named while the job runs, from every rank's step timing (diagnose/stragglers.py)."""

    #: a host is named when its ranks compute this much longer than their peers' median
    threshold: float = Field(default=0.15, gt=0, le=10)
    #: steps per window; a host is named when it is slow in two windows in a row (15 s of steps)
    window: int = Field(default=20, ge=2, le=10000)


class SshSpec(_Strict):
    """How to reach the hosts of `backend: ssh`."""

    user: Optional[UserName] = None
    key: Optional[Line] = None
    #: None: the ssh config's Port, else 22 (backends/ssh/routes.py)
    port: Optional[int] = Field(default=None, ge=1, le=65535)
    known_hosts: Optional[Line] = None
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    connect_timeout: float = Field(default=10, gt=0)


class SlurmSpec(_Strict):
    """The allocation asked for by `backend: slurm`."""

    conf: Optional[Line] = None
    output_dir: Line = "slurm-logs"
    partition: Optional[SlurmNames] = None
    account: Optional[SlurmName] = None
    qos: Optional[SlurmName] = None
    time: Optional[SlurmTime] = None
    nodes: Optional[int] = Field(default=None, ge=1)
    gpus_per_node: Optional[int] = Field(default=None, ge=0)
    cpus_per_task: Optional[int] = Field(default=None, ge=1)
    sbatch_extra: list[SbatchOption] = Field(default_factory=list)
    #: nodes the allocation must not hold (sbatch --exclude); hosts remembered bad are added
    exclude: list[SlurmName] = Field(default_factory=list)
    requeue: bool = False
    signal_seconds: int = Field(default=120, ge=1, description="with requeue: SIGUSR2 this long before the time limit")

    @field_validator("time", mode="before")
    @classmethod
    def _minutes(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else value


class EnvVar(_Strict):
    """One `env:` entry: `NAME: "value"`, `NAME: {value: "...", secret: true}` or
    `NAME: {from_env: VAR}` (taken from the launcher's environment at launch; always secret)."""

    value: Optional[Arg] = None
    from_env: Optional[EnvName] = None
    secret: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"value": value}
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"value": str(value)}  # load_spec has already refused YAML's coercions
        if not isinstance(value, dict):
            raise ValueError('must be a string, {from_env: NAME} or {value: "...", secret: true}')
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "EnvVar":
        if (self.value is None) == (self.from_env is None):
            raise ValueError('needs exactly one of value: "..." or from_env: NAME')
        return self


class ClusterSpec(_Strict):
    """A whole cluster.yaml. See the annotated `cluster.yaml` at the repository root."""

    name: str = Field(default="ddp", pattern=r"^[A-Za-z0-9._-]{1,100}$")
    #: One of the registered backends (spec/registry.py).
    backend: str = "local"
    hosts: list[HostSpec] = Field(default_factory=lambda: [HostSpec(addr="localhost")])

    @field_validator("hosts", mode="before")
    @classmethod
    def _hostlists(cls, hosts: Any) -> Any:
        """`gpu[01-04,07]` stands for gpu01..gpu04 and gpu07, as in Slurm, on every backend (spec/hostlist.py)."""
        return expand_hosts(hosts) if isinstance(hosts, list) else hosts
    nproc_per_node: Nproc = 1
    master: MasterSpec = Field(default_factory=MasterSpec)
    python: Optional[Interpreter] = None
    workdir: Optional[Line] = None
    env: dict[UserEnvName, EnvVar] = Field(default_factory=dict)
    setup: list[Arg] = Field(default_factory=list)
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    socket_ifname: Optional[Line] = None
    rdzv_timeout: int = Field(default=60, ge=1)
    dist_timeout: int = Field(default=300, ge=1)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    healthcheck: HealthcheckSpec = Field(default_factory=HealthcheckSpec)
    job: JobSpec = Field(default_factory=JobSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    ssh: SshSpec = Field(default_factory=SshSpec)
    supervisor: SupervisorSpec = Field(default_factory=SupervisorSpec)
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    container: Optional[ContainerSpec] = None
    checkpoint: Optional[CheckpointSpec] = None
    sync: list[Line] = Field(default_factory=list)
    # Not a YAML key: the directory of the spec file, against which relative paths resolve.
    base_dir: str = Field(default=".", exclude=True)

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in registry.names():
            raise ValueError(f"unknown backend {show(repr(value), 60)} (registered: {', '.join(registry.names())})")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterSpec":
        if not self.hosts:
            raise ValueError("hosts: needs at least one host")
        limit = registry.registration(self.backend).max_hosts
        if limit is not None and len(self.hosts) > limit:
            others = " or ".join(repr(n) for n in registry.names() if registry.registration(n).max_hosts is None)
            raise ValueError(f"hosts: backend {self.backend!r} runs on "
                             + ("exactly one host" if limit == 1 else f"at most {limit} hosts")
                             + f"; use backend {others} for several")
        spares = self.recovery.spares if isinstance(self.recovery.spares, list) else []
        labels = [h.label for h in self.hosts] + [h.label for h in spares]
        dupes = sorted(x for x, n in collections.Counter(labels).items() if n > 1)
        if dupes:
            raise ValueError(f"hosts: duplicate host {show(', '.join(dupes))} (a spare must not be a host too)")
        runtimes = registry.registration(self.backend).runtimes
        if self.container is not None and self.container.runtime not in runtimes:
            raise ValueError(f"container.runtime: backend {self.backend!r} cannot run {self.container.runtime.value!r} "
                             f"(pyxis is srun's own --container-image); use one of {', '.join(runtimes)}")
        if isinstance(self.recovery.spares, int) and self.recovery.spares and \
                not registry.registration(self.backend).allocates:
            raise ValueError(f"recovery.spares: backend {self.backend!r} allocates no nodes: list the spare "
                             "hosts by name or address, as under hosts:")
        self._checkpoint_words()
        return self

    def _checkpoint_words(self) -> None:
        """`{checkpoint_dir}` only with a `checkpoint:` section, whose variables env must not set."""
        if self.checkpoint is None:
            for key in ("args", "resume_args"):
                if any(CHECKPOINT_DIR_WORD in a for a in getattr(self.job, key)):
                    raise ValueError(f"job.{key}: {CHECKPOINT_DIR_WORD} names the checkpoint: section's "
                                     "path; add a checkpoint: section with a path")
            return
        taken = sorted(n for n in self.env if n.upper().startswith("DDPLAUNCH_CHECKPOINT_"))
        if taken:
            raise ValueError(f"env.{taken[0]}: set from the checkpoint: section; set it there "
                             "(path, durable, keep, memory_limit) instead")

    def checkpoint_dir(self) -> Optional[str]:
        """The job's checkpoint dir on the hosts (`checkpoint.path` against workdir), or None."""
        return None if self.checkpoint is None else os.path.join(self.workdir_path, self.checkpoint.path)

    def checkpoint_durable(self) -> Optional[str]:
        """The durable dir on the hosts (`checkpoint.durable` against workdir, default the job's
        dir), or None without a `checkpoint:` section."""
        if self.checkpoint is None:
            return None
        return os.path.join(self.workdir_path, self.checkpoint.durable or self.checkpoint.path)

    def nproc_of(self, host: HostSpec) -> Union[int, str]:
        """The processes on `host`: its own `nproc`, else `nproc_per_node`."""
        return host.nproc if host.nproc is not None else self.nproc_per_node

    def resolve(self, path: str) -> Path:
        """A path from the spec, relative ones taken from the spec file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def synced(self, rel: str) -> bool:
        """Whether `sync:` puts a file at `rel` (relative to workdir) on every host: a file entry
        lands at workdir/NAME, the files of a directory entry at workdir/NAME/... (backends/ssh.py)."""
        target = Path(rel)
        for entry in self.sync:
            src, name = self.resolve(entry), Path(entry).name
            if src.is_file() and target == Path(name):
                return True
            if src.is_dir():
                try:
                    inside = target.relative_to(name) if name else target
                except ValueError:
                    continue
                if (src / inside).is_file():
                    return True
        return False

    @property
    def workdir_path(self) -> str:
        """The directory torchrun runs in on every host (default: the spec file's directory)."""
        return str(self.resolve(self.workdir or ".").resolve())

    def secret_names(self) -> frozenset[str]:
        """Env names whose values are never printed: `secret: true`, `from_env`, or a secret-looking
        name (`is_secret_name`)."""
        return frozenset(k for k, v in self.env.items() if v.secret or v.from_env is not None or is_secret_name(k)
                         or v.value is not None and is_secret_value(v.value))

    def env_values(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Every `env:` value, `from_env` entries read from `environ` (the launcher's environment).

        Raises:
            SpecError: a `from_env` variable is not set in `environ` (the first, plus a count).
        """
        values, missing = {}, []
        for name, var in self.env.items():
            if var.from_env is None:
                values[name] = typing.cast(str, var.value)
            elif var.from_env in environ:
                values[name] = environ[var.from_env]
            else:
                missing.append(f"env.{name}: from_env {var.from_env} is not set in the launcher's environment; "
                               "export it before ddplaunch up")
        if missing:
            raise SpecError(summarize_problems(missing))
        return values

    def redacted(self) -> dict[str, Any]:
        """`model_dump(mode="json")` with every secret value shown as `<secret>` and `from_env`
        entries as `{from_env: NAME}`: what `validate` prints and run records store."""
        data = self.model_dump(mode="json")
        secret = self.secret_names()
        data["env"] = {k: {"from_env": v.from_env} if v.from_env is not None
                       else SECRET_SHOWN if k in secret else v.value for k, v in self.env.items()}
        return data


def summarize_problems(messages: list[str]) -> str:
    more = len(messages) - 1
    return messages[0] + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")
