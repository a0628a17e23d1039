"""Spares watched while they wait: a spare that died is named and dropped before it is needed.

A spare passes the pre-flight once, then waits, maybe for days. While the job runs, every
`EVERY_S` seconds each spare is asked to run `true` (the backend's own probe: an SSH channel, an
srun step), beside one of the job's own hosts as a control. A spare that does not answer in two
rounds in a row, while the control answers in both, is dropped: said once on screen, in the
summary, at no cost to `recovery.max_host_failures`, and a later recovery takes the next spare
without first spending a connect timeout on the dead one. A round in which the control does not
answer either counts for nothing: this machine's own network may be what failed.

Hosts the run lost are probed in the same rounds (recovery.rejoin_after): one that has answered
every round for `rejoin_after` seconds is a spare again (its bad-host entry cleared), said once; one
an operator cleared with `ddplaunch hosts clear HOST` is readmitted at its next answer. Rounds come
at least twice within `rejoin_after`. A host lost twice in the run is not taken back.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Union

from ddplaunch.backends.contract import Launcher
from ddplaunch.output.console import Console
from ddplaunch.record.events import HostBack, SpareDropped
from ddplaunch.report.summary import back_why
from ddplaunch.run.recovery import RecoveryBudget
from ddplaunch.spec.model import HostSpec

#: Seconds between two rounds of probes.
EVERY_S = 15.0
#: Seconds one round's probes may take.
PROBE_S = 10.0
#: Failed rounds in a row that drop a spare.
STRIKES = 2


class SpareWatch:
    """A background thread for the length of one job launch (a context manager)."""

    def __init__(self, backend: Launcher[Any], budget: RecoveryBudget, control: Optional[HostSpec],
                 console: Console, say: Callable[[Union[SpareDropped, HostBack]], None] = lambda event: None,
                 every: float = EVERY_S, cleared: Callable[[str], bool] = lambda label: False,
                 on_back: Callable[[str], None] = lambda label: None):
        self.backend, self.budget, self.control, self.console = backend, budget, control, console
        #: a dropped spare, a host back, is said to the run's event log through this
        self.say = say
        self.every = every
        #: whether an operator cleared a lost host's bad-host entry (`ddplaunch hosts clear`)
        self.cleared = cleared
        #: told each host back as a spare (a run that shrank grows back by it: run/loop.py)
        self.on_back = on_back
        self.strikes: dict[str, int] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()  # held while the budget's spares change, and by __exit__
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "SpareWatch":
        if (self.budget.spares or self.budget.comeback()) and self.control is not None:
            self._thread = threading.Thread(target=self._loop, name="ddplaunch-spares", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:  # no spare dropped after this: the run loop owns the budget again
            self._done.set()

    def _pace(self) -> float:
        """Seconds to the next round: twice within rejoin_after while a lost host may come back."""
        return min(self.every, max(1.0, self.budget.spec.rejoin_after / 2)) if self.budget.comeback() else self.every

    def _loop(self) -> None:
        while not self._done.wait(self._pace()):
            try:
                self.check()
            except Exception as err:  # noqa: BLE001 - watching spares is a help, never the run's failure
                self.console.note(f"spares not checked: {type(err).__name__}: {err}")

    def check(self) -> list[str]:
        """One round: probe the spares, the lost hosts that may come back and the control; the
        spares dropped by it."""
        spares, back = list(self.budget.spares), self.budget.comeback()
        if not (spares or back) or self.control is None:
            return []
        answers = {h.label: _failure(answer, err) for h, answer, err in
                   self.backend.probe(lambda h: "true", timeout=PROBE_S, hosts=[*spares, *back, self.control])}
        if answers.get(self.control.label) is not None:
            return []  # the control did not answer either: this round tells nothing of the spares
        dropped = []
        with self._lock:
            if self._done.is_set():
                return []
            for host in back:
                self._back(host.label, answers.get(host.label, "no answer"))
            for spare in spares:
                why = answers.get(spare.label, "no answer")
                self.strikes[spare.label] = self.strikes.get(spare.label, 0) + 1 if why is not None else 0
                if self.strikes[spare.label] >= STRIKES:
                    self.budget.spares = [s for s in self.budget.spares if s.label != spare.label]
                    self.budget.dropped[spare.label] = str(why)
                    self.say(SpareDropped(spare.label, str(why)))
                    dropped.append(spare.label)
                    left = len(self.budget.spares)
                    self.console.note(f"spare {spare.label} does not answer ({why}): dropped while it waited, at no "
                                      f"cost to recovery.max_host_failures ({left} spare{'s' if left != 1 else ''} "
                                      "left)")
        return dropped


    def _back(self, label: str, why: Optional[str]) -> None:
        """A lost host's answer (None) or failure this round: a spare again once it has answered
        for rejoin_after seconds, or at once after an operator cleared it."""
        if why is not None:
            self.budget.healthy_since.pop(label, None)
            return
        now = time.time()
        healthy = now - self.budget.healthy_since.setdefault(label, now)
        cleared = self.cleared(label)
        if healthy < self.budget.spec.rejoin_after and not cleared:
            return
        self.budget.readmit(label)
        event = HostBack(label, round(healthy, 1), cleared)
        self.say(event)
        self.console.note(f"{label} is back as a spare ({back_why(event)})")
        self.on_back(label)


def _failure(answer: Optional[tuple[int, str]], err: Optional[Exception]) -> Optional[str]:
    """Why a host's `true` failed (None: it answered)."""
    if err is not None:
        return str(err)
    if answer is None:
        return "no answer"
    code, out = answer
    return None if code == 0 else (out.strip().splitlines() or [f"`true` exited {code}"])[-1][:200]
