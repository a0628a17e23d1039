"""Asking every host at once: a short program per host (hostside/*.py, built by
plan/hostprogram.py with a fresh nonce), run through the backend's `probe`, each host's answer read
from its nonce-marked line — whatever the host's shell start-up printed around it. The pre-flight,
the stack dump, the link test and the kernel-log read all ask this way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ddplaunch.backends.contract import Launcher
from ddplaunch.errors import BackendError
from ddplaunch.plan.hostprogram import parse_answer
from ddplaunch.spec.model import HostSpec


@dataclass(frozen=True)
class HostAnswer:
    """One host's answer: the program's JSON (None when it printed none), its exit status and
    everything the host printed, or the error that kept it from running there."""

    host: HostSpec
    data: Optional[Any]
    code: Optional[int] = None
    output: str = ""
    error: Optional[BackendError] = None


def ask_hosts(backend: Launcher[Any], command_of: Callable[[HostSpec], tuple[str, str]],
              hosts: Optional[Sequence[HostSpec]], timeout: float) -> list[HostAnswer]:
    """Run `command_of(host)` — (shell command, the nonce its answer is marked with) — on every
    host of `hosts` (None: the backend's) at once; one answer per host."""
    nonces: dict[str, str] = {}

    def command(host: HostSpec) -> str:
        text, nonces[host.label] = command_of(host)
        return text

    answers = []
    for host, answer, err in backend.probe(command, timeout=timeout, hosts=list(hosts) if hosts is not None else None):
        if err is not None or answer is None:
            answers.append(HostAnswer(host, None, error=err))
            continue
        code, out = answer
        answers.append(HostAnswer(host, parse_answer(out, nonces.get(host.label, "")), code, out))
    return answers
