"""One launch's lines: what its nodes printed, read as data while it is shown.

Backends feed every line of a stage into its `StageLines` (`emit(node, host, line)`). It keeps
what the stage's result needs — each node's and each rank's last lines, the machine-readable
payload lines ranks print (`DDPLAUNCH_<NAME>_JSON {...}`: the health check's verdict, each
rank's start and exit), PyTorch's findings, the job's progress — the clock of the hang watchdog,
and each node's heartbeat (the watcher's sign that its host lives; never shown or logged), and
passes each line to the console: shown unless it is noise, a payload, or from a node ddplaunch
is stopping on purpose (`verbose` shows everything; the log has every line). A secret's value a
job prints is replaced by `<secret>` before the line is kept, shown or logged. `fill(result)`
hands it all to the `StageResult`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

from ddplaunch.hostside.payloads import (Durable, Held, HostFrozen, HostSteps, HostWindow, Loaded, RankExit, RankFailed,
                                         RankStart, StepsDone, Timing, read_payload)
from ddplaunch.output.console import Console
from ddplaunch.output.screen import Piece, pieces
from ddplaunch.output.torchrun import FINDING_RE, HEARTBEAT, MAX_FINDINGS, NOISE_RE, PAYLOAD_RE, RESUMED_RE, STEP_RE
from ddplaunch.output.who import OutputLine, prefix_at
from ddplaunch.plan.launch import Stage
from ddplaunch.record.diagnosis import HealthVerdict
from ddplaunch.record.results import NodeState, Progress, StageResult
from ddplaunch.spec.values import SECRET_SHOWN

TAIL_LINES = 40
#: Payloads handed to the run loop as they come (`on_report`), never kept or logged here: the
#: node agents' windows, status lines and frozen ranks (hostside/agent.py), a rank's own timing
#: line where its node has no agent, rank 0 holding after a checkpoint (entry.py's HOLD_FILE: logged).
Report = Union[Timing, Held, HostWindow, HostSteps, HostFrozen]
REPORTS = (Timing.KIND, Held.KIND, HostWindow.KIND, HostSteps.KIND, HostFrozen.KIND)
#: Shorter secret values are not masked in output: "1" or "on" would mask half of every line.
MASKED_MIN = 4
#: Numbers in a line: what changes between two redraws of one bar's own text.
DIGITS_RE = re.compile(r"\d+")


class StageLines:
    """Every line of one launch, from every node."""

    def __init__(self, console: Console, stage: Stage = Stage.JOB,
                 on_first_step: Optional[Callable[[Progress], None]] = None, secrets: Sequence[str] = (),
                 on_report: Optional[Callable[[str, Report], None]] = None):
        self.console, self.stage = console, stage
        self._on_first_step = on_first_step
        #: gets the ranks' REPORTS (host, payload): passed on, not kept here
        self._on_report = on_report
        #: Secret values to mask in every line, longest first (one inside another is masked whole).
        self._secrets = sorted({s for s in secrets if len(s) >= MASKED_MIN}, key=len, reverse=True)
        self._lock = threading.Lock()
        self._tails: dict[int, deque[OutputLine]] = {}
        self._rank_tails: dict[int, deque[OutputLine]] = {}
        self._muted: set[int] = set()
        #: Per (node, rank): the shape (digits as #) of the text last seen after a whole bar. The
        #: same shape again is the bar's own (a `bar_format` with text after its times): not apart.
        self._after_bar: dict[tuple[int, int], str] = {}
        #: Nodes whose torchrun agent began its own error report (the summary has the cause).
        self._agent_failing: set[int] = set()
        #: the ranks' payloads the result keeps, each with the node that printed it
        self._payloads: dict[str, list[tuple[int, Any]]] = {}
        #: Lines worth repeating however far they scrolled (FINDING_RE), as a screen shows them.
        self.findings: list[OutputLine] = []
        #: When the last line from any node arrived (the hang watchdog's clock), and from any rank;
        #: when each node was last heard from: all on the monotonic clock (durations, not dates).
        self.last_line_at = time.monotonic()
        self.last_rank_line_at: Optional[float] = None
        #: When each node was last heard from (any line, its heartbeat included).
        self.heard_at: dict[int, float] = {}
        self.progress: Optional[Progress] = None
        self._resumed_from: Optional[int] = None
        self._loaded: list[str] = []
        self._checkpoint: Optional[Loaded] = None  # the newest load that said its step (ddplaunch.checkpoint)
        self._start_said = False  # on_first_step called (see _start_known)
        self._loads_before_first = 0  # checkpoints loaded before the first step
        self._saving_before, self._saves_before = 0.0, 0  # seconds and saves rank 0 spent before its first step

    # ------------------------------------------------------------------ from the backends

    def emit(self, node_rank: int, host: str, line: str) -> None:
        """One line a node printed, read here, once, into typed lines (output/who.py's
        `OutputLine`: host, node, rank, body) by torchrun's `[host:rank] ` prefix of a worker's
        lines; the node's own lines (no rank) are shown and logged `[host] `. ddplaunch's own words
        in it — the shell's heartbeat, a rank's payload — are taken out wherever they stand (after
        a rank's partial line, a progress bar, they stand inside one) and never shown; what the
        ranks printed around them is (output/screen.py)."""
        line = line.rstrip("\r\n")
        mono = time.monotonic()
        if HEARTBEAT in line:  # only says the host lives: not output, not the hang watchdog's
            with self._lock:
                self.heard_at[node_rank] = mono
            line = line.replace(HEARTBEAT, "")
            if not line.strip():
                return
        for secret in self._secrets:
            line = line.replace(secret, SECRET_SHOWN)
        marker = PAYLOAD_RE.search(line)
        if marker is not None:
            before = line[:marker.start()]
            rank, head = prefix_at(before, host) or (None, 0)
            self._payload(node_rank, OutputLine(host, node_rank, rank, line[marker.start():]), marker.group(1),
                          marker.group(2), mono)
            line = before  # what the rank printed before it, without a newline
            if not line[head:].strip():
                return
        for piece in pieces(line, host) or [Piece(None, line, "", False)]:  # an empty line: logged, not shown
            self._text(node_rank, host, piece, mono)

    def _payload(self, node_rank: int, line: OutputLine, kind: str, text: str, mono: float) -> None:
        """A payload line: a report goes to `on_report`; the others are kept and logged, never shown."""
        if kind in REPORTS:
            self._report(node_rank, line.host, kind, text, mono)
            if kind == Held.KIND:  # the others come every few seconds from every host: not logged
                self.console.line(line, False)
            return
        with self._lock:
            self.last_line_at = self.heard_at[node_rank] = mono
            if kind == StepsDone.KIND:  # a step: the ranks are past their start, whatever they print
                self.last_rank_line_at = mono
            self._kept(node_rank, kind, text, time.time())
            started = self._start_known()
        self.console.line(line, False)
        self._started(started)

    def _text(self, node_rank: int, host: str, piece: Piece, mono: float) -> None:
        """A piece of what a node printed: logged as it came, shown as a screen shows it (nothing
        of padding or an empty line; a progress bar's newest redraw, and apart from it what was
        written after it)."""
        raw = OutputLine(host, node_rank, piece.rank, piece.raw)
        screen = raw.with_body(piece.shown) if piece.shown else None
        after = raw.with_body(piece.after) if piece.after else None
        started = False
        with self._lock:
            self.last_line_at = self.heard_at[node_rank] = mono
            if FINDING_RE.search(raw.body) and len(self.findings) < MAX_FINDINGS:
                self.findings.append(screen or raw)
            seen = [line for line in (screen, after) if line is not None]
            self._tails.setdefault(node_rank, deque(maxlen=TAIL_LINES)).extend(seen)
            if raw.rank is not None:
                self.last_rank_line_at = mono
                self._rank_tails.setdefault(raw.rank, deque(maxlen=TAIL_LINES)).extend(seen)
                self._progress((screen or raw).body, time.time())
            shown = screen is not None and self._shown(node_rank, screen)
            apart = after is not None and self._apart((node_rank, -1 if raw.rank is None else raw.rank), after.body)
            shown_after = after if after is not None and apart and self._shown(node_rank, after) else None
            started = self._start_known()
        if piece.bar:
            self.console.bar(raw, screen if shown else None)
        else:
            self.console.line(raw, shown, screen)
        if shown_after is not None:
            self.console.show(shown_after)
        self._started(started)

    def _apart(self, who: tuple[int, int], after: str) -> bool:
        """Whether text after a whole bar is a line of its own (a logger wrote it after the bar),
        not the bar's own ending (then every redraw ends with text of the same shape)."""
        shape = DIGITS_RE.sub("#", after)
        last, self._after_bar[who] = self._after_bar.get(who), shape
        return shape != last

    def _started(self, started: bool) -> None:
        if started and self._on_first_step is not None and self.progress is not None:
            self._on_first_step(self.progress)

    def _start_known(self) -> bool:
        """True once, when how the job started is known: its first step came after a checkpoint
        load, or with its word of resuming, or a later step came. Not at the first step alone:
        some jobs step once before they load (an FSDP2 job builds its optimizer's state for DCP to
        load into with a step), then say where they resumed."""
        progress = self.progress
        if self._start_said or progress is None:
            return False
        if not (self._loads_before_first or self._resumed_from is not None or progress.last_step > progress.first_step):
            return False
        self._start_said = True
        return True

    def _report(self, node_rank: int, host: str, kind: str, text: str, mono: float) -> None:
        """A rank's report for the run loop: the node lives (the hang watchdog's clock too: a
        rank's timing comes only while it steps, unlike word of its frozen ranks); the payload goes
        to `on_report`."""
        with self._lock:
            self.heard_at[node_rank] = mono
            if kind != HostFrozen.KIND:
                self.last_line_at = mono
        payload = read_payload(kind, text) if self._on_report is not None else None
        if isinstance(payload, (Timing, Held, HostWindow, HostSteps, HostFrozen)) and self._on_report is not None:
            self._on_report(host, payload)

    def _kept(self, node_rank: int, kind: str, text: str, now: float) -> None:
        """A payload for the result (the health check's verdict, each rank's start, exit and
        exception), or rank 0's word of its optimizer steps or a checkpoint load."""
        if kind == "HEALTHCHECK":
            payload: Any = _verdict(text)
        else:
            payload = read_payload(kind, text)
        if payload is None:
            return
        if isinstance(payload, Loaded):  # before the first step, or after it: the progress shares the list
            self._loaded.append(payload.path[:300])
            kept = self._checkpoint
            # the step it holds (ddplaunch.checkpoint's and checkpoint.watch's: also where it was read;
            # the job's own load of the same step after a put-back does not hide where that came from)
            if payload.step is not None and not (kept is not None and kept.source and not payload.source
                                                 and kept.step == payload.step):
                self._checkpoint = Loaded(payload.rank, payload.path[:300], payload.via[:100], payload.step,
                                          payload.source[:20], payload.host[:300], payload.origin[:300])
                if self.progress is not None:
                    self.progress.checkpoint = self._checkpoint
        elif isinstance(payload, Durable):
            if self.progress is not None and payload.rank == 0:
                self.progress.durable = Durable(0, payload.step, payload.after_s, payload.failed[:300])
        elif isinstance(payload, StepsDone) and payload.steps >= 1:
            if self.progress is None:  # saves before the first step are the job's start
                self._saving_before, self._saves_before = payload.saving_s, payload.saves
            self._step(now, payload.steps if self.progress is None or self.progress.optimizer_steps is not None
                       else self.progress.last_step)
            assert self.progress is not None
            self.progress.optimizer_steps = payload.steps
            self.progress.saving_s = max(0.0, payload.saving_s - self._saving_before)
            self.progress.saves = max(0, payload.saves - self._saves_before)
            self.console.progress(self.progress)
        else:
            self._payloads.setdefault(kind, []).append((node_rank, payload))

    def _step(self, now: float, step: int) -> None:
        """A completed step at `now`."""
        if self.progress is None:
            self.progress = Progress(first_at=now, first_step=step, last_at=now, last_step=step,
                                     resumed_from=self._resumed_from, loaded=self._loaded,
                                     checkpoint=self._checkpoint)
            self._loads_before_first = len(self._loaded)
        else:
            self.progress.last_at, self.progress.last_step = now, max(step, self.progress.last_step)

    def _progress(self, line: str, now: float) -> None:
        """Note the job's progress from a rank's line."""
        resumed = RESUMED_RE.search(line)
        if resumed:
            self._resumed_from = int(resumed.group(1))
            if self.progress is not None:  # said after a step (a job may step once before it loads)
                self.progress.resumed_from = self._resumed_from
        step = STEP_RE.search(line)
        if step is None or (self.progress is not None and self.progress.optimizer_steps is not None):
            return  # no step; or the optimizer's own count is the clock and the line a hint
        self._step(now, int(step.group(1)))

    def silent_for(self, node_rank: int) -> Optional[float]:
        """Seconds since the node was last heard from; None before its first heartbeat or line."""
        with self._lock:
            heard = self.heard_at.get(node_rank)
        return None if heard is None else time.monotonic() - heard

    def note(self, text: str) -> None:
        self.console.note(text)

    def log_note(self, text: str) -> None:
        """A line from ddplaunch to the run's log only (`ddplaunch logs`), not the screen."""
        self.console.log(f"[ddplaunch] {text}")

    def state(self, host: str, state: NodeState, exit_code: Optional[int] = None) -> None:
        """A host's state in this launch, for the live table and the event log."""
        self.console.state(host, self.stage, state, exit_code)

    def mute(self, node_ranks: set[int]) -> None:
        """Keep these nodes' further lines off the terminal (ddplaunch is stopping them on
        purpose: their SignalException tracebacks belong in the log, not on screen)."""
        with self._lock:
            self._muted |= node_ranks

    def _shown(self, node_rank: int, line: OutputLine) -> bool:
        if self.console.verbose:
            return True
        if node_rank in self._muted:
            return False
        text = line.body
        if line.rank is None:  # torchrun's own lines (the agent): its failure report stays in the log
            if node_rank in self._agent_failing:
                return False
            if "Traceback (most recent call last)" in text or "ChildFailedError" in text:
                self._agent_failing.add(node_rank)
                return False
        if NOISE_RE.search(text):
            return "OMP_NUM_THREADS" in text and self.console.first_time("omp-banner")
        return True

    # ------------------------------------------------------------------ for the result

    def tail(self, node_rank: int) -> list[str]:
        """The node's last lines, as a screen shows them (for its outcome: the report prints them)."""
        with self._lock:
            return [str(line) for line in self._tails.get(node_rank, ())]

    def rank_tail(self, rank: int) -> list[OutputLine]:
        """The last lines of one global rank (its own output, by torchrun's `[host:rank]` prefix)."""
        with self._lock:
            return list(self._rank_tails.get(rank, ()))

    def payloads(self, kind: str) -> list[tuple[int, Any]]:
        """Every payload of `kind` seen (its schema's type), with the node that printed it."""
        with self._lock:
            return list(self._payloads.get(kind, ()))

    def fill(self, result: StageResult) -> StageResult:
        """Hand the stage's reports to its result: the health check's verdict, the ranks' exits,
        the findings, and each node's worker restarts (the highest restart count its ranks
        started with: torchrun's TORCHELASTIC_RESTART_COUNT)."""
        self.console.flush()  # the stage's last lines come before anything said about it
        verdicts = self.payloads("HEALTHCHECK")
        result.healthcheck = verdicts[-1][1] if verdicts else None
        result.rank_exits = [p for _, p in self.payloads(RankExit.KIND)]
        result.rank_starts = [p for _, p in self.payloads(RankStart.KIND)]
        result.rank_failures = [p for _, p in self.payloads(RankFailed.KIND)]
        result.findings = [str(line) for line in self.findings]
        result.progress = self.progress
        for node, start in self.payloads(RankStart.KIND):
            if 0 <= node < len(result.outcomes):
                result.outcomes[node].restarts = max(result.outcomes[node].restarts, start.restart)
        return result


def _verdict(text: str) -> Optional[HealthVerdict]:
    """Rank 0's health-check verdict from its payload's JSON (None: not one)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return HealthVerdict.from_payload(data) if isinstance(data, dict) else None
