"""Helpers for integration tests on the sim cluster: specs, running ddplaunch, finding a run's
processes by its environment tag (all sim hosts share this machine's PID namespace)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import yaml

from ddplaunch.hostside import procs
from tests.torchrun_util import poll, wait_for  # noqa: F401  (re-exported for the sim tests)

ROOT = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from ddplaunch.record.view import RunView


def ranks_showing(out: str, text: str) -> int:
    """How many ranks printed `text` on the console: a line folded as `[xN ranks: ...] text` counts N
    (folding depends on timing, so a test must not count lines)."""
    total = 0
    for line in out.splitlines():
        if text in line:
            folded = re.match(r"^\[x(\d+) ranks: ", line)
            total += int(folded.group(1)) if folded else 1
    return total


def sim_spec(cluster, tmp_path: Path, n_hosts: int = 3, **overrides: Any) -> Path:
    """The sim's cluster spec with the first n_hosts and top-level keys replaced."""
    data = yaml.safe_load(cluster.spec_path.read_text())
    data["hosts"] = data["hosts"][:n_hosts]
    data.update(overrides)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def launcher_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state"), PYTHONUNBUFFERED="1")


class Started:
    """What the running test started: launchers and run ids (conftest ends them afterwards)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.launchers: list[subprocess.Popen] = []
        self.run_ids: list[str] = []
        #: run directories of the runs started (their records name their supervisors)
        self.run_dirs: list[Path] = []

    def note(self, args: list[str], tmp_path: Optional[Path] = None) -> None:
        if "--run-id" in args and args.index("--run-id") + 1 < len(args):
            run_id = args[args.index("--run-id") + 1]
            self.run_ids.append(run_id)
            if tmp_path is not None:
                self.run_dirs.append(tmp_path / "state" / "runs" / run_id)

    def end_supervisors(self) -> None:
        """SIGKILL the supervisor of every run the test started that still has one (a test that
        failed while its run went on): by the pid and start time its record names."""
        from ddplaunch.record.runs import process_start_time

        for path in self.run_dirs:
            try:
                record = json.loads((path / "record.json").read_text())
            except (OSError, ValueError):
                continue
            placement = record.get("placement") or {}
            pid, start = placement.get("pid"), placement.get("start")
            if isinstance(pid, int) and pid != os.getpid() and start is not None \
                    and process_start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


started = Started()


def ddplaunch(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    started.note(args, tmp_path)
    return subprocess.run([sys.executable, "-m", "ddplaunch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=launcher_env(tmp_path))


#: `ddplaunch.submit(spec, run_id)`, then the `Run` handle's view of it to its end, as one JSON line.
SUBMIT_AND_WAIT = """
import json, sys, ddplaunch
run = ddplaunch.submit(sys.argv[1], run_id=sys.argv[2])
first = run.state
code = run.wait(timeout=float(sys.argv[3]))
events = run.events()
from ddplaunch.record.view import RunView
from ddplaunch.report.summary import summarize
print(json.dumps({"first": first, "exit": code, "state": run.state, "kinds": [e.KIND for e in events],
                  "shown": [e.text for e in events if e.KIND == "shown"], "summary": summarize(RunView.of(events))}))
"""


def submit_and_wait(spec: Path, run_id: str, tmp_path: Path, timeout: float = 240) -> dict:
    """The Python API (`submit`, `Run.state/wait/events`) in a new interpreter, with the tests'
    launcher environment: what the handle said (first state, exit code, final state, the events'
    kinds, the lines shown and the summary)."""
    started.note(["--run-id", run_id], tmp_path)
    out = subprocess.run([sys.executable, "-c", SUBMIT_AND_WAIT, str(spec), run_id, str(timeout)],
                         capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT, env=launcher_env(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _as_from_a_terminal() -> None:
    """SIGHUP at its default in the child, as a terminal starts it: the test runner may itself run
    under `nohup` (SIGHUP ignored, which every child would inherit)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def popen_ddplaunch(args: list[str], tmp_path: Path) -> subprocess.Popen:
    started.note(args, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=launcher_env(tmp_path),
                            preexec_fn=_as_from_a_terminal)
    started.launchers.append(proc)
    return proc


def supervisor_pid(tmp_path: Path, run_id: str) -> int:
    """The pid of the run's supervisor (the process that holds its connections), from its record."""
    return json.loads((tmp_path / "state" / "runs" / run_id / "record.json").read_text())["placement"]["pid"]


def run_view(tmp_path: Path, run_id: str) -> "RunView":
    """What the run's event log says, folded as ddplaunch folds it (the run's one memory)."""
    from ddplaunch.record.events import read_events
    from ddplaunch.record.view import RunView

    return RunView.of(read_events(tmp_path / "state" / "runs" / run_id))


def kill_run(run_id: str) -> None:
    """Leftovers of a test's run: SIGKILL its tagged processes, cancel Slurm jobs named after it."""
    for pid in run_processes(run_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        from ddplaunch.sim.testing import _live
    except ImportError:
        return
    for cluster, _ in list(_live.values()):
        if cluster.slurm is None:
            continue
        out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=30,
                             env=cluster.slurm.env())
        for line in out.stdout.splitlines():
            job, _, name = line.partition(" ")
            if name.strip() == run_id:
                subprocess.run(["scancel", job], capture_output=True, timeout=30, env=cluster.slurm.env())


def run_processes(run_id: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every live process tagged with this run id, on every sim host: the
    hosts' one definition of a run's processes (hostside/procs.py), in every network namespace."""
    return {pid: {k.decode(errors="replace"): v.decode(errors="replace") for k, v in env.items()}
            for pid, env in procs.run_processes(run_id, any_netns=True).items()}


def run_pythons(run_id: str) -> set[int]:
    """The run's Python processes (torchrun and its workers), without the shells around them
    (each node's heartbeat loop and its `sleep`) and each node's agent (hostside/agent.py)."""
    out = set()
    for pid in run_processes(run_id):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"python" in Path(argv[0].decode(errors="replace")).name.encode() and \
                not any(a.endswith(b"/agent.py") for a in argv[1:3]):  # python [-S] agent.py
            out.add(pid)
    return out


def read_until(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    """Lines of proc's stdout up to and including the first one containing needle. The deadline
    holds even when the child prints nothing: at the deadline the child is interrupted (then
    killed), which ends the read."""
    import threading

    lines: list[str] = []
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if needle in line and not expired.is_set():
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"{needle!r} not seen within {timeout}s:\n" + "".join(lines[-40:]))


def write_env_files(dry_text: str, home: Path) -> None:
    """Stage what the dry run says the backend stages: the uploaded files and each node's
    environment file (path and lines)."""
    import re as _re
    import shutil

    path = None
    for line in dry_text.splitlines():
        upload = _re.match(r"# upload (\S+) -> <host run dir>/(\S+)", line)
        if upload:
            run_dir = _re.search(r'"\$HOME"/(\S+?)/(healthcheck|job)-node', dry_text).group(1)
            (home / run_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(upload.group(1), home / run_dir / upload.group(2))
        if line.startswith("# node ") and "(mode 0600) holds" in line:
            path = Path(line.split(": ", 1)[1].split(" (mode")[0].replace('"$HOME"', str(home)))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
        elif line.startswith("#   export ") and path is not None:
            with open(path, "a") as f:
                f.write(line[4:] + "\n")
