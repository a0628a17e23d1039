"""The one error hierarchy of ddplaunch.

Every error a user can cause or meet carries a message that says what went wrong, where
(file:line and key path, host, rank) and how to fix it. The CLI maps each class to an exit
code in one place (`exit_code`), so library code never calls `sys.exit`.
"""

from __future__ import annotations

from typing import Optional

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class DdplaunchError(Exception):
    """Base class; `str(err)` is the one-line message shown to the user."""

    exit_code = EXIT_FAILURE


class SpecError(DdplaunchError):
    """The cluster spec cannot be read or is invalid (bad input, exit 2)."""

    exit_code = EXIT_BAD_INPUT


class PlanError(DdplaunchError):
    """A valid spec that cannot be turned into a launch plan (e.g. no free port), exit 2."""

    exit_code = EXIT_BAD_INPUT


class BackendError(DdplaunchError):
    """A backend could not start or follow the run (unreachable host, missing command).

    `fix`: what to do, when the backend knows better than "check the host is up" (a host key
    that is unknown or changed: the message names the file and the command). `jump`: the jump
    host whose failure this is (every host behind it fails with it), when it is one's.
    """

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, fix: str = "", jump: Optional[str] = None):
        super().__init__(message)
        self.fix, self.jump = fix, jump


class RunNotFoundError(DdplaunchError):
    """A run id that has no run record."""

    exit_code = EXIT_BAD_INPUT
