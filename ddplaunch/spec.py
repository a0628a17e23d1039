"""The cluster spec: validated data, nothing else.

`load_spec(path)` reads a cluster.yaml, validates it with pydantic v2 and returns a frozen
`ClusterSpec`. Every problem becomes one `SpecError` line of the form
`file:line: key.path: problem (hint)`; after loading, the rest of ddplaunch trusts the spec.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ddplaunch.errors import SpecError

SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class _Strict(BaseModel):
    """Base of every spec section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class HostSpec(_Strict):
    """One machine. A plain string in YAML is shorthand for `{addr: STRING}`."""

    addr: str = Field(min_length=1)
    name: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = Field(default=None, ge=1, le=65535)
    python: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"addr": value} if isinstance(value, str) else value

    @property
    def label(self) -> str:
        """The name shown in logs and reports (`name`, else `addr`)."""
        return self.name or self.addr


class MasterSpec(_Strict):
    """Where rank 0's TCPStore listens. Defaults: first host, a port derived from the run id."""

    addr: Optional[str] = None
    port: Optional[int] = Field(default=None, ge=1, le=65535)


class HealthcheckSpec(_Strict):
    """The all_reduce health check that runs before the job."""

    enabled: bool = True
    sizes: list[Union[int, str]] = Field(default_factory=lambda: ["4K", "64K", "1M", "8M"])
    iterations: int = Field(default=5, ge=1)
    timeout: int = Field(default=60, ge=1, description="seconds for init and each collective")
    min_busbw_gbps: Optional[float] = Field(default=None, gt=0)
    pairwise: bool = False
    pair_size: Union[int, str] = "16M"
    pair_parallelism: int = Field(default=0, ge=0)
    min_busbw_fraction: float = Field(default=0.5, gt=0, le=1)
    on_fail: Literal["stop", "exclude"] = "stop"

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
    """Host checks before anything starts (see ddplaunch/preflight.py)."""

    enabled: Optional[bool] = None
    max_clock_skew: float = Field(default=5.0, gt=0)
    min_free_disk_gb: float = Field(default=1.0, ge=0)


class JobSpec(_Strict):
    """The training script and how torchrun restarts it."""

    script: str = "jobs/toy_ddp.py"
    args: list[str] = Field(default_factory=list)
    max_restarts: int = Field(default=0, ge=0)
    hang_timeout: Optional[float] = Field(default=None, gt=0)
    debug_collectives: bool = False

    @field_validator("args", mode="before")
    @classmethod
    def _args_str(cls, args: Any) -> Any:
        return [str(a) for a in args] if isinstance(args, list) else args


class SshSpec(_Strict):
    """How to reach the hosts of `backend: ssh`."""

    user: Optional[str] = None
    key: Optional[str] = None
    port: int = Field(default=22, ge=1, le=65535)
    known_hosts: Optional[str] = None
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    connect_timeout: float = Field(default=10, gt=0)


class SlurmSpec(_Strict):
    """The allocation asked for by `backend: slurm`."""

    conf: Optional[str] = None
    output_dir: str = "slurm-logs"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: Optional[str] = None
    nodes: Optional[int] = Field(default=None, ge=1)
    gpus_per_node: Optional[int] = Field(default=None, ge=0)
    cpus_per_task: Optional[int] = Field(default=None, ge=1)
    sbatch_extra: list[str] = Field(default_factory=list)
    requeue: bool = False
    signal_seconds: int = Field(default=120, ge=1, description="with requeue: SIGUSR2 this long before the time limit")


class ClusterSpec(_Strict):
    """A whole cluster.yaml. See the annotated `cluster.yaml` at the repository root."""

    name: str = Field(default="ddp", pattern=r"^[A-Za-z0-9._-]+$")
    backend: Literal["local", "ssh", "slurm"] = "local"
    hosts: list[HostSpec] = Field(default_factory=lambda: [HostSpec(addr="localhost")])
    nproc_per_node: Union[int, Literal["auto"]] = 1
    master: MasterSpec = Field(default_factory=MasterSpec)
    python: Optional[str] = None
    workdir: Optional[str] = None
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    socket_ifname: Optional[str] = None
    rdzv_timeout: int = Field(default=60, ge=1)
    dist_timeout: int = Field(default=300, ge=1)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    healthcheck: HealthcheckSpec = Field(default_factory=HealthcheckSpec)
    job: JobSpec = Field(default_factory=JobSpec)
    ssh: SshSpec = Field(default_factory=SshSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    sync: list[str] = Field(default_factory=list)
    # Not a YAML key: the directory of the spec file, against which relative paths resolve.
    base_dir: str = Field(default=".", exclude=True)

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"must be a positive integer or 'auto', got {value!r}")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_str(cls, env: Any) -> Any:
        if isinstance(env, dict):
            return {k: (v if isinstance(v, str) else yaml.safe_dump(v).strip().removesuffix("\n..."))
                    for k, v in env.items()}
        return env

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return env

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterSpec":
        if not self.hosts:
            raise ValueError("hosts: needs at least one host")
        if self.backend == "local" and len(self.hosts) != 1:
            raise ValueError("hosts: backend 'local' runs on exactly one host; use backend 'ssh' "
                             "or 'slurm' for several")
        labels = [h.label for h in self.hosts]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"hosts: duplicate host {', '.join(dupes)}")
        return self

    def resolve(self, path: str) -> Path:
        """A path from the spec, relative ones taken from the spec file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    @property
    def workdir_path(self) -> str:
        """The directory torchrun runs in on every host (default: the spec file's directory)."""
        return str(self.resolve(self.workdir or ".").resolve())


def parse_size(size: Union[int, str]) -> int:
    """Bytes from `4096`, `'64K'`, `'1M'` or `'2G'`.

    Raises:
        ValueError: for anything else.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper().removesuffix("B").removesuffix("I")
    num, suffix = (text[:-1], text[-1]) if text[-1:] in "KMG" else (text, "")
    if not num.isdigit() or int(num) == 0:
        raise ValueError(f"size {size!r} is not a positive byte count like 4096, 64K, 1M or 1G")
    return int(num) * SIZE_SUFFIXES[suffix]


# --------------------------------------------------------------------------- loading


def load_spec(path: Union[str, Path]) -> ClusterSpec:
    """Read and validate a cluster spec file.

    Raises:
        SpecError: file missing, YAML syntax error, or invalid content; the message names
            `file:line: key.path` and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file; pass the path of a cluster spec such as cluster.yaml") from None
    except OSError as err:
        raise SpecError(f"{path}: cannot read: {err.strerror}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise SpecError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: the spec must be a mapping of keys (name:, backend:, hosts: ...)")
    data.pop("base_dir", None)
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_describe(path, root, err)) from None
    spec = spec.model_copy(update={"base_dir": str(path.resolve().parent)})
    script = Path(spec.workdir_path) / spec.job.script
    if spec.backend == "local" and not script.is_file():
        raise SpecError(f"{path}:{_line_of(root, ('job', 'script'))}: job.script: {spec.job.script!r} "
                        f"not found in workdir {spec.workdir_path}; fix the path (relative to workdir)")
    return spec


def _describe(path: Path, root: Optional[yaml.Node], err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key_path = ".".join(str(p) for p in loc) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key {loc[-1]!r}"
            hint = difflib.get_close_matches(str(loc[-1]), _fields_at(loc[:-1]), n=1)
            msg += f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(_fields_at(loc[:-1])))})"
        elif "input" in e and e["type"] not in ("missing", "value_error"):
            msg += f", got {e['input']!r}"
        if msg.startswith("hosts: "):  # model-level messages name their key themselves
            key_path, msg = "hosts", msg.removeprefix("hosts: ")
            loc = ("hosts",)
        lines.append(f"{path}:{_line_of(root, loc)}: {key_path}: {msg}")
    return "\n".join(lines)


def _fields_at(loc: tuple) -> list[str]:
    """The allowed keys of the spec section at `loc` (for "did you mean")."""
    model: Any = ClusterSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return [name for name in model.model_fields if name != "base_dir"]


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _line_of(root: Optional[yaml.Node], loc: tuple) -> int:
    """The 1-based line of the deepest YAML node along `loc` (the key itself when present)."""
    node, line = root, 1
    if node is not None:
        line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == part:
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
