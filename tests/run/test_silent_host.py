"""Whose fault a silent host is, over SSH (SshBackend._unanswered): this machine's probe of the
host's sshd and, at once, up to two peers' of the run. Lost only when this machine gets no answer
and a peer that answers cannot reach the host either; no peer answering is this machine's own
network (`local`: the watcher suspects itself); a route no peer can try keeps the old rule.
The probes themselves are real TCP connections in tests/run/test_recovery.py; here they are scripted."""

from __future__ import annotations

import dataclasses
import threading

from pathlib import Path
from typing import Optional

import pytest

from ddplaunch.backends.failfast import NoAnswer
from ddplaunch.backends.ssh import SshBackend
from ddplaunch.spec.load import load_spec_data

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]


def _backend(peers: dict[str, Optional[bool]], mine: Optional[str], hosts=HOSTS,
             release: Optional[threading.Event] = None) -> SshBackend:
    spec = load_spec_data({"backend": "ssh", "hosts": hosts, "workdir": "/srv",
                           "job": {"script": "jobs/train.py"}}, base_dir=ROOT)
    backend = SshBackend(spec)
    backend.gave_up = False  # type: ignore[attr-defined]
    def my_probe(label: str) -> Optional[str]:
        if release is not None:  # a launcher far from the cluster: its probe gives up only when released
            release.wait(60)
            backend.gave_up = True  # type: ignore[attr-defined]
        return None if mine is None else NoAnswer(mine)
    backend.connector.unanswered = my_probe  # type: ignore[method-assign]
    asked: list[str] = []

    def peer_reaches(peer, target) -> Optional[bool]:
        asked.append(peer.label)
        return peers[peer.label] if backend._askable(target) else None
    backend._peer_reaches = peer_reaches  # type: ignore[method-assign]
    backend.asked = asked  # type: ignore[attr-defined]
    return backend


def test_a_host_this_machine_reaches_is_not_lost():
    backend = _backend({}, mine=None)
    assert backend._unanswered(list(backend.spec.hosts), 1) is None


def test_a_host_that_answers_neither_this_machine_nor_a_peer_is_lost():
    backend = _backend({"10.0.0.1": False, "10.0.0.3": None}, mine="10.0.0.2:22 gave no answer within 1s")
    why = backend._unanswered(list(backend.spec.hosts), 1)
    assert why == "10.0.0.2:22 answers neither this machine nor 10.0.0.1" and not getattr(why, "local", False)
    assert sorted(backend.asked) == ["10.0.0.1", "10.0.0.3"]  # two peers, never the host itself


def test_a_host_a_peer_reaches_is_this_machines_path_not_a_lost_host():
    backend = _backend({"10.0.0.1": False, "10.0.0.3": True}, mine="10.0.0.2:22 gave no answer within 1s")
    assert backend._unanswered(list(backend.spec.hosts), 1) is None


def test_no_peer_answering_either_is_this_machines_own_network():
    backend = _backend({"10.0.0.2": None, "10.0.0.3": None}, mine="10.0.0.1:22 gave no answer within 1s")
    why = backend._unanswered(list(backend.spec.hosts), 0)
    assert why is not None and getattr(why, "local", False) is True
    assert "neither could 10.0.0.2, 10.0.0.3 be asked" in why


@pytest.mark.parametrize("hosts", [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"]], ids=["alone", "peer-behind-jump"])
def test_without_a_peer_that_can_try_the_host_this_machines_probe_decides(hosts):
    """One host has no peer; a host behind a jump host cannot be tried by a peer (it has no route
    of its own to it): this machine's probe decides, as the watcher's hushed rule allows."""
    backend = _backend({h: None for h in hosts}, mine="10.0.0.1:22 gave no answer within 1s", hosts=hosts)
    if len(hosts) > 1:
        route = backend.routes["10.0.0.1"]
        backend.routes["10.0.0.1"] = dataclasses.replace(route, jump=dataclasses.replace(route, hostname="10.0.0.9"))
    why = backend._unanswered(list(backend.spec.hosts), 0)
    assert why == "10.0.0.1:22 gave no answer within 1s" and not getattr(why, "local", False)


def test_a_peer_that_cannot_reach_the_host_decides_before_this_machines_probe_gives_up():
    release = threading.Event()
    backend = _backend({"10.0.0.1": False, "10.0.0.3": None}, mine="10.0.0.2:22 gave no answer within 1s",
                       release=release)
    try:
        why = backend._unanswered(list(backend.spec.hosts), 1)
        assert backend.gave_up is False  # decided while this machine's probe still waited
    finally:
        release.set()
    assert why == "10.0.0.2:22 answers neither this machine nor 10.0.0.1"
    assert not getattr(why, "local", False)
