"""A straggler swapped for a spare at the job's next checkpoint (`recovery.evict_stragglers`).

Once a host is named a straggler and a spare and the recovery budget allow it, `Eviction` asks
rank 0 to hold before its first optimizer step after a checkpoint: it creates entry.py's
HOLD_FILE in the run directory of rank 0's host. Rank 0 holds there — its checkpoint complete, no
step past it completed on every rank — and says so (`DDPLAUNCH_HELD_JSON`); the launch is then
stopped with the straggler counted lost, and the run loop's recovery puts a spare at its node rank
and relaunches from that checkpoint. Without a spare or budget the host is only named.

The same hold grows a run that shrank (`recovery.min_hosts`) back when a lost host is a spare again
(run/spares.py): the launch is stopped at the checkpoint, no host lost, and the run loop relaunches
with the spare at a new node rank.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ddplaunch.backends.contract import Launcher, StopEvent
from ddplaunch.hostside.payloads import Held
from ddplaunch.output.console import Console
from ddplaunch.plan.launch import LaunchPlan, in_run_dir
from ddplaunch.plan.shellword import word
from ddplaunch.record.incidents import Straggler

#: entry.py's HOLD_FILE (the host side cannot import this package).
HOLD_FILE = "hold-at-checkpoint"


class Eviction:
    """One job launch's eviction of a straggler, from naming to the stop at its checkpoint."""

    def __init__(self, backend: Launcher[Any], plan: LaunchPlan, stop: StopEvent, console: Console):
        self.backend, self.plan, self.stop, self.console = backend, plan, stop, console
        self.pending: Optional[Straggler] = None
        #: a host back as a spare, for a run that shrank: the launch stops at the next checkpoint
        #: and the run loop grows the world by it (`grown_at`: when rank 0 held there)
        self.growing: Optional[str] = None
        self.grown_at: Optional[float] = None

    def grow(self, host: str) -> None:
        """Ask rank 0 to hold at the next checkpoint, for the run to grow back by `host`."""
        if self.pending is not None or self.growing is not None:
            return
        self.growing = host
        self.console.note(f"growing back by {host} at the job's next checkpoint")
        threading.Thread(target=self._ask, name="ddplaunch-grow", daemon=True).start()

    def start(self, found: Straggler) -> None:
        """Ask rank 0 to hold at the next checkpoint (in a thread: this runs on a line reader)."""
        if self.pending is not None:
            return
        self.pending = found
        self.console.note(f"evicting {found.host} at the job's next checkpoint (recovery.evict_stragglers)")
        threading.Thread(target=self._ask, name="ddplaunch-evict", daemon=True).start()

    def _ask(self) -> None:
        master = self.plan.nodes[0].host
        if master is None:
            return
        flag = word(in_run_dir(self.plan.run_id, HOLD_FILE))
        for _host, answer, err in self.backend.probe(lambda h: f"touch {flag}", timeout=30, hosts=[master]):
            if err is not None or answer is None or answer[0] != 0:
                what = f"{self.pending.host} stays" if self.pending else "the world stays" if self.growing \
                    else "the straggler stays"
                self.console.note(f"could not ask rank 0 to hold at its checkpoint: {err or answer}; {what}")
                self.pending = self.growing = None

    def held(self, payload: Held) -> None:
        """Rank 0 holds after its checkpoint: stop the launch, the straggler lost."""
        found = self.pending
        if self.growing is not None and found is None:
            self.grown_at = time.time()
            self.stop.stop(f"the job held at the checkpoint after step {payload.steps}: growing back by {self.growing}")
            return
        if found is None:
            return
        step = payload.steps
        why = (f"evicted as a straggler at the checkpoint after step {step}: computed {found.slowdown:.0%} slower "
               f"than its peers since step {found.since_step}")
        self.stop.stop(f"straggler {found.host} evicted at the checkpoint after step {step}", lost={found.host: why})
