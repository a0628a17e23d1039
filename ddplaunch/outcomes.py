"""From a node's exit status and its lines to its `NodeOutcome`: which rank failed, and why.

Backends call `finish_outcome` when a node's command has ended. The failing rank comes from
torchrun's "Root Cause" block; its cause from that rank's own last lines (its exception), not
from torchrun's ChildFailedError report.
"""

from __future__ import annotations

import time
from typing import Optional

from ddplaunch.console import LineSink
from ddplaunch.results import FAILED, INTERRUPTED, LOST, OK, UNREACHABLE, NodeOutcome
from ddplaunch.torchrun_logs import culprit, parse_torchrun_failures, rank_cause


def finish_outcome(outcome: NodeOutcome, sink: LineSink, exit_code: Optional[int]) -> NodeOutcome:
    """Fill an outcome from an exit code and the node's last lines."""
    outcome.ended_at = outcome.ended_at or time.time()
    outcome.tail = sink.tail(outcome.node_rank)
    outcome.exit_code = exit_code
    if outcome.state in (INTERRUPTED, LOST, UNREACHABLE):
        return outcome
    outcome.state = OK if exit_code == 0 else FAILED
    if exit_code != 0:
        found = culprit(parse_torchrun_failures(outcome.tail), sink.rank_tail)
        if found:
            outcome.failed_rank, outcome.failed_local_rank, outcome.rank_exit_code = found
            outcome.cause = rank_cause(sink.rank_tail(outcome.failed_rank))
    sink.state(outcome.host, f"{outcome.state} (exit {exit_code})")
    return outcome
