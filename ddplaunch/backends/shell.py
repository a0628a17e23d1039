"""Rendering a plan for a shell on the host, and what the shell backends (local, ssh) share.

A node runs as one `bash -c` line: enter workdir, source the node's environment file (0600,
written by the backend: values, secrets too, never on a command line), run the setup lines,
record the shell's pid (which `exec` hands to torchrun) and exec the plan's argv, every word
quoted. The plan's typed words are resolved here: `HostPath` under the host's `$HOME`, `GpuCount`
by asking the host's torch (plan/shellword.py). The Slurm backend renders its step with these same
functions.
Stopping a node is explicit: SIGTERM to the recorded torchrun pid (checked to be the run's),
then the run's processes are reaped by their tag — never by name.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ddplaunch.backends.contract import HostResult
from ddplaunch.output.torchrun import HEARTBEAT
from ddplaunch.plan.hostprogram import host_program
from ddplaunch.plan.launch import LaunchPlan, NodeCommand, Stage, host_run_dir, in_run_dir
from ddplaunch.plan.shellword import Raw, word
from ddplaunch.spec.model import ClusterSpec, HostSpec
from ddplaunch.spec.values import RUNTIMES, SECRET_SHOWN, Runtime

#: While the node's shell, and the torchrun it becomes, lives: a line every second that says so
#: (backends/failfast.py counts a node silent for `recovery.detect_timeout` as a host to check). It
#: reads the process's state, without forking: a zombie (exited, not yet reaped by a parent that
#: waits for this very output to end) counts as gone.
ALIVE = 'read -r s 2>/dev/null < /proc/$$/stat && s=${s##*) } && [ "${s%% *}" != Z ]'
#: A loop's second of waiting without a fork: `read` times out on a pipe that nobody writes to
#: (opened once, read-write through /dev/fd: Linux), where `sleep 1` forked and exec'd every second
#: in each of a node's two loops (~1.3 ms of CPU a second a host: 2 CPU-s of a 32-host launch on
#: 2 cores).
OPEN_NAP = "exec {nap}<> <(:)"
NAP = "read -rt 1 -u $nap"
HEARTBEAT_LOOP = f"{{ ({OPEN_NAP}; while {ALIVE}; do echo {HEARTBEAT}; {NAP}; done) & }}"

#: The longest time between two renewals of a lease, whatever its length.
MAX_RENEWAL_S = 30.0
#: What the supervisor sends into a node's session to renew its lease: a line, any line.
RENEWAL = b"\n"


def lease_every(lease: float) -> float:
    """Seconds between two renewals of a `lease`-second lease: a quarter of it, 1 to 30 s."""
    return min(MAX_RENEWAL_S, max(1.0, lease / 4))


def lease_loop(lease: int, grace: int) -> str:
    """While the node's shell (then torchrun) lives, a silent loop (it never writes: a pty the
    supervisor no longer reads cannot block it) reads the lines the supervisor sends into the
    node's session (its stdin; torchrun's own is /dev/null). When none came for `lease` seconds
    (bash's own $SECONDS: no clock, no fork; whole seconds, so the test is "more than `lease`": at
    least `lease` real seconds, never one less), it SIGTERMs torchrun (which stops its workers
    within its shutdown timeout, job.stop_grace) and SIGKILLs it `grace` seconds later if it still
    runs. Once its input is at an end (the session closed) it waits each second on NAP. It lives
    as long as the heartbeat does (`ALIVE`). A renewal costs the host nothing but that read: no
    session, no login shell, no file."""
    return (f"{{ ({OPEN_NAP}; t=$SECONDS; while {ALIVE}; do if read -rt 1 l; then t=$SECONDS; "
            f"elif [ $? -le 128 ]; then {NAP}; fi; "
            f"if [ $((SECONDS - t)) -gt {lease} ]; then kill -TERM $$; sleep {grace}; kill -KILL $$; break; fi; "
            f"done) <&0 >/dev/null 2>&1 & }}")


def pid_file(run_id: str, node: Union[int, str]) -> str:
    """Where a node's shell records its pid (torchrun's, after `exec`); `node` may be a Raw word."""
    return word(host_run_dir(run_id)) + f"/node{node}.pid"


def env_name(stage: Stage, node: Union[int, str]) -> str:
    """The name of a node's environment file for one stage in the run directory."""
    return f"{stage.value}-node{node}.env"


def env_file(run_id: str, stage: Stage, node: Union[int, str]) -> str:
    """The node's environment file for one stage; `node` may be a Raw word."""
    return word(in_run_dir(run_id, env_name(stage, node)))


def stage_files(run_id: str, names: Sequence[str], then: Sequence[str] = ()) -> str:
    """A bash fragment that makes the run directory, runs `then`, and reads one base64 line per
    file from stdin into it (`stage_bundle`): every file 0600 from the start and renamed into place
    whole (no rank reads half a file; the environment, secrets included, never on a command line)."""
    steps = [f"mkdir -p {word(host_run_dir(run_id))}", *then]
    for name in names:
        dst = word(in_run_dir(run_id, name))
        # the temporary name is the writer's own: hosts that share the file system (a shared home)
        # stage the same files at once, and each renames a whole copy into place
        tmp = f'{dst}."$HOSTNAME".$$.tmp'
        steps.append(f'IFS= read -r b && printf %s "$b" | base64 -d > {tmp} && mv {tmp} {dst}')
    return "(umask 077 && " + " && ".join(steps) + ")"


def stage_bundle(contents: Sequence[bytes]) -> str:
    """What `stage_files` reads: one base64 line per file, in order."""
    return "".join(base64.b64encode(data).decode() + "\n" for data in contents)


def env_text(node: NodeCommand, secrets: frozenset[str] = frozenset(), mask: bool = False) -> str:
    """The node's environment file: `export K='v'` lines (secrets shown as <secret> with mask)."""
    lines = []
    for k, v in node.env:
        shown = Raw(SECRET_SHOWN) if mask and k in secrets else v
        lines.append(f"export {k}={word(shown)}")
    return "\n".join(lines) + "\n"


def shell_line(node: NodeCommand, env_source: bool = True, node_id: Union[int, str, None] = None,
               heartbeat: bool = True, lease: Optional[tuple[int, int]] = None) -> str:
    """The one command line for `bash -c` on the host; every user value is quoted. `node_id`
    names the node's files when the shell finds its number itself (a Slurm step: a Raw word);
    without `heartbeat` no line says the host lives (the local backend: this machine); with
    `lease` (seconds, grace) the node stops its ranks once its supervisor stops renewing it.

    `echo $$` records the shell's PID, which `exec` hands to torchrun; with a pty that makes
    torchrun the session leader, so a dropped connection HUPs it. The heartbeat starts once the
    environment (the run's tag) is set, before the setup lines, and ends with torchrun; the node's
    agent (hostside/agent.py: the ranks report to it) starts after the setup lines, beside torchrun.
    """
    node_id = node.node_rank if node_id is None else node_id
    parts = [f"cd {word(node.workdir)}"]
    if env_source:  # read, then removed: the environment (secrets too) stays in the process only
        env = env_file(node.run_id, node.stage, node_id)
        parts.append(f". {env} && rm -f {env}")
    parts += [HEARTBEAT_LOOP] if heartbeat else []
    parts += [lease_loop(*lease)] if lease else []
    parts += list(node.setup)
    if node.agent:  # the node's agent, beside torchrun until it ends ($$: torchrun once exec'd)
        parts.append("{ " + " ".join(word(a) for a in node.agent) + ' "$DDPLAUNCH_AGENT" $$ & }')
    parts.append(f"(umask 077 && echo $$ > {pid_file(node.run_id, node_id)})")
    # with a lease its loop alone reads the session's input: torchrun and the ranks read nothing
    parts.append("exec " + " ".join(word(a) for a in node.argv()) + (" < /dev/null" if lease else ""))
    return " && ".join(parts)


def render_plan(plans: list[LaunchPlan], heartbeat: bool = True, lease: Optional[tuple[int, int]] = None) -> str:
    """The dry-run text of shell backends: for each stage and node, the environment file the
    backend writes (secret values shown as <secret>) and the exact line it executes."""
    out = []
    for plan in plans:
        port_note = " (port derived from the run id, checked free at launch)"
        out.append(f"# run {plan.run_id} stage {plan.stage}: backend {plan.backend}, {plan.layout()}, "
                   f"master {plan.master_addr}:{plan.master_port}{port_note}")
        for src, dst in plan.uploads:
            out.append(f"# upload {src} -> <host run dir>/{dst}")
        if lease is not None:
            out.append(f"# lease: while the stage runs the supervisor sends an empty line into every node's session "
                       f"each {lease_every(lease[0]):g}s; a node that read none for {lease[0]}s stops its ranks")
        for node in plan.nodes:
            out.append(f"# node {node.node_rank} on {node.host_label}: "
                       f"{env_file(plan.run_id, plan.stage, node.node_rank)} (mode 0600) holds")
            out += [f"#   {line}" for line in env_text(node, plan.secrets, mask=True).splitlines()]
            out.append(shell_line(node, heartbeat=heartbeat, lease=lease))
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class ShellRequest:
    """A stage for hosts reached by a shell: per node, an env file and one `bash -c` line."""

    plan: LaunchPlan
    #: The nodes' shells say every second that their host lives (the watcher's sign of a lost host).
    heartbeat: bool = True
    #: (seconds, grace): each node stops its ranks when its lease has not been renewed that long.
    lease: Optional[tuple[int, int]] = None

    def text(self) -> str:
        return render_plan([self.plan], self.heartbeat, self.lease)

    def line(self, node: NodeCommand) -> str:
        return shell_line(node, heartbeat=self.heartbeat, lease=self.lease)


def runtime_of(spec: ClusterSpec) -> Optional[Runtime]:
    """The container runtime whose containers a run's teardown removes by label (a named one:
    docker, podman), if the spec's is one."""
    runtime = spec.container.runtime if spec.container is not None else None
    return runtime if runtime is not None and RUNTIMES[runtime].named else None


class ShellLauncher:
    """What the shell backends fill alike: the spec's hosts as they are (no allocation), and the
    request they execute."""

    name = "shell"
    heartbeat = True

    def __init__(self, spec: ClusterSpec):
        self.spec = spec

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        return list(self.spec.hosts)

    def spares(self) -> list[HostSpec]:
        spares = self.spec.recovery.spares
        return list(spares) if isinstance(spares, list) else []

    def allocation_text(self) -> str:
        return ""

    def reach(self, hosts: list[HostSpec], timeout: float = 30) -> list[HostResult]:
        return [HostResult(h, (0, ""), None) for h in hosts]  # this machine: always there

    def render(self, plan: LaunchPlan) -> ShellRequest:
        return ShellRequest(plan, self.heartbeat, self.lease())

    def lease(self) -> Optional[tuple[int, int]]:
        """The nodes' lease (seconds, grace), for a backend whose supervisor renews one."""
        return None


def reaper_command(python: str, run_id: str, kill: bool, term_pid_files: bool = False,
                   clean: bool = False, containers: Optional[str] = None, now: bool = False,
                   free_checkpoints: bool = False, durable: Optional[str] = None) -> tuple[str, str]:
    """(command, nonce) of the reaper for `run_id`: optionally SIGTERM the pids in the run's pid
    files first (each checked to be the run's), then (with `kill`) remove the run's `containers`
    (a runtime: docker, podman) and end whatever of the run is left (`now`: SIGKILL at once, no
    grace after a SIGTERM), then (with `clean`, once nothing of it is left) remove what could hold
    its output or its environment: torchrun's per-rank logs and environment files; with
    `free_checkpoints` (the run's end, `down`) also its checkpoints in the host's RAM, what only
    RAM holds first persisted to `durable` (the checkpoint section's durable dir)."""
    args: list[str] = [run_id]
    if kill:
        args += ["--kill", "--now"] if now else ["--kill"]
    if clean:
        args.append("--clean")
    if free_checkpoints:
        args.append("--free-checkpoints")
        if durable:
            args += ["--durable", durable]
    if containers:
        args += ["--containers", containers]
    if term_pid_files:
        args += ["--term", Raw(pid_file(run_id, "*"))]
    return host_program("reaper", python, *args)


def free_checkpoints_command(python: str, runs: Sequence[tuple[str, Optional[str]]]) -> tuple[str, list[str]]:
    """(command, a nonce per run) that frees each of `runs` (run id, its durable dir) from a host's
    RAM, one reaper after the other, each only where nothing of its run is left (no `--kill`):
    what only RAM holds is persisted to the durable dir first. The run's end frees its own; the
    next `up` of a spec frees those of its earlier runs whose supervisors died (run/ckptclean.py)."""
    commands, nonces = [], []
    for run_id, durable in runs:
        command, nonce = reaper_command(python, run_id, kill=False, free_checkpoints=True, durable=durable)
        commands.append(command)
        nonces.append(nonce)
    return "; ".join(commands), nonces


def describe_reap(answer: object) -> str:
    """One line from the reaper's answer: what was ended, what is still alive."""
    if not isinstance(answer, dict):
        return "no answer from the reaper"
    before, left = answer.get("before") or [], answer.get("left") or []
    text = "nothing left" if not before else f"ended pids {' '.join(map(str, before))}"
    gone = answer.get("containers") or []
    text += f"; removed {len(gone)} container(s)" if gone else ""
    return text + (f"; STILL ALIVE: {' '.join(map(str, left))}" if left else "")
