"""Local backend: runs the plan's one node on this machine with `bash -c LINE`.

The same command line as a remote host gets, in a new session, so ending the run is one
signal to its process group; leftovers (torchrun starts workers in sessions of their own) are
found by the run's tag (hostside/procs.py, imported here directly).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Optional

from ddplaunch.backends.contract import CommandFor, HostResult, RunContext, StopEvent
from ddplaunch.backends.failfast import SETTLE_SLACK, NodeEnd, follow
from ddplaunch.backends.shell import ShellLauncher, ShellRequest, describe_reap, env_text, runtime_of
from ddplaunch.errors import BackendError
from ddplaunch.hostside import reaper
from ddplaunch.hostside.procs import run_processes
from ddplaunch.output.stagelines import StageLines
from ddplaunch.plan.launch import HOST_RUN_ROOT, LaunchPlan
from ddplaunch.record.results import StageResult
from ddplaunch.record.runs import RunRecord, write_private
from ddplaunch.spec.model import ClusterSpec, HostSpec
from ddplaunch.spec.values import RUNTIMES


class LocalBackend(ShellLauncher):
    """Runs a one-node plan here."""

    name = "local"
    max_parallel = 1
    heartbeat = False  # this machine runs the launcher: it is not lost while the launcher runs

    def __init__(self, spec: ClusterSpec, run: RunContext):
        super().__init__(spec)
        #: the run whose checkpoints `close` frees from this machine's RAM: set once this backend
        #: launched a stage of a spec with a `checkpoint:` section
        self._ckpt_run: Optional[str] = None

    def port_free(self, addr: str, port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds (hostcmd.port_probe)
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    def launch(self, request: ShellRequest, lines: StageLines, stop: StopEvent) -> StageResult:
        plan = request.plan
        (node,) = plan.nodes
        if self.spec.checkpoint is not None:
            self._ckpt_run = plan.run_id
        run_dir = Path.home() / HOST_RUN_ROOT / plan.run_id
        for d in reversed([run_dir, *run_dir.parents][:len(Path(HOST_RUN_ROOT).parts) + 1]):
            d.mkdir(exist_ok=True, mode=0o700)  # ~/.ddplaunch, runs, the run: 0700 from the start
        for src, dst in plan.uploads:
            write_private(run_dir / dst, Path(src).read_text())
        (run_dir / f"node{node.node_rank}.pid").unlink(missing_ok=True)
        env_path = run_dir / f"{plan.stage}-node{node.node_rank}.env"
        env_path.unlink(missing_ok=True)
        fd = os.open(env_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start
        with os.fdopen(fd, "w") as f:
            f.write(env_text(node))
        proc = subprocess.Popen(["bash", "-c", request.line(node)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace")
        return follow(_LocalStage(plan, proc, lines, run_dir), plan, lines, stop, stop_grace=self.spec.job.stop_grace)

    def close(self) -> None:
        """The run is over: its checkpoints leave this machine's RAM, once nothing of it is left."""
        if self._ckpt_run is not None and not run_processes(self._ckpt_run):
            reaper.free_checkpoints(self._ckpt_run, durable=self.spec.checkpoint_durable())
        self._ckpt_run = None

    def probe(self, command: CommandFor, timeout: float = 30,
              hosts: Optional[list[HostSpec]] = None) -> list[HostResult]:
        results: list[HostResult] = []
        for host in self.spec.hosts if hosts is None else hosts:
            try:
                proc = subprocess.run(["bash", "-c", command(host)], capture_output=True, text=True,
                                      timeout=timeout, stdin=subprocess.DEVNULL)
                results.append(HostResult(host, (proc.returncode, proc.stdout + proc.stderr), None))
            except subprocess.TimeoutExpired:
                results.append(HostResult(host, None, BackendError(f"{host.label}: command did not finish "
                                                                   f"within {timeout}s")))
        return results

    def down(self, record: RunRecord) -> list[str]:
        run_id = record.run_id
        before = sorted(run_processes(run_id))
        reaper.term_pidfiles(run_id, [str(p) for p in (Path.home() / HOST_RUN_ROOT / run_id).glob("node*.pid")])
        containers = reaper.remove_containers(run_id, runtime_of(self.spec))
        reaper.reap(run_id)
        reaper.clean(run_id)
        left = sorted(run_processes(run_id))
        if not left:
            reaper.free_checkpoints(run_id, durable=self.spec.checkpoint_durable())
        return [f"localhost: {describe_reap({'before': before, 'left': left, 'containers': containers})}"]


class _LocalStage:
    """The one node's process, followed by backends/failfast.py."""

    def __init__(self, plan: LaunchPlan, proc: subprocess.Popen[str], lines: StageLines, run_dir: Path):
        self.plan, self.proc, self.run_dir = plan, proc, run_dir
        self.host = plan.nodes[0].host_label
        container = plan.nodes[0].container
        # the containers the stage's end removes by label (a named runtime's: docker, podman)
        self.runtime = container.runtime if container is not None and RUNTIMES[container.runtime].named else None
        self.reader = threading.Thread(target=self._pump, args=(lines,), daemon=True)
        self.reader.start()

    def _pump(self, lines: StageLines) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.emit(0, self.host, line)

    def poll(self) -> list[NodeEnd]:
        code = self.proc.poll()
        return [] if code is None else [NodeEnd(0, code)]

    def stop(self, nodes: list[int]) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # torchrun stops its workers
        except ProcessLookupError:
            pass

    def settle(self, nodes: set[int], timeout: float) -> list[NodeEnd]:
        try:
            self.proc.wait(timeout=max(1.0, timeout - SETTLE_SLACK))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        reaper.remove_containers(self.plan.run_id, self.runtime)
        reaper.reap(self.plan.run_id, grace=2.0)
        return [NodeEnd(0, self.proc.returncode)]

    def never_started(self, nodes: list[int]) -> set[int]:
        return set(nodes) - {n for n in nodes if (self.run_dir / f"node{n}.pid").exists()}

    def confirm_lost(self, node: int) -> Optional[str]:
        return None  # this machine runs the launcher: it is not lost while we ask

    def lost(self, node: int) -> None:
        pass

    def at_fault(self, node: int) -> None:
        pass

    def close(self) -> None:
        self.proc.wait()
        self.reader.join(timeout=5)
        # Workers live in sessions of their own: end any that outlived torchrun; then nothing of
        # what the job printed or its environment stays on disk (the launcher's log has every line)
        reaper.remove_containers(self.plan.run_id, self.runtime)
        reaper.reap(self.plan.run_id)
        reaper.clean(self.plan.run_id)
