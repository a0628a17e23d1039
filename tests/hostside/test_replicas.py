"""Buddy copies of the checkpoint memory tier (hostside/ckpt/replicas.py) over real loopback TCP:
a sealed version of host a's arrives whole in host b's RAM; a sender without the run's key, of
another run, whose data changed while it was sent, or that dies midway leaves nothing a reader
would load; a newer copy drops the older ones; the plan's ring of buddies."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from ddplaunch.hostside.ckpt import layout, replicas, statecodec
from ddplaunch.plan.ckptplan import buddies


def _seal(ram: Path, run: str, host: str, step: int, nbytes: int = 1 << 20) -> Path:
    """A sealed RAM version of `host`'s part 0, as the tier writes it."""
    packed = statecodec.pack({"w": torch.arange(nbytes // 4, dtype=torch.float32) + step, "step": step})
    version = layout.ram_part_dir(ram, run, host, 0) / layout.version_name(step)
    for d in reversed([version, *version.parents][:5]):
        layout.private_dir(d)
    fd = os.open(version / layout.DATA, os.O_RDWR | os.O_CREAT, layout.FILE_MODE)
    try:
        statecodec.write_at(fd, packed)
    finally:
        os.close(fd)
    layout.write_private(version / layout.META, packed.meta(step, 0, 1), sync=False)
    layout.seal_ram(version, step, 0, 1)
    return version


@pytest.fixture
def pair(tmp_path):
    """Host b's receiver on a loopback port; host a's place (same run, same key)."""
    run, key = f"rep-{uuid.uuid4().hex[:8]}", b"k" * 32
    b = replicas.Place(run, "b", key, tmp_path)
    receiver = replicas.Receiver(b, 0, bind="127.0.0.1")
    threading.Thread(target=receiver.serve, daemon=True).start()
    yield replicas.Place(run, "a", key, tmp_path), b, replicas.Buddy("b", "127.0.0.1", receiver.port), receiver
    receiver.stop()


def _replica(b: replicas.Place, origin: str, step: int) -> Path:
    return layout.replica_part_dir(b.ram_root, b.run_id, b.host, origin, 0) / layout.version_name(step)


def test_a_sealed_version_arrives_whole_and_is_loadable(pair):
    a, b, buddy, _ = pair
    version = _seal(a.ram_root, a.run_id, "a", 5)
    said: list[str] = []
    sender = replicas.Sender(a, [buddy], said.append)
    sender.once()
    copy = _replica(b, "a", 5)
    manifest, meta, data = layout.read_verified(copy, 5, 0)
    assert bytes(data) == (version / layout.DATA).read_bytes() and said == []
    assert {p.name for p in copy.iterdir()} == {layout.DATA, layout.MANIFEST, layout.META}
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in copy.iterdir())
    assert statecodec.unpack(meta, data)["step"] == 5
    sender.once()  # sent already: nothing more
    assert sender.sent == {("b", 0): 5}


def test_a_newer_copy_drops_the_older_ones_from_any_origin(pair):
    a, b, buddy, _ = pair
    replicas.send(buddy, a, _seal(a.ram_root, a.run_id, "a", 3), 0, 3)
    other = replicas.Place(a.run_id, "c", a.key, a.ram_root)
    replicas.send(buddy, other, _seal(a.ram_root, a.run_id, "c", 4), 0, 4)
    assert not _replica(b, "a", 3).exists() and _replica(b, "c", 4).is_dir()
    with pytest.raises(replicas.Older):  # older than what b holds: not stored
        replicas.send(buddy, a, _seal(a.ram_root, a.run_id, "a", 2), 0, 2)
    assert not _replica(b, "a", 2).exists()
    sender = replicas.Sender(a, [buddy], pytest.fail)  # nothing to say: the buddy has newer, the copy is done
    sender.once()
    assert sender.sent == {("b", 0): 3} and not _replica(b, "a", 3).exists()


@pytest.mark.parametrize("case", ["key", "run", "torn", "midway"])
def test_what_is_not_the_runs_whole_copy_is_never_stored(pair, case):
    a, b, buddy, receiver = pair
    version = _seal(a.ram_root, a.run_id, "a", 7)
    if case == "midway":  # the sender dies after the header, the meta and a part of the data
        raw = (version / layout.MANIFEST).read_bytes()
        meta = (version / layout.META).read_bytes()
        head = json.dumps({"format": replicas.FORMAT, "run": a.run_id, "origin": "a", "part": 0, "step": 7,
                           "manifest": raw.decode()}).encode() + b"\n"
        mac = replicas._mac(a.key)
        mac.update(head)
        head_mac = mac.digest()
        mac.update(meta)
        with socket.create_connection(("127.0.0.1", buddy.port), timeout=10) as sock:
            sock.sendall(head + head_mac + meta + mac.digest())
            assert sock.makefile("rb").readline() == b"GO\n"
            sock.sendall(b"x" * 1000)
        got = None
    else:
        sender_place = a
        if case == "key":
            sender_place = replicas.Place(a.run_id, "a", b"not the key" * 3, a.ram_root)
        elif case == "run":
            sender_place = replicas.Place("someone-else", "a", a.key, a.ram_root)
        elif case == "torn":  # the tier reused the buffer after the seal: data no longer matches
            with open(version / layout.DATA, "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xfe")
        with pytest.raises(replicas.Refused) as got:
            replicas.send(buddy, sender_place, version, 0, 7)
        assert {"key": "not authenticated", "run": "someone-else", "torn": "does not match"}[case] in str(got.value)
    pdir = layout.replica_part_dir(b.ram_root, b.run_id, b.host, "a", 0)
    deadline = time.monotonic() + 30
    while any(pdir.glob(".incoming-*")) and time.monotonic() < deadline:
        time.sleep(0.05)  # the receiver's thread removes what it took, once it sees the close
    assert not _replica(b, "a", 7).exists()
    assert not list(pdir.glob(".incoming-*"))


def test_the_ring_of_buddies_spreads_the_copies():
    assert buddies(0, ["h0", "h1", "h2"], 1) == [1]
    assert [buddies(r, ["h0", "h1", "h2"], 1)[0] for r in range(3)] == [1, 2, 0]  # no two hold each other's alone
    assert buddies(2, ["h0", "h1", "h2", "h3"], 2) == [3, 0]
    assert buddies(0, ["x", "x", "y"], 1) == [2]  # another node on the same machine is no buddy
    assert buddies(0, ["x", "x"], 1) == []
    assert buddies(0, ["h0", "h1"], 3) == [1]


def test_parse_buddies_reads_what_the_plan_writes():
    assert replicas.parse_buddies("b=10.0.0.2:20001,c=[::1]:20001, bad ,d=x:") == [
        replicas.Buddy("b", "10.0.0.2", 20001), replicas.Buddy("c", "::1", 20001)]


def test_a_stranger_is_refused_before_any_size_it_claims_is_believed(pair):
    """A header without the run's key claiming 200 MiB of meta is answered at once: nothing is
    read or stored on its word."""
    a, b, buddy, _ = pair
    manifest = layout.Manifest(1, 0, 1, {layout.DATA: (1 << 30, 0), layout.META: (200 << 20, 0)}).encode()
    head = json.dumps({"format": replicas.FORMAT, "run": a.run_id, "origin": "a", "part": 0, "step": 1,
                       "manifest": manifest.decode()}).encode() + b"\n"
    with socket.create_connection(("127.0.0.1", buddy.port), timeout=10) as sock:
        sock.sendall(head + b"\0" * replicas.MAC_BYTES)
        assert sock.makefile("rb").readline().startswith(b"ERR not authenticated")
    assert not (layout.ram_base(b.ram_root) / b.run_id).exists()
