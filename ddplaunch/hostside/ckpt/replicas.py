"""Buddy replication of the checkpoint memory tier: every sealed RAM version of this host's saves
is copied into `replicas` other hosts' RAM, off the training loop. It runs in the node agent
(agent.py starts it when the node's environment names buddies: plan/launch.py `replica_env`).
Standard library only.

Each node runs both halves:

- a **receiver** on `DDPLAUNCH_CHECKPOINT_PORT`: a copy arrives as one TCP connection and lands in
  this host's RAM at `layout.replica_part_dir(.., this host, origin, part)/v-<step>`, through a
  `.incoming-` directory renamed into place only once the data matches the manifest (a sender that
  dies midway leaves nothing a reader loads). A newer copy of a part drops the older ones, from
  any origin: a host holds one version per part and origin.
- a **sender**: it looks at this host's own part directories every POLL_S seconds and sends the
  newest sealed version (its MANIFEST present) of each part to every buddy that lacks it
  (`DDPLAUNCH_CHECKPOINT_BUDDIES`: `label=addr:port,...`, planned as a ring over the hosts, so that
  no two hosts depend on each other alone). A version the tier overwrote while it was sent arrives
  torn and is refused; the next newest is sent.

The protocol (one version per connection): a JSON header line (run, origin, part, step, the
manifest) and its keyed BLAKE2b MAC (the run's `DDPLAUNCH_CHECKPOINT_KEY`: only the run's own hosts
are heard, before a size they send is believed or a byte stored), the `meta` file and the MAC of
header and meta; the receiver answers `GO` (or `OLD`: it
holds a newer copy of the part; or `ERR <why>`), then the data, checked against the manifest's
CRC-32; the receiver answers `OK` or `ERR <why>`. The key
authenticates the sender and everything that is unpickled (meta); the tensor bytes are checked
like the durable copy's, against accidental damage. Every wait has a timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, Optional

try:
    from ddplaunch.hostside.ckpt import layout
except ImportError:  # run from the run dir, beside layout.py (the hosts need no ddplaunch)
    import layout  # type: ignore[no-redef,import-not-found]

PORT_ENV, BUDDIES_ENV, KEY_ENV = ("DDPLAUNCH_CHECKPOINT_PORT", "DDPLAUNCH_CHECKPOINT_BUDDIES",
                                  "DDPLAUNCH_CHECKPOINT_KEY")
#: Seconds between two looks at this host's saves; a stalled peer's socket timeout.
POLL_S, IO_TIMEOUT_S, CONNECT_TIMEOUT_S = 0.5, 30.0, 10.0
#: After a failed send, seconds before that buddy is tried again.
RETRY_S = 5.0
HEADER_MAX, META_MAX, MAC_BYTES = 64 << 10, 256 << 20, 32
#: Connections served at once (each holds a thread and a socket).
MAX_CLIENTS = 8
FORMAT = 1


class Refused(Exception):
    """A copy the receiver will not keep: the reason goes back to the sender."""


class Older(Refused):
    """The receiver holds a newer copy of that part already: nothing to send."""


def _mac(key: bytes) -> "hashlib.blake2b":
    return hashlib.blake2b(key=key, digest_size=MAC_BYTES)


@dataclass(frozen=True)
class Buddy:
    label: str
    addr: str
    port: int


def parse_buddies(text: str) -> list[Buddy]:
    """`label=addr:port,...` (as plan/launch.py writes it) as Buddies; a malformed entry is skipped."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        label, _, where = item.partition("=")
        addr, _, port = where.rpartition(":")
        if label and addr and port.isdigit():
            out.append(Buddy(label, addr.strip("[]"), int(port)))
    return out


@dataclass(frozen=True)
class Place:
    """This host's side of the tier: its run, its label, the RAM root, the run's key."""

    run_id: str
    host: str
    key: bytes
    ram_root: Path = Path("/dev/shm")

    def run_dir(self) -> Path:
        return layout.ram_base(self.ram_root) / self.run_id


# -- the receiver --------------------------------------------------------------------------------


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), layout.CHUNK))
        if not chunk:
            raise Refused(f"the sender closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _read_line(sock: socket.socket, limit: int) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        if len(buf) >= limit:
            raise Refused("header too long")
        chunk = sock.recv(1)
        if not chunk:
            raise Refused("the sender closed before its header ended")
        buf += chunk
    return bytes(buf)


@dataclass(frozen=True)
class Header:
    origin: str
    part: int
    step: int
    manifest: layout.Manifest
    raw_manifest: bytes

    @classmethod
    def parse(cls, line: bytes, run_id: str) -> Header:
        try:
            doc = json.loads(line)
            if doc.get("format") != FORMAT or doc.get("run") != run_id:
                raise Refused(f"a copy of run {doc.get('run')!r}, format {doc.get('format')!r}")
            origin = layout.safe_component(str(doc["origin"]), "origin")
            raw = str(doc["manifest"]).encode()
            manifest = layout.Manifest.decode(raw)
            part, step = int(doc["part"]), int(doc["step"])
        except Refused:
            raise
        except (ValueError, KeyError, TypeError, layout.CheckpointError) as exc:
            raise Refused(f"a bad header: {exc}") from None
        if (manifest.part, manifest.step) != (part, step) or set(manifest.files) != {layout.DATA, layout.META} \
                or part < 0 or step < 0 or not 0 <= manifest.files[layout.META][0] <= META_MAX \
                or manifest.files[layout.DATA][0] < 0:
            raise Refused("a header whose manifest does not match it")
        return cls(origin, part, step, manifest, raw)


def receive(sock: socket.socket, place: Place, room: Callable[[Path], int]) -> Path:
    """One copy from `sock` into this host's RAM; returns its version directory. The sender's
    header is answered (`GO`, or why not) before it sends the data.

    Raises:
        Refused: the copy is not the run's, not authentic, torn, or does not fit (Older: a newer
            copy of the part is here already).
    """
    head, meta = _accept_header(sock, place)
    size, crc = head.manifest.files[layout.DATA]
    pdir = layout.replica_part_dir(place.ram_root, place.run_id, place.host, head.origin, head.part)
    for d in (layout.ram_base(place.ram_root), place.run_dir(), place.run_dir() / place.host,
              place.run_dir() / place.host / layout.REPLICAS, pdir.parent, pdir):
        layout.private_dir(d)
    if size + len(meta) > room(pdir):
        raise Refused(f"no room in RAM for {size + len(meta)} bytes")
    sock.sendall(b"GO\n")
    incoming = pdir / f".incoming-{head.step}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(mode=layout.DIR_MODE)
    try:
        if _receive_data(sock, incoming / layout.DATA, size) != crc:
            raise Refused(f"step {head.step}'s data does not match its manifest (changed while it was sent)")
        layout.write_private(incoming / layout.META, meta, sync=False)
        layout.write_private(incoming / layout.MANIFEST, head.raw_manifest, sync=False)
        final = pdir / layout.version_name(head.step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(incoming, final)
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    drop_older(place, head.part, head.step)
    return final


def _accept_header(sock: socket.socket, place: Place) -> tuple[Header, bytes]:
    """The header and meta, authenticated, of a copy this host wants."""
    line = _read_line(sock, HEADER_MAX)
    mac = _mac(place.key)
    mac.update(line)
    if not hmac.compare_digest(mac.digest(), _read_exact(sock, MAC_BYTES)):  # before its sizes are believed
        raise Refused("not authenticated (the run's key)")
    head = Header.parse(line, place.run_id)
    meta_size, meta_crc = head.manifest.files[layout.META]
    meta = _read_exact(sock, meta_size)
    mac.update(meta)
    if not hmac.compare_digest(mac.digest(), _read_exact(sock, MAC_BYTES)):
        raise Refused("not authenticated (the run's key)")
    if zlib.crc32(meta) != meta_crc:
        raise Refused("meta does not match its manifest")
    held = max((s for _, d in layout.replica_part_dirs(place.ram_root, place.run_id, place.host, head.part)
                for s in layout.sealed_steps(d)), default=-1)
    if held > head.step:
        raise Older(f"step {held} of part {head.part} is here already")
    return head, meta


def _receive_data(sock: socket.socket, path: Path, size: int) -> int:
    crc, left = 0, size
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, layout.FILE_MODE)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)  # a full /dev/shm says ENOSPC here, not midway
        while left:
            chunk = sock.recv(min(left, layout.CHUNK))
            if not chunk:
                raise Refused(f"the sender closed after {size - left} of {size} bytes")
            crc, left = zlib.crc32(chunk, crc), left - len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return crc


def drop_older(place: Place, part: int, step: int) -> None:
    """Every replica of `part` older than `step` goes, whichever host it came from (and what a
    receiver that died midway left)."""
    for _, pdir in layout.replica_part_dirs(place.ram_root, place.run_id, place.host, part):
        for s in layout.ram_steps(pdir):
            if s < step:
                shutil.rmtree(pdir / layout.version_name(s), ignore_errors=True)
        try:
            stale = [n for n in os.listdir(pdir) if n.startswith(".incoming-") and int(n.split("-")[1]) < step]
        except (OSError, ValueError, IndexError):
            continue
        for name in stale:
            shutil.rmtree(pdir / name, ignore_errors=True)


def free_room(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Receiver:
    """Serves copies on `port` until `stop()`; each connection in its own thread (MAX_CLIENTS)."""

    def __init__(self, place: Place, port: int, bind: str = "") -> None:
        self.place = place
        self.sock = socket.create_server((bind, port), family=socket.AF_INET, reuse_port=False)
        self.sock.settimeout(POLL_S)
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.stopping = threading.Event()
        self.received: list[Path] = []

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, InterruptedError):
                continue
            except OSError:
                return
            if not self.slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True, name="ddplaunch-replica-in").start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                self.received.append(receive(conn, self.place, free_room))
                answer = b"OK\n"
            except Older as exc:
                answer = f"OLD {exc}\n".encode()
            except Refused as exc:
                answer = f"ERR {exc}\n".encode()
            except OSError as exc:
                answer = f"ERR {exc.strerror or exc}\n".encode()
            try:
                conn.sendall(answer)
            except OSError:
                pass
        finally:
            conn.close()
            self.slots.release()

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


# -- the sender ----------------------------------------------------------------------------------


def send(buddy: Buddy, place: Place, version: Path, part: int, step: int) -> None:
    """Sends one sealed RAM version to `buddy`.

    Raises:
        Refused: the buddy refused it (the reason is its answer).
        OSError: the buddy could not be reached, or the connection broke.
    """
    raw_manifest = (version / layout.MANIFEST).read_bytes()
    manifest = layout.Manifest.decode(raw_manifest)
    meta = (version / layout.META).read_bytes()
    header = json.dumps({"format": FORMAT, "run": place.run_id, "origin": place.host, "part": part,
                         "step": step, "manifest": raw_manifest.decode()}).encode() + b"\n"
    mac = _mac(place.key)
    mac.update(header)
    header_mac = mac.digest()
    mac.update(meta)
    size = manifest.files[layout.DATA][0]
    with open(version / layout.DATA, "rb") as data, \
            socket.create_connection((buddy.addr, buddy.port), timeout=CONNECT_TIMEOUT_S) as sock:
        sock.settimeout(IO_TIMEOUT_S)
        answers = sock.makefile("rb")
        sock.sendall(header + header_mac + meta + mac.digest())
        _answered(answers, "GO")
        if os.fstat(data.fileno()).st_size < size:
            raise Refused(f"step {step} shrank in RAM before it was sent")
        if size:
            sock.sendfile(data, 0, size)
        sock.shutdown(socket.SHUT_WR)
        _answered(answers, "OK")


def _answered(answers: BinaryIO, want: str) -> None:
    answer = answers.readline(4096).decode(errors="replace").strip()
    if answer.startswith("OLD "):
        raise Older(answer.removeprefix("OLD "))
    if answer != want:
        raise Refused(answer.removeprefix("ERR ") or "no answer")


def newest_sealed(place: Place) -> dict[int, tuple[int, Path]]:
    """{part: (step, version dir)}: the newest version of each of this host's own parts that has
    its manifest."""
    out: dict[int, tuple[int, Path]] = {}
    host_dir = place.run_dir() / place.host
    try:
        names = os.listdir(host_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if not (name.startswith("part-") and name[5:].isdigit()):
            continue
        pdir = host_dir / name
        sealed = layout.sealed_steps(pdir)
        if sealed:
            out[int(name[5:])] = (sealed[0], pdir / layout.version_name(sealed[0]))
    return out


class Sender:
    """Sends each part's newest sealed version to every buddy that lacks it (see the module)."""

    def __init__(self, place: Place, buddies: list[Buddy], say: Callable[[str], None]) -> None:
        self.place, self.buddies, self.say = place, buddies, say
        self.sent: dict[tuple[str, int], int] = {}  # (buddy, part) -> newest step it has
        self.retry_at: dict[str, float] = {}
        self.said: set[str] = set()

    def once(self) -> None:
        """One look: every copy that is due, sent now."""
        for part, (step, version) in sorted(newest_sealed(self.place).items()):
            for buddy in self.buddies:
                if self.sent.get((buddy.label, part), -1) >= step or time.monotonic() < self.retry_at.get(buddy.label, 0):
                    continue
                try:
                    send(buddy, self.place, version, part, step)
                except Older:
                    pass  # the buddy has a newer copy (another host's): done
                except (Refused, OSError, ValueError, layout.CheckpointError) as exc:
                    self.retry_at[buddy.label] = time.monotonic() + RETRY_S
                    self._say_once(buddy.label, f"checkpoint: step {step} not copied to {buddy.label} "
                                                f"({buddy.addr}:{buddy.port}): {exc}; trying again")
                    continue
                self.sent[(buddy.label, part)] = step
                self.said.discard(buddy.label)

    def _say_once(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.say(text)

    def run(self, stopping: threading.Event) -> None:
        while not stopping.wait(POLL_S):
            self.once()


def start(env: Mapping[str, str], say: Callable[[str], None]) -> Optional[threading.Event]:
    """Starts the receiver and the sender in threads when the environment names a port, buddies
    and the key; returns the event that stops them (None: replication is not planned here)."""
    port, key = env.get(PORT_ENV, ""), env.get(KEY_ENV, "")
    run_id, host = env.get("DDPLAUNCH_RUN_ID", ""), env.get("DDPLAUNCH_HOST", "")
    if not (port.isdigit() and key and run_id and host):
        return None
    place = Place(layout.safe_component(run_id, "run id"), layout.safe_component(host, "host"), key.encode())
    try:
        receiver = Receiver(place, int(port))
    except OSError as exc:
        say(f"checkpoint: no copies from buddies will land on {host}: port {port} cannot be listened on ({exc})")
        receiver = None
    stopping = threading.Event()
    if receiver is not None:
        threading.Thread(target=receiver.serve, daemon=True, name="ddplaunch-replica-serve").start()
        threading.Thread(target=_stop_when, args=(stopping, receiver), daemon=True).start()
    sender = Sender(place, parse_buddies(env.get(BUDDIES_ENV, "")), say)
    threading.Thread(target=sender.run, args=(stopping,), daemon=True, name="ddplaunch-replica-out").start()
    return stopping


def _stop_when(stopping: threading.Event, receiver: Receiver) -> None:
    stopping.wait()
    receiver.stop()


def say_stderr(text: str) -> None:
    try:
        sys.stderr.write(f"ddplaunch: {text}\n")
        sys.stderr.flush()
    except Exception:
        pass
