"""What the shell backends (local, ssh) share: the request they execute and the stop protocol.

A `ShellRequest` is a plan whose every node runs `bash -c LINE` on its host after the backend has
written the node's environment file (0600) there; its text is `render_plan`. Stopping a node is
explicit: SIGTERM to the recorded torchrun pid (checked to be the run's before the signal), then
the run's processes are reaped by their tag — never by name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ddplaunch.errors import PlanError
from ddplaunch.hostcmd import host_program
from ddplaunch.plan import LaunchPlan, Raw, host_run_dir, render_plan
from ddplaunch.spec import ClusterSpec, HostSpec

#: Seconds torchrun gets to stop its workers after SIGTERM before the run tag is reaped.
SHUTDOWN_GRACE = 10.0


@dataclass(frozen=True)
class ShellRequest:
    """A stage for hosts reached by a shell: per node, an env file and one `bash -c` line."""

    plan: LaunchPlan

    def text(self) -> str:
        return render_plan([self.plan])


class ShellBackend:
    """The part of the contract the shell backends fill alike: the spec's hosts as they are, no
    allocation, no scheduler; the run record holds everything `status` and `logs` show."""

    name = "shell"

    def __init__(self, spec: ClusterSpec):
        self.spec = spec

    def start_run(self, run_id: str, run_dir: Path, stop: threading.Event) -> None:
        pass

    def hosts(self, allocate: bool = True) -> list[HostSpec]:
        return list(self.spec.hosts)

    def allocation_text(self) -> str:
        return ""

    def render(self, plan: LaunchPlan) -> ShellRequest:
        return ShellRequest(plan)

    def status(self, record: dict) -> list[str]:
        return []

    def logs(self, record: dict, follow: bool) -> Optional[list[str]]:
        return None

    def render_detached(self, plans: list[LaunchPlan]) -> ShellRequest:
        raise self._no_scheduler()

    def detach(self, request: ShellRequest, run_dir: Path) -> str:
        raise self._no_scheduler()

    def _no_scheduler(self) -> PlanError:
        return PlanError(f"--detach: backend {self.name} has no scheduler to own a run; run `ddplaunch up` "
                         "under nohup, tmux or screen instead (or use backend: slurm)")

    def final_state(self, record: dict) -> Optional[str]:
        return None


def reaper_command(python: str, run_id: str, kill: bool, term_pid_files: bool = False) -> tuple[str, str]:
    """(command, nonce) of the reaper for `run_id`: optionally SIGTERM the pids in the run's pid
    files first (each checked to be the run's), then (with `kill`) end whatever of the run is left."""
    args: list[str] = [run_id]
    if kill:
        args.append("--kill")
    if term_pid_files:
        args += ["--term", Raw(f"{host_run_dir(run_id)}/node*.pid")]
    return host_program("reaper", python, *args)


def describe_reap(answer: object) -> str:
    """One line from the reaper's answer: what was ended, what is still alive."""
    if not isinstance(answer, dict):
        return "no answer from the reaper"
    before, left = answer.get("before") or [], answer.get("left") or []
    text = "nothing left" if not before else f"ended pids {' '.join(map(str, before))}"
    return text + (f"; STILL ALIVE: {' '.join(map(str, left))}" if left else "")
