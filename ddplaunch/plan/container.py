"""Every rank inside the user's image: each runtime's command in front of torchrun, as data.

`container_run(...)` is what a node's torchrun runs inside (`ContainerRun.words()` go before its
argv): docker and podman `run`, apptainer `exec`, enroot `start`, with the defaults distributed
training needs, each visible in the dry run — the host's network and IPC (unless `options` size
/dev/shm themselves), the host's GPUs and InfiniBand devices where the host has them (a test on
the host: `HostFlags`), unlimited memlock with them, the launching user's uid:gid where the
runtime does not map it, the environment passed by name (values stay in the process
environment, never on a command line), workdir, the run directory and `mounts` bound at their
own paths, and a name and labels carrying the run id (docker, podman: removed on exit, and by the
reaper with `rm -f` when a run is ended). torchrun inside gets its coordinates on its command line,
so whatever an image or a hook sets (pyxis's PyTorch hook: RANK, MASTER_ADDR) does not count.
pyxis is srun's own: `pyxis_options` are flags of the step itself (slurm/render.py).
`probe_command` wraps the pre-flight's probe so that it runs inside the image too, after checking
the image is there (or pulling it, as `pull` says). Pure.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Callable, Optional, Sequence

from ddplaunch.plan.hostwords import HomeBind, HostFlags, HostUser
from ddplaunch.plan.shellword import Raw
from ddplaunch.spec.model import ContainerSpec
from ddplaunch.spec.values import RUNTIMES, Runtime

LABEL_RUN = "ddplaunch.run"
LABEL_USER = "ddplaunch.user"
GPU_TEST = "[ -e /dev/nvidiactl ]"
IB_TEST = "[ -e /dev/infiniband ]"
CDI_TEST = "{ [ -e /etc/cdi/nvidia.yaml ] || [ -e /var/run/cdi/nvidia.yaml ]; }"
#: Options with which the user sizes IPC themselves: then no `--ipc=host`.
_IPC_OPTIONS = ("--ipc", "--shm-size")


class ImageProblem(StrEnum):
    """Why the probe could not run in the image, as the image check's answer carries it (its
    `image_problem`, beside the message): what the pre-flight's fix is decided from."""

    #: the runtime's command is not on the host
    NO_RUNTIME = "no-runtime"
    #: the image is not on the host (and could not be pulled, where the runtime pulls)
    NO_IMAGE = "no-image"


@dataclass(frozen=True)
class ContainerRun:
    """One node's container: what runs it, and what goes in."""

    runtime: Runtime
    image: str
    name: str  # docker, podman: the container's name (a Slurm step names it per node)
    run_id: str
    workdir: str
    #: `SRC:DST[:ro]` words, `HomeBind` for the run directory under the host's home
    binds: tuple[str, ...]
    env_names: tuple[str, ...]
    options: tuple[str, ...]

    def words(self) -> list[str]:
        """The runtime's command up to the image (and, for enroot, into workdir); the command
        that runs inside follows."""
        return _RENDER[self.runtime](self)


def container_run(spec: ContainerSpec, run_id: str, name: str, workdir: str, run_dir: Optional[str],
                  env_names: Sequence[str], extra_binds: Sequence[str] = ()) -> Optional[ContainerRun]:
    """The container of one node (None for pyxis: srun runs the whole step in it); `run_dir`
    (under the host's home) is bound when given."""
    if RUNTIMES[spec.runtime].in_step:
        return None
    binds = [f"{workdir}:{workdir}", *([HomeBind(run_dir)] if run_dir else []), *extra_binds, *spec.mounts]
    return ContainerRun(runtime=spec.runtime, image=spec.image, name=name, run_id=run_id, workdir=workdir,
                        binds=tuple(dict.fromkeys(binds)), env_names=tuple(sorted(env_names)),
                        options=tuple(spec.options))


def probe_container_name(run_id: str, label: str) -> str:
    """`ddp-RUN-probe-nHOST`: the pre-flight probe's container on host `label` (a stage's are
    `ddp-RUN-STAGE-nNODE`, plan/launch.py `container_name`)."""
    return f"ddp-{run_id}-probe-n{re.sub(r'[^A-Za-z0-9_.-]', '-', label)}"


def _ipc(c: ContainerRun) -> list[str]:
    return [] if any(o.startswith(_IPC_OPTIONS) for o in c.options) else ["--ipc=host"]


def _oci(c: ContainerRun) -> list[str]:
    """docker and podman: `run` with every default distributed training needs."""
    name = Raw(f"--name={c.name}") if isinstance(c.name, Raw) else f"--name={c.name}"  # a Slurm step's: per node
    out = [RUNTIMES[c.runtime].client, "run", "--rm", name, f"--label={LABEL_RUN}={c.run_id}",
           HostUser(f"--label={LABEL_USER}="), "--network=host", *_ipc(c)]
    if c.runtime is Runtime.DOCKER:
        out += ["--init", HostFlags("--gpus=all", GPU_TEST), HostUser("--user=")]
    else:  # podman maps the user itself when rootless (keep-id); CDI names the GPUs
        out += [HostFlags("--device=nvidia.com/gpu=all", CDI_TEST), HostFlags("--userns=keep-id", '[ "$(id -u)" != 0 ]')]
    out += [HostFlags("--device=/dev/infiniband --ulimit=memlock=-1:-1", IB_TEST), f"--workdir={c.workdir}"]
    for bind in c.binds:
        out += ["-v", bind]
    for var in c.env_names:
        out += ["--env", var]  # the value comes from the client's own environment
    return out + [*c.options, c.image]


def _apptainer(c: ContainerRun) -> list[str]:
    """apptainer: the host's network, IPC, user and environment are its defaults."""
    out = ["apptainer", "exec", HostFlags("--nv", GPU_TEST), "--pwd", c.workdir]
    for bind in c.binds:
        out += ["--bind", bind]
    return out + [*c.options, c.image]


def _enroot(c: ContainerRun) -> list[str]:
    """enroot: the host's network and IPC; GPUs through its hooks; cd into workdir inside."""
    out = ["enroot", "start"]
    for bind in c.binds:
        out += ["--mount", bind]
    for var in c.env_names:
        out += ["--env", var]
    return out + [*c.options, c.image, "sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", c.workdir]


#: Each per-node runtime's command (pyxis has none: srun's own flags, `pyxis_options`).
_RENDER: dict[Runtime, Callable[[ContainerRun], list[str]]] = {
    Runtime.DOCKER: _oci, Runtime.PODMAN: _oci, Runtime.APPTAINER: _apptainer, Runtime.ENROOT: _enroot}


def pyxis_options(spec: ContainerSpec, workdir: str, extra_binds: Sequence[str] = ()) -> list[str]:
    """srun's own container flags (pyxis): the step runs inside the image, home mounted (the run
    directory is there), workdir and `mounts` bound."""
    mounts = ",".join(dict.fromkeys([f"{workdir}:{workdir}", *extra_binds, *spec.mounts]))
    return [f"--container-image={spec.image}", f"--container-mounts={mounts}", f"--container-workdir={workdir}",
            "--container-mount-home"]


def probe_words(spec: ContainerSpec, run_id: str, label: str, workdir: str) -> list[str]:
    """The runtime's command for the pre-flight's probe of host `label`: in the image, seeing the
    host's processes (other runs' leftovers are the host's) and network; workdir bound (the run
    directory does not exist yet)."""
    run = container_run(spec, run_id, probe_container_name(run_id, label), workdir, None, ())
    if run is None:
        return []
    pid_host = ("--pid=host",) if RUNTIMES[run.runtime].named else ()
    return replace(run, options=pid_host + run.options).words()


def image_check(spec: ContainerSpec, nonce: str, workdir: str) -> str:
    """A shell line that makes sure workdir (bound into the container) exists and the image is on
    the host as `pull` says, or prints the probe's answer naming what is missing (and ends the
    probe there)."""
    image = shlex.quote(spec.image)

    def fail(answer_data: dict[str, str]) -> str:
        answer = shlex.quote(json.dumps(answer_data))
        return f"{{ printf 'DDPLAUNCH_ANSWER_{nonce} %s\\n' {answer}; exit 0; }}"

    def missing(why: str, problem: ImageProblem) -> str:
        return fail({"image_error": why, "image_problem": problem.value})
    traits = RUNTIMES[spec.runtime]
    client = traits.client
    no_workdir = fail({"workdir_error": f"workdir {workdir} missing"})
    no_client = missing(f"{client} not found on the host", ImageProblem.NO_RUNTIME)
    present = (f"[ -d {shlex.quote(workdir)} ] || {no_workdir}; "
               f"command -v {client} >/dev/null 2>&1 || {no_client}")
    if traits.named:
        have = f"{client} image inspect {image} >/dev/null 2>&1"
        pull = f"{client} pull -q {image} >/dev/null 2>&1"
        absent = missing(f"image {spec.image} is not on the host" + (" and could not be pulled" if spec.pull != "never"
                                                                       else " (container.pull: never)"),
                         ImageProblem.NO_IMAGE)
        check = {"never": f"{have} || {absent}", "missing": f"{have} || {pull} || {absent}",
                 "always": f"{pull} || {absent}"}[spec.pull]
        return f"{present}; {check}"
    if traits.local_image and not spec.image.startswith(("docker://", "oras://", "library://")):
        listed = f" || enroot list 2>/dev/null | grep -qxF {image}" if spec.runtime is Runtime.ENROOT else ""
        absent = missing(f"image {spec.image} is not on the host", ImageProblem.NO_IMAGE)
        return f"{present}; [ -e {image} ]{listed} || {absent}"
    return present
