"""The specs `ddplaunch init` writes: a first, annotated cluster spec for an empty directory.

`render_init_spec` is pure (kind + hosts -> YAML text with a comment on every key that matters
for that kind); `write_init_spec` renders, validates and writes it (the command is in cli.py).
The job is the shipped example `example:toy_ddp.py`, so nothing else has to be written first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence

from ddplaunch.errors import SpecError
from ddplaunch.spec.examples import EXAMPLE_PREFIX

KINDS = ("local", "ssh", "slurm")
DEFAULT_SCRIPT = EXAMPLE_PREFIX + "toy_ddp.py"
_HOST_RE = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<addr>[^@\s:]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d{1,5}))?$")


def render_init_spec(kind: str = "local", hosts: Sequence[str] = (), *, name: Optional[str] = None,
                     nodes: Optional[int] = None, partition: Optional[str] = None,
                     time: str = "00:30:00", gpus_per_node: Optional[int] = None) -> str:
    """An annotated, valid cluster spec for a first run (pure).

    Args:
        kind: `local` (this machine, 2 Gloo processes), `ssh` (the given hosts over SSH,
            host keys checked strictly) or `slurm` (one batch job through sbatch).
        hosts: ssh: the hosts, each `addr`, `user@addr` or `user@addr:port` (at least one).
            slurm: optional, the exact nodes (`--nodelist`); none = Slurm picks `nodes` nodes.
        name: the spec name (run ids start with it); default `<kind>-demo`.
        nodes: slurm: nodes to allocate (default: len(hosts), else 2).
        partition: slurm: the partition (default: the cluster's default partition).
        time: slurm: the time limit, `HH:MM:SS`.
        gpus_per_node: slurm: GPUs per node (`--gres=gpu:N`); None = a CPU job (Gloo).

    Returns:
        The YAML text, ending in a newline; `ddplaunch.spec.load_spec` accepts it.

    Raises:
        ValueError: an unknown kind, no hosts for ssh, or a host that is not `[user@]addr[:port]`.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    name = name or f"{kind}-demo"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"name {name!r}: use letters, digits, '.', '_' and '-' only")
    if kind == "local":
        return _local(name)
    if kind == "ssh":
        if not hosts:
            raise ValueError("ssh needs at least one host (--ssh HOST, repeatable)")
        return _ssh(name, [_host_entry(h) for h in hosts])
    return _slurm(name, list(hosts), nodes, partition, time, gpus_per_node)


def _header(name: str, what: str) -> list[str]:
    return [
        f"# ddplaunch cluster spec written by `ddplaunch init` — {what}.",
        "# `ddplaunch validate THIS_FILE` shows every resolved value (unknown keys are errors);",
        "# `ddplaunch up THIS_FILE` runs the all_reduce health check, then the job, on every host.",
        "# Every key not written here keeps its default; the full annotated reference is",
        "# cluster.yaml in the ddplaunch source tree.",
        "",
        f"name: {_q(name)}{_pad(name, 'name: ')}# run ids start with it: letters, digits, . _ -",
    ]


def _job(extra: Sequence[str] = ()) -> list[str]:
    return [
        "",
        "healthcheck:                # all_reduce correctness + bandwidth on every rank, before the job",
        "  enabled: true             # false skips it (also: `ddplaunch up --skip-healthcheck`)",
        "  timeout: 60               # seconds for init_process_group and each collective",
        "",
        "job:                        # what torchrun starts on every host after the health check",
        f"  script: {DEFAULT_SCRIPT}  # a shipped example (two ranks average a gradient); for your",
        "                            # own training use a path relative to workdir, e.g. train.py,",
        "                            # or example:train.py (a real DDP run with checkpoints)",
        "  args: []                  # `ddplaunch up SPEC -- --epochs 2` replaces these",
        *extra,
    ]


def _local(name: str) -> str:
    lines = _header(name, "this machine, no cluster needed")
    lines += [
        "backend: local              # local: torchrun on this machine | ssh | slurm",
        "hosts:                      # local runs on exactly one host",
        "  - localhost",
        "nproc_per_node: 2           # processes (ranks) on this machine",
        "dist_backend: gloo          # gloo runs on CPUs; nccl needs one GPU per process",
        "rdzv_timeout: 60            # seconds torchrun waits for every rank to join",
        "workdir: null               # torchrun's working directory; null = this file's directory",
    ]
    lines += _job()
    return "\n".join(lines) + "\n"


def _ssh(name: str, hosts: list[str]) -> str:
    lines = _header(name, f"{len(hosts)} host(s) over SSH")
    lines += [
        "backend: ssh                # one torchrun per host, started over SSH",
        "hosts:                      # node rank = position in this list; rank 0's host is the master",
        *(f"  - {h}" for h in hosts),
        "nproc_per_node: auto        # workers per host: auto = the host's GPU count, else 1",
        "dist_backend: auto          # nccl with GPUs, else gloo",
        "python: null                # the interpreter on the hosts (needs torch), e.g.",
        "                            # /opt/venv/bin/python; null = this machine's path to it",
        "workdir: null               # must exist on every host; null = this file's directory",
        "                            # (the same path on each host)",
        "setup: []                   # shell lines run on each host first, e.g. `module load cuda`",
        "socket_ifname: null         # e.g. eth0 when the host names do not resolve to the",
        "                            # cluster network (sets GLOO_/NCCL_SOCKET_IFNAME)",
        "rdzv_timeout: 60            # seconds torchrun waits for every host (its default is 900)",
        "",
        "preflight:                  # before anything starts, every host: reachable, torch, versions",
        "  enabled: true             # agree, GPUs free, master address/port, clock, disk, workdir",
    ]
    lines += _job()
    lines += [
        "",
        "ssh:                        # how to reach the hosts",
        "  user: null                # default: your local user name; per host: user@addr above",
        "  key: null                 # private key file; null = ssh-agent and ~/.ssh/id_* keys",
        "  port: 22                  # per host: addr:port above",
        "  known_hosts: null         # null = ~/.ssh/known_hosts. Host keys are always verified:",
        "                            # add each host's key after checking its fingerprint, e.g.",
        "                            #   ssh-keyscan HOST >> ~/.ssh/known_hosts",
        "  host_key_policy: strict   # strict: unknown or changed keys are refused | accept-new: an",
        "                            # unknown key is appended to known_hosts (trust on first use);",
        "                            # a changed key is always refused",
        "  connect_timeout: 10       # seconds",
        "",
        "sync: []                    # files copied into every host's workdir before launch",
    ]
    return "\n".join(lines) + "\n"


def _slurm(name: str, hosts: list[str], nodes: Optional[int], partition: Optional[str], time: str,
           gpus_per_node: Optional[int]) -> str:
    if not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", time):
        raise ValueError(f"time {time!r}: use Slurm's format, e.g. 00:30:00 or 1-00:00:00")
    if nodes is not None and nodes < 1:
        raise ValueError(f"nodes {nodes}: must be at least 1")
    names = [_host_entry(h) for h in hosts]
    if names and nodes is not None and nodes != len(names):
        raise ValueError(f"nodes {nodes} but {len(names)} node name(s): give one or the other")
    nodes = len(names) or nodes or 2
    gpus = gpus_per_node is not None and gpus_per_node > 0
    lines = _header(name, f"one Slurm batch job on {nodes} node(s)")
    lines.append("backend: slurm              # sbatch: one job runs the health check step, then the job step")
    if names:
        lines += ["hosts:                      # exactly these nodes (sbatch --nodelist)",
                  *(f"  - {h}" for h in names)]
    else:
        lines += ["# hosts: [gpu01, gpu02]     # optional: exactly these nodes (sbatch --nodelist);",
                  "                            # without it Slurm picks slurm.nodes nodes"]
    lines += [
        f"nproc_per_node: {'auto' if gpus else 1}{_pad('auto' if gpus else '1', 'nproc_per_node: ')}"
        "# workers per node: auto = slurm.gpus_per_node, else a number",
        f"dist_backend: {'auto' if gpus else 'gloo'}{_pad('auto' if gpus else 'gloo', 'dist_backend: ')}"
        "# auto: nccl with GPUs, else gloo",
        "python: null                # the interpreter on the nodes (needs torch); null = this",
        "                            # machine's path to it (a shared file system)",
        "workdir: null               # on a file system every node sees; null = this file's directory",
        "setup: []                   # shell lines run on each node first, e.g. `module load cuda`",
    ]
    lines += _job()
    lines += [
        "",
        "slurm:                      # the allocation: `up --dry-run` prints the sbatch script",
        f"  partition: {_q(partition) if partition else 'null'}{_pad(partition or 'null', '  partition: ')}"
        "# null = the cluster's default partition (see `sinfo`)",
        "  account: null             # --account, if your site charges one",
        f"  time: {_q(time)}{_pad(_q(time), '  time: ')}# the time limit (HH:MM:SS or D-HH:MM:SS)",
        f"  nodes: {nodes}{_pad(str(nodes), '  nodes: ')}# nodes to allocate, one torchrun per node",
        f"  gpus_per_node: {gpus_per_node if gpus else 'null'}"
        f"{_pad(str(gpus_per_node) if gpus else 'null', '  gpus_per_node: ')}# --gres=gpu:N; null = no GPUs",
        "  cpus_per_task: null       # CPUs per node (one torchrun task per node)",
        "  output_dir: slurm-logs    # job output files, relative to workdir",
        "  sbatch_extra: []          # more #SBATCH options, e.g. [\"--exclusive\"]",
        "  requeue: false            # true: checkpoint on SIGUSR2 before the time limit, requeue, resume",
    ]
    return "\n".join(lines) + "\n"


def _host_entry(text: str) -> str:
    """A `hosts:` list item (YAML flow text) from `addr`, `user@addr` or `user@addr:port`."""
    match = _HOST_RE.match(text.strip())
    if not match:
        raise ValueError(f"host {text!r}: write it as addr, user@addr or user@addr:port")
    addr, user, port = match["addr"].strip("[]"), match["user"], match["port"]
    if port is not None and not 1 <= int(port) <= 65535:
        raise ValueError(f"host {text!r}: port {port} is not in 1..65535")
    if user is None and port is None:
        return _q(addr)
    fields = [f"addr: {_q(addr)}"] + ([f"user: {_q(user)}"] if user else []) + ([f"port: {port}"] if port else [])
    return "{" + ", ".join(fields) + "}"


def _q(value: str) -> str:
    """A plain YAML scalar when that reads back as the same string, else a JSON-quoted one."""
    import yaml

    if value and all(c.isalnum() or c in "/._-+" for c in value) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def _pad(value: str, prefix: str, column: int = 28) -> str:
    """Spaces that start the comment at `column` (at least one)."""
    return " " * max(1, column - len(prefix) - len(value))


# --------------------------------------------------------------------------- writing it


def write_init_spec(out: str, force: bool, ssh_hosts: Sequence[str] = (), slurm: bool = False,
                    nodes: Optional[int] = None, partition: Optional[str] = None, time_limit: Optional[str] = None,
                    gpus_per_node: Optional[int] = None) -> str:
    """Render, validate and write the spec `ddplaunch init` writes; the line that says so.

    Raises:
        SpecError: contradictory options, a bad host, OUT exists without `force`, or cannot be written.
    """
    if ssh_hosts and slurm:
        raise SpecError("--ssh and --slurm cannot be combined; pick one backend")
    if (nodes or partition or time_limit or gpus_per_node is not None) and not slurm:
        raise SpecError("--nodes, --partition, --time and --gpus-per-node are Slurm options; add --slurm")
    kind = "slurm" if slurm else "ssh" if ssh_hosts else "local"
    try:
        text = render_init_spec(kind, list(ssh_hosts), nodes=nodes, partition=partition,
                                time=time_limit or "00:30:00", gpus_per_node=gpus_per_node)
    except ValueError as err:
        raise SpecError(str(err)) from None
    _check_valid(text)
    try:
        # "x" creates the file only if it does not exist: no window between a check and the write.
        with open(Path(out), "w" if force else "x", encoding="utf-8") as fh:
            fh.write(text)
    except FileExistsError:
        raise SpecError(f"{out} exists; pass --force to overwrite it (or --out OTHER.yaml)") from None
    except OSError as err:
        raise SpecError(f"{out}: cannot write: {err.strerror or err}") from None
    what = {"local": "this machine, 2 processes", "ssh": f"{len(ssh_hosts)} host(s) over SSH",
            "slurm": "a Slurm batch job"}[kind]
    return f"wrote {out} ({what}); next: ddplaunch validate {out} && ddplaunch up {out}"


def _check_valid(text: str) -> None:
    """Refuse to write a spec that the loader would reject (a bug here, or a bad host)."""
    import yaml
    from pydantic import ValidationError

    from ddplaunch.spec.model import ClusterSpec

    try:
        ClusterSpec.model_validate(yaml.safe_load(text))
    except ValidationError as err:
        raise SpecError("the rendered spec is invalid: " + "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())) from None
