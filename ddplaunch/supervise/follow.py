"""Following a supervised run: what `up` shows in the foreground and what `attach RUN_ID` shows.

Both replay the run's event log from its first line and follow it live (record/events.py):
every line the screen showed, each host's state (a live table on a terminal), then the summary
rendered from the fold of the events — the one rendering of it for a run supervised apart from
its terminal — and return the run's exit code. A run with a snapshot (record/snapshot.py: a long
one, or one that ended) is replayed from it: the screen's first and newest lines, each host's
state, then the events after it. `top` reads the run the same way and refreshes its table
(report/top.py) each second. They differ only in what
Ctrl-C means: in `up` it stops the run (SIGTERM to the supervisor, which stops every host in
order; a second Ctrl-C leaves without waiting), in `attach` it only detaches. A closed terminal
or a killed follower never touches the run. The supervisor is where the run's placement says
(`supervisor_of`): a process on this machine, the job of a detached Slurm run (alive while the
job is queued or running), or on `supervisor.host`, where `attach` itself runs over SSH
(supervise/remote.py).
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Protocol

from rich.console import Console as RichConsole
from rich.live import Live
from rich.table import Table

from ddplaunch.backends import scheduler_of
from ddplaunch.errors import EXIT_FAILURE, EXIT_INTERRUPTED, PlanError, RunNotFoundError
from ddplaunch.output.console import make_console
from ddplaunch.plan.stages import UpOptions
from ddplaunch.record.events import (EVENTS_FILE, Event, HostState, RunEnded, RunStarted, Shown, follow, from_line,
                                     read_events)
from ddplaunch.record.live import read_live
from ddplaunch.record.runs import InJob, Local, OnHost, RunRecord
from ddplaunch.record.snapshot import LogReader
from ddplaunch.record.view import RunView
from ddplaunch.report.summary import summarize, summary_json
from ddplaunch.report.top import table
from ddplaunch.spec.model import ClusterSpec
from ddplaunch.supervise.commands import JOB_POLL, record_backend
from ddplaunch.supervise.daemon import Supervised, start_daemon
from ddplaunch.supervise.handover import hand_over


class Followed(Protocol):
    """What following a run needs of its supervisor."""

    @property
    def run_id(self) -> str: ...

    @property
    def dir(self) -> Path: ...

    def alive(self) -> bool: ...

    def signal(self, signum: int) -> bool: ...

    def where(self) -> str: ...


class Scheduled:
    """A detached run whose supervisor runs in its scheduler's job (Slurm's `up --detach`): it
    lives while the job is queued or running (the scheduler asked at most every JOB_POLL
    seconds); `down` stops it, never a signal from here. Its event log is read where the job
    writes it: the run's directory on a file system the job shares with this machine."""

    def __init__(self, record: RunRecord, running: Callable[[], bool]):
        self.run_id, self.dir, self._running = record.run_id, record.dir, running
        self._asked, self._alive = -JOB_POLL, True

    def alive(self) -> bool:
        if time.monotonic() - self._asked >= JOB_POLL:
            self._alive, self._asked = self._running(), time.monotonic()
        return self._alive

    def signal(self, signum: int) -> bool:
        return False

    def where(self) -> str:
        return "its scheduler's job"


def supervisor_of(record: RunRecord) -> Followed:
    """The supervisor a recorded run's placement names (alive or not): a process on this machine,
    or the scheduler's job of a detached Slurm run.

    Raises:
        RunNotFoundError: the run has no event log to follow here (it is supervised on another
            host, or has no log yet: `ddplaunch logs -f RUN_ID` follows its job's output).
    """
    placement = record.placement
    if isinstance(placement, InJob):
        scheduler = scheduler_of(record_backend(record))
        if scheduler is not None:
            return Scheduled(record, lambda: scheduler.job_running(record))
    if isinstance(placement, Local) and (record.dir / EVENTS_FILE).is_file():
        return Supervised.of(record.run_id, placement)
    raise RunNotFoundError(f"run {record.run_id} has no event log to follow here: `ddplaunch logs -f "
                           f"{record.run_id}` follows its log")


class _Interrupts:
    """SIGINT/SIGTERM while following: stop the run (`up`) or detach (`attach`)."""

    def __init__(self, supervised: Followed, stops_run: bool, say: Any):
        self.supervised, self.stops_run, self.say = supervised, stops_run, say
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.stops_run and self.count == 1:
            if self.supervised.signal(signal.SIGTERM):
                self.say(f"[ddplaunch] stopping run {self.supervised.run_id} (Ctrl-C again leaves it stopping "
                         "on its own)")
            return
        raise KeyboardInterrupt


def follow_run(supervised: Followed, stream: IO[str], *, stops_run: bool, err: Optional[IO[str]] = None,
               as_json: bool = False) -> int:
    """Show a supervised run from its first line to its end, then its summary (rendered from the
    fold of its events, as its supervisor rendered it); its exit code (130 when left by Ctrl-C, 1
    when the supervisor died without ending the run)."""
    err = err or sys.stderr
    out = err if as_json else stream
    console = None
    # a long run: from the fold saved beside its log (the screen's first and newest lines), then on
    reader = LogReader(supervised.dir)
    interrupts = _Interrupts(supervised, stops_run, lambda text: print(text, file=out, flush=True))
    old = _install(interrupts)
    try:
        for event in itertools.chain(reader.screen(), reader.events(supervised.alive)):
            if isinstance(event, RunStarted) and console is None:
                console = make_console(out, None, event.hosts)
                if stops_run:
                    console.note(f"Ctrl-C stops the run; closing this terminal does not "
                                 f"(ddplaunch attach {supervised.run_id})")
            elif isinstance(event, Shown) and console is not None:
                console.block(event.text)
            elif isinstance(event, HostState) and console is not None:
                console.show_state(event)
            elif isinstance(event, RunEnded):
                if console is not None:
                    console.close()
                return _ended(reader.view, event, stream, err, as_json)
    except KeyboardInterrupt:
        if console is not None:
            console.close()
        rid = supervised.run_id
        print(f"ddplaunch: left run {rid} while it stops (ddplaunch status {rid})" if stops_run else
              f"ddplaunch: detached from run {rid}, which goes on (ddplaunch attach {rid} follows it again; "
              f"ddplaunch down {rid} stops it)", file=err, flush=True)
        return EXIT_INTERRUPTED
    finally:
        _restore(old)
    if console is not None:
        console.close()
    print(f"ddplaunch: the supervisor of run {supervised.run_id} ({supervised.where()}) ended without ending "
          f"the run; `ddplaunch down {supervised.run_id}` ends what is left on its hosts", file=err, flush=True)
    return EXIT_FAILURE


def _ended(view: RunView, event: RunEnded, stream: IO[str], err: IO[str], as_json: bool) -> int:
    if event.error:
        print(f"ddplaunch: error: {event.error}", file=err, flush=True)
        return event.exit_code
    summary = summarize(view)
    if as_json:
        print(summary, file=err, flush=True)
        print(summary_json(view), file=stream, flush=True)
    else:
        print(summary, file=stream, flush=True)
    return event.exit_code


def _install(handler: _Interrupts) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(old: dict[int, Any]) -> None:
    for sig, h in old.items():
        signal.signal(sig, h)


def foreground(spec: ClusterSpec, spec_path: str, opts: UpOptions, as_json: bool = False,
               stream: Optional[IO[str]] = None) -> int:
    """`ddplaunch up` in the foreground: a supervisor takes the run, this process shows it and
    returns its exit code; Ctrl-C stops the run, anything that ends this process leaves it going.

    Raises:
        PlanError: what `launch.begin` refuses. BackendError: the supervisor did not start.
    """
    if spec.supervisor.host is not None:
        if as_json:
            raise PlanError("--json with supervisor.host: the summary is shown on the supervisor's host; "
                            "`ddplaunch status RUN_ID` there, or run without supervisor.host")
        record = hand_over(spec, spec_path, opts)
        return follow_elsewhere(record, ["attach", record.run_id], stream or sys.stdout, stops_run=True)
    supervised = start_daemon(spec, spec_path, opts)
    return follow_run(supervised, stream or sys.stdout, stops_run=True, as_json=as_json)


def attach(record: RunRecord, stream: IO[str]) -> int:
    """`ddplaunch attach RUN_ID`: follow the run to its end, wherever its supervisor runs; its
    exit code (130 when left by Ctrl-C, which leaves the run going)."""
    if isinstance(record.placement, OnHost):
        return follow_elsewhere(record, ["attach", record.run_id], stream)
    return follow_run(supervisor_of(record), stream, stops_run=False)


def follow_elsewhere(record: RunRecord, args: list[str], stream: IO[str], stops_run: bool = False) -> int:
    """Show ddplaunch's `args` (`attach`, `top`) on the host a run's supervisor runs on, over SSH;
    its exit code. Ctrl-C detaches, or with `stops_run` stops the run there."""
    from ddplaunch.supervise import remote  # Fabric: only for such a run

    host = remote.host_of(record)
    try:
        return host.stream(args, stream, stops_run, record.run_id)
    finally:
        host.close()


def run_events(record: RunRecord, live: bool = False, timeout: Optional[float] = None) -> Iterator[Event]:
    """The run's events (record/events.py), oldest first; with `live`, each new one as it comes
    until the run ends, its supervisor is gone or `timeout` seconds have passed. Of a run
    supervised on another host, what `ddplaunch events` prints there (over SSH), read back."""
    if isinstance(record.placement, OnHost):
        from ddplaunch.supervise import remote  # Fabric: only for such a run

        host = remote.host_of(record)
        try:
            lines = host.lines(["events", record.run_id, *(["--follow"] if live else []),
                                *(["--timeout", str(timeout)] if timeout is not None else [])])
            yield from (e for e in map(from_line, lines) if e is not None)
        finally:
            host.close()
        return
    if not live:
        yield from read_events(record.dir)
        return
    supervised = supervisor_of(record)
    deadline = None if timeout is None else time.monotonic() + timeout

    def going() -> bool:
        return supervised.alive() and (deadline is None or time.monotonic() < deadline)
    yield from follow(supervised.dir, going)


#: Seconds between two refreshes of `top`'s table.
REFRESH_S = 1.0
#: Columns of a table printed to a file or a pipe.
WIDE = 160


def top(run_dir: Path, alive: Callable[[], bool], stream: IO[str], once: bool = False) -> int:
    """`ddplaunch top`: the run's table (report/top.py) once, or refreshed every second until the
    run ends (a live table on a terminal, elsewhere one table per refresh; Ctrl-C leaves): the
    fold of its log, read in a thread of its own, and the hosts' live status (record/live.py)."""
    reader = LogReader(run_dir)  # a day-old run: the fold saved beside its log, then what came after
    # not a terminal (a file, a pipe): wide enough that no cell wraps
    rich = RichConsole(file=stream, highlight=False, soft_wrap=True, width=None if stream.isatty() else WIDE)
    if once:
        for _ in reader.events():
            pass
        rich.print(table(reader.view, read_live(run_dir), time.time()))
        return 0
    lock, done = threading.Lock(), threading.Event()

    def consume() -> None:
        for _ in reader.events(alive, lock):  # the view changes only while no table is drawn from it
            pass
        done.set()

    def now() -> Table:
        with lock:
            return table(reader.view, read_live(run_dir), time.time())
    threading.Thread(target=consume, name="ddplaunch-top", daemon=True).start()
    try:
        if stream.isatty():
            with Live(console=rich, refresh_per_second=2, transient=False) as live:
                while not done.wait(REFRESH_S):
                    live.update(now())
                live.update(now())
        else:
            while not done.wait(REFRESH_S):
                rich.print(now())
            rich.print(now())
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return 0
