"""Running one srun step and following it: labelled lines to the stage's lines, how each node ended.

srun labels each line with the task (= node) index and cuts lines into 1024-byte pieces (joined
again here). Its own messages say how each failing node ended (`srun: error: HOST: task N: Exited
with exit code C`). A stop (a failed node, Ctrl-C, a hang) is graceful: SIGTERM to the step's tasks (torchrun stops its workers), then srun is ended. srun dies
with the launcher (PR_SET_PDEATHSIG), so even a SIGKILLed ddplaunch cancels its steps.
`SrunStage` is what backends/failfast.py follows.
"""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import threading
import time
from typing import Callable, Optional

from ddplaunch.backends.failfast import LOST_STOP_GRACE, SHUTDOWN_GRACE, LossAware, NodeEnd
from ddplaunch.backends.slurm.client import SlurmClient
from ddplaunch.errors import BackendError
from ddplaunch.output.stagelines import StageLines

SRUN_PIECE = 1024
#: With a node lost, how long srun is given after the step's tasks were signalled before it is
#: killed (it waits for the lost node's tasks, which never end): the others' torchrun get this
#: long to stop their workers; the reaper ends whatever is left.
LOST_SRUN_S = 2.0
_LABEL_RE = re.compile(r"^\s*(\d+): ?(.*)$")
_LAUNCH_FAILED_RE = re.compile(r"^srun: error: Task launch for \S+ failed on node (\S+): (.*)$")
_TASK_END_RE = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (Exited with exit code (\d+)|Killed|Terminated|.*)$")


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies (srun then cancels the step)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LabelledLines:
    """srun's `--label` output as whole lines: (task index, text), or (None, text) for srun's own
    messages; a piece of exactly SRUN_PIECE bytes is held until the rest of its line arrives."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}

    def feed(self, raw: bytes) -> Optional[tuple[Optional[int], str]]:
        """One raw line (without its newline); None while a cut line is incomplete."""
        text = raw.decode("utf-8", "replace").rstrip("\r")
        label = _LABEL_RE.match(text)
        if label is None:
            return None, text
        node, rest = int(label.group(1)), label.group(2)
        joined = self._pieces.pop(node, "") + rest
        if b": " in raw and len(raw) - raw.index(b": ") - 2 == SRUN_PIECE:  # srun cut a longer line here
            self._pieces[node] = joined
            return None
        return node, joined

    def rest(self) -> list[tuple[int, str]]:
        """The pieces still held (the output ended in the middle of a line)."""
        out, self._pieces = list(self._pieces.items()), {}
        return out


class SrunStep:
    """One srun process: its lines, and how each of its nodes ended."""

    def __init__(self, client: SlurmClient, argv: list[str], env: dict[str, str], hosts: list[str],
                 lines: Optional[StageLines], name: str, job: str, stdin: Optional[str] = None,
                 task_node: Optional[dict[int, int]] = None):
        """`hosts`: the nodes in the caller's order; `task_node`: {the step's task id: index in
        `hosts`} when the step numbers them otherwise (default: the same order)."""
        self.client, self.hosts, self.lines, self.name, self.job = client, hosts, lines, name, job
        self._task_node = task_node or {}
        self.ends: dict[int, tuple[Optional[int], str, float]] = {}  # node -> (exit code, how, when)
        #: Each node's lines, kept for a step whose caller reads them (a probe: `lines` is None);
        #: a stage's lines go to `lines` only, so nothing here grows with the run's length.
        self.output: dict[int, list[str]] = {}
        #: Nodes Slurm could not start the step on: host -> srun's reason.
        self.unreachable: dict[str, str] = {}
        self.first_failure: Optional[int] = None
        self._lines = LabelledLines()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                     env=client.env(env), preexec_fn=_die_with_parent)
        if stdin is not None:
            threading.Thread(target=self._feed, args=(stdin,), daemon=True).start()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _feed(self, text: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(text.encode())
            self.proc.stdin.close()
        except OSError:
            pass

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = self._lines.feed(raw.rstrip(b"\n"))
            if line is None:
                continue
            task, text = line
            if task is None:
                self._srun_message(text)
            else:
                self._emit(self._node(task), text)
        for task, text in self._lines.rest():
            self._emit(self._node(task), text)

    def _node(self, task: int) -> int:
        return self._task_node.get(task, task)

    def _emit(self, node: int, text: str) -> None:
        if self.lines is None:
            self.output.setdefault(node, []).append(text)
        else:
            self.lines.emit(node, self.host(node), text)

    def _srun_message(self, text: str) -> None:
        launch = _LAUNCH_FAILED_RE.match(text)
        if launch:
            self.unreachable[launch.group(1)] = launch.group(2)
        m = _TASK_END_RE.match(text)
        if m:
            code = int(m.group(4)) if m.group(4) else None
            how = m.group(3)
            for node in map(self._node, _task_ids(m.group(2))):
                self.ends.setdefault(node, (code, how, time.time()))
                if code is not None and code != 0 and self.first_failure is None:
                    self.first_failure = node
        if self.lines is not None and not text.startswith("srun: error: ") and text.strip():
            self.lines.emit(-1, "srun", text)

    def host(self, node: int) -> str:
        return self.hosts[node] if 0 <= node < len(self.hosts) else f"node{node}"

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def stop(self, grace: float = SHUTDOWN_GRACE, lost: bool = False) -> None:
        """SIGTERM every task of the step (torchrun stops its workers), then end srun. With a node
        `lost`, scancel is not waited for (slurmctld answers it only once the lost node's slurmd
        has not, MessageTimeout later: ~12 s on the sim, while the others' tasks are signalled at
        once) and srun, which would wait for the lost node's tasks forever, is killed after
        `grace`: what is left on the others is ended by the run's reaper."""
        step = self.client.step_id(self.job, self.name)
        if step:
            cancel = ["scancel", "--signal=TERM", step]
            if lost:
                threading.Thread(target=self._quietly, args=(cancel,), daemon=True).start()
            else:
                self.client.run(cancel)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            if lost:
                self.proc.kill()
                return
            self.proc.terminate()  # srun cancels the step
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _quietly(self, argv: list[str]) -> None:
        try:
            self.client.run(argv)
        except BackendError:
            pass  # a lost node's step: what scancel could not end, the reaper does

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        self._reader.join(timeout=5)
        return self.proc.returncode


class SrunStage(LossAware):
    """A stage's step, for backends/failfast.py: srun's words on how each node ended, and once srun
    itself has ended, every node it said nothing of (exit 0 when srun exited 0). The backend's
    callbacks say which stopped nodes never started, why a node's host does not answer, and end
    what is left of the run on the nodes that were not lost."""

    def __init__(self, step: SrunStep, never_started: Callable[[list[int]], set[int]],
                 unanswered: Callable[[int], Optional[str]], reap: Callable[[set[int]], None],
                 stop_grace: float = SHUTDOWN_GRACE):
        super().__init__(unanswered)
        self.step, self._never_started, self._reap, self.stop_grace = step, never_started, reap, stop_grace
        self.rc: Optional[int] = None

    def poll(self) -> list[NodeEnd]:
        out = []
        done = self.step.poll() is not None
        if done:
            self.rc = self.step.wait(timeout=60)  # its reader has taken srun's last words
        for node, (code, how, when) in list(self.step.ends.items()):
            if node not in self._seen:
                self._seen.add(node)
                out.append(NodeEnd(node, code, how=how, at=when))
        if done:
            for node in range(len(self.step.hosts)):
                if node not in self._seen:
                    self._seen.add(node)
                    out.append(NodeEnd(node, 0 if self.rc == 0 else None,
                                       how=f"srun ended with {self.rc}: no exit status for this node"))
        return out

    def stop(self, nodes: list[int]) -> None:
        # a step stops as a whole: SIGTERM to every task, then srun ends; with a node lost or
        # frozen, srun would wait for that node's tasks, which never end (the reaper ends the rest)
        gone = bool(self._lost or self._at_fault)
        self.step.stop(grace=min(LOST_STOP_GRACE, LOST_SRUN_S) if gone else self.stop_grace, lost=gone)

    def settle(self, nodes: set[int], timeout: float) -> list[NodeEnd]:
        self.step.wait(timeout=timeout)
        return self.poll()

    def never_started(self, nodes: list[int]) -> set[int]:
        return self._never_started(nodes) if nodes and self.rc != 0 else set()

    def close(self) -> None:
        if self.step.poll() is None:
            self.step.proc.kill()
        self.rc = self.step.wait(timeout=60)
        if self._lost or self._at_fault:  # srun was ended before the tasks reported: leave nothing
            self._reap(self._lost)           # behind (the frozen ranks too: their host answers)


def _task_ids(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out
