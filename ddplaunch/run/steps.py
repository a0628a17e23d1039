"""A job launch's step reports, as the node agents send them: a few lines per host, never a line
per rank per second into this process.

`StepsWatch.report` takes each host's lines as they are read: a window's part (`HostWindow`) goes
to the straggler judge, which its own thread asks once a second (a timer: a reader's thread never
judges, so the heartbeats it reads never wait for a judgement); a status
(`HostSteps`) to the live view (record/live.py: `live.json`, for `top` and `status`). What the
judge finds is said once — on screen and in the event log (`StepWindow`: the newest window
judged, a few numbers per host, every WINDOW_LOG_S; `StragglerNamed`, `RanksSilent`, `HostQuiet`) — and a straggler is handed to
`on_straggler` (the run loop evicts it where the spec allows). An agent's word of its frozen
ranks (`HostFrozen`) is logged (`RanksFrozen`) and kept, newest per host, for the hang watchdog
to name them. Ranks whose reports came as lines
(their node had no agent) are folded here as an agent folds them (hostside/fold.py). Bounded by
the run's hosts and ranks, whatever the run's length.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ddplaunch.diagnose.stragglers import WARMUP, StragglerJudge
from ddplaunch.hostside.fold import Status, StepWindows
from ddplaunch.hostside.payloads import Held, HostFrozen, HostSteps, HostWindow, Timing
from ddplaunch.output.console import Console
from ddplaunch.output.stagelines import Report
from ddplaunch.plan.launch import LaunchPlan
from ddplaunch.record.events import Event, HostQuiet, RanksFrozen, RanksSilent, StepWindow, StragglerNamed
from ddplaunch.record.incidents import Straggler
from ddplaunch.record.live import HostNow, LiveWriter

#: Seconds between two judgements of the waiting windows, and between two statuses of a host whose
#: ranks report in lines (an agent says its own every few seconds).
JUDGE_EVERY, STATUS_S = 1.0, 2.0
#: Seconds between two windows of steps in the event log (every window is judged; the log keeps
#: the newest each this often, and the one a straggler was named in: O(hosts) bytes per 30 s).
WINDOW_LOG_S = 30.0


class StepsWatch:
    """One job launch's step reports."""

    def __init__(self, plan: LaunchPlan, threshold: float, window: int, run_dir: Path, console: Console,
                 say: Callable[[Event], None], on_straggler: Callable[[Straggler], None],
                 on_held: Callable[[Held], None] = lambda held: None):
        self.console, self.say, self.on_straggler, self.on_held = console, say, on_straggler, on_held
        self._done = threading.Event()
        self._timer: Optional[threading.Thread] = None
        self.judge = StragglerJudge([n.host_label for n in plan.nodes], threshold, window)
        self.window = window
        self.live = LiveWriter(run_dir)
        self._lock = threading.Lock()
        #: per host, for ranks that report in lines (no agent): their windows and status, folded
        #: here, and when its status was last said
        self._folds: dict[str, tuple[StepWindows, Status]] = {}
        self._said: dict[str, float] = {}
        self._window_said = -WINDOW_LOG_S
        self._frozen: dict[str, HostFrozen] = {}  # host -> its agent's newest word of frozen ranks

    def __enter__(self) -> "StepsWatch":
        self._timer = threading.Thread(target=self._judge_each_second, name="ddplaunch-steps", daemon=True)
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._timer is not None:
            self._timer.join(timeout=30)
        self.tick()  # what came complete before the launch ended
        self.live.flush()

    def _judge_each_second(self) -> None:
        while not self._done.wait(JUDGE_EVERY):
            self.tick()

    def report(self, host: str, payload: Report) -> None:
        """One of a host's lines (from a reader's thread): kept for the judge, never judged here."""
        if isinstance(payload, HostWindow):
            self.judge.add(host, payload)
        elif isinstance(payload, HostSteps):
            self._status(host, payload)
        elif isinstance(payload, Timing):
            self._fold(host, payload)
        elif isinstance(payload, Held):
            self.on_held(payload)
        elif isinstance(payload, HostFrozen):
            with self._lock:
                if payload.ranks:
                    self._frozen[host] = payload
                else:
                    self._frozen.pop(host, None)
            self.say(RanksFrozen(host, {str(r): state for r, (state, _) in payload.states().items()}))

    def frozen(self) -> dict[str, HostFrozen]:
        """The hosts whose agents say some of their ranks are frozen now: label -> what they said."""
        with self._lock:
            return dict(self._frozen)

    def tick(self) -> None:
        """Judge what waits (the timer's thread; once more when the launch ended)."""
        with self._lock:
            mono = time.monotonic()
        verdicts = self.judge.judge(mono)
        if verdicts.windows and (verdicts.stragglers or mono - self._window_said >= WINDOW_LOG_S):
            newest = verdicts.windows[-1]  # every window is judged; the log keeps one each WINDOW_LOG_S
            self._window_said = mono
            self.say(StepWindow(newest.first, newest.last, newest.hosts))
        for host, ranks in verdicts.silent.items():
            self.console.note(f"{host}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped "
                              "reporting steps while the others step")
            self.say(RanksSilent(host, ranks))
        for quiet in verdicts.missing:
            self.console.note(f"{quiet.host}: no step reports for steps {quiet.first}-{quiet.last} while every "
                              "other host sent its own")
            self.say(HostQuiet(quiet.host, quiet.first, quiet.last))
        for found in verdicts.stragglers:
            self.console.note(f"straggler: {found.describe()}")
            self.say(StragglerNamed(found))
            self.on_straggler(found)

    def _status(self, host: str, payload: HostSteps) -> None:
        worst = payload.worst if len(payload.worst) == 2 else [0, 0.0]
        self.live.update(host, HostNow(payload.step, payload.step_s, payload.wait_s, payload.ranks, int(worst[0]),
                                       float(worst[1]), time.time()))

    def _fold(self, host: str, timing: Timing) -> None:
        """A rank's own line (its node has no agent): folded as the agents fold."""
        with self._lock:
            windows, status = self._folds.setdefault(host, (StepWindows(self.window, WARMUP), Status()))
            windows.add(timing.rank, timing.steps, time.monotonic())
            status.add(timing.rank, timing.steps)
            done = windows.done()
            line = None
            if time.monotonic() - self._said.get(host, 0.0) >= STATUS_S:
                self._said[host], line = time.monotonic(), status.line()
        for part in done:
            self.judge.add(host, HostWindow(**part))
        if line is not None:
            self._status(host, HostSteps(**line))
