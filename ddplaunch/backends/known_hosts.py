"""known_hosts for the SSH backend: read any file without failing, add new keys without losing any.

paramiko's own reader raises on `@revoked`/`@cert-authority` lines and its AutoAddPolicy rewrites
the whole file from memory on every new host, so parallel connections drop each other's entries
and every line paramiko cannot parse. Here the file is only ever appended to, one line per new
host, under an exclusive flock, after re-reading it under that lock.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import functools
import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import paramiko
from paramiko.hostkeys import HostKeyEntry

from ddplaunch.errors import BackendError

POLICIES = ("strict", "accept-new")
#: Seconds to wait for another process's lock on known_hosts before giving up.
LOCK_TIMEOUT = 10.0


@dataclass(frozen=True)
class RevokedKey:
    """One `@revoked` line: this key is refused for hosts matching `patterns`."""

    patterns: tuple[str, ...]
    key_type: str
    blob: bytes = field(repr=False)
    lineno: int


@dataclass
class KnownHosts:
    """The usable content of a known_hosts file.

    `entries` are the host keys paramiko can check (revoked keys left out), `revoked` the
    `@revoked` keys, `skipped` (line number, reason) for every other non-comment line: kept in
    the file, unused here (unknown key types such as sk-ssh-ed25519@openssh.com, certificate
    authorities, garbage).
    """

    path: Path
    entries: list[HostKeyEntry] = field(default_factory=list)
    revoked: list[RevokedKey] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    #: Lines whose host list has wildcards (`*.corp`) or negations (`!bastion`): paramiko's
    #: lookup compares names literally, so the policies consult these themselves.
    patterned: list[tuple[tuple[str, ...], paramiko.PKey]] = field(default_factory=list)

    def host_keys(self) -> paramiko.HostKeys:
        """A fresh paramiko.HostKeys holding `entries`."""
        keys = paramiko.HostKeys()
        self.fill(keys)
        return keys

    def fill(self, keys: paramiko.HostKeys) -> None:
        """Add `entries` to `keys`; the first key of a type per host name wins (as OpenSSH reads).

        Linear: paramiko's own `add` and `load` scan every entry per line (35 s for 9,000 lines).
        """
        seen: set[tuple[str, str]] = set()
        fresh = []
        for entry in self.entries:
            key_type = entry.key.get_name()
            names = [n for n in entry.hostnames if (n, key_type) not in seen]
            seen.update((n, key_type) for n in names)
            if names:
                fresh.append(HostKeyEntry(names, entry.key))
        bulk = getattr(keys, "_entries", None)
        if isinstance(bulk, list) and not bulk:
            bulk.extend(fresh)
            return
        for entry in fresh:  # a non-empty or unfamiliar HostKeys: the public, slower way
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)

    def pattern_keys(self, hostname: str) -> list[paramiko.PKey]:
        """Keys of the wildcard/negation lines that match `hostname`."""
        return [key for patterns, key in self.patterned if _patterns_match(patterns, hostname)]

    def revoked_for(self, hostname: str, key: paramiko.PKey) -> Optional[RevokedKey]:
        """The `@revoked` line that revokes `key` for `hostname` (`addr` or `[addr]:port`), if any."""
        blob = key.asbytes()
        names = {hostname, _bare(hostname)}
        for rev in self.revoked:
            if rev.blob == blob and any(_patterns_match(rev.patterns, n) for n in names):
                return rev
        return None


class RevokedHostKeyError(paramiko.SSHException):
    """The host presented a key that known_hosts marks `@revoked`."""

    def __init__(self, hostname: str, key: paramiko.PKey, path: Path, rev: RevokedKey):
        super().__init__(f"host key of {hostname} ({key.get_name()} {key.fingerprint}) is marked "
                         f"@revoked in {path} line {rev.lineno}; refusing to connect (the host may be "
                         "impersonated, or it still uses a key that was retired)")
        self.hostname, self.key = hostname, key


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Line:
    lineno: int
    marker: Optional[str]
    names: tuple[str, ...]   # as written, comma-split
    key_type: str
    blob: bytes = field(repr=False)


def _read_lines(text: str, skipped: list[tuple[int, str]]) -> Iterator[_Line]:
    """The key lines of known_hosts text (comments, blanks and malformed lines go to `skipped`)."""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if marker not in (None, "@revoked"):
            skipped.append((lineno, f"{marker} lines are not supported (skipped)"))
            continue
        if len(fields) < 3:
            skipped.append((lineno, "fewer than 3 fields"))
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except (binascii.Error, ValueError):
            skipped.append((lineno, "key is not base64"))
            continue
        yield _Line(lineno, marker, tuple(fields[0].split(",")), fields[1], blob)


def parse_known_hosts(text: str, path: Union[str, Path] = "known_hosts") -> KnownHosts:
    """Parse known_hosts text; never raises, whatever the text holds.

    Understood: comments, blank lines, `a,b` host lists, hashed `|1|salt|hash` names,
    `[host]:port` names, `@revoked` (that key is refused for those hosts) and
    `@cert-authority` (skipped: paramiko cannot check host certificates).
    """
    known = KnownHosts(path=Path(path))
    for line in _read_lines(text, known.skipped):
        if line.marker == "@revoked":
            # Compared as raw blobs: a revoked key of a type paramiko cannot load is still revoked.
            known.revoked.append(RevokedKey(line.names, line.key_type, line.blob, line.lineno))
            continue
        names = [n for n in line.names if n and _usable_name(n)]
        if not names:
            known.skipped.append((line.lineno, "no usable host name"))
            continue
        try:
            key = paramiko.PKey.from_type_string(line.key_type, line.blob)
        except Exception as err:  # noqa: BLE001 — any undecodable key is skipped, never fatal
            known.skipped.append((line.lineno, f"key type {line.key_type!r} not usable: {type(err).__name__}"))
            continue
        if any(_is_pattern(n) for n in names):
            known.patterned.append((tuple(names), key))
        plain = [n for n in names if not _is_pattern(n)]
        if plain:
            known.entries.append(HostKeyEntry(plain, key))
    if known.revoked:
        revoked_blobs = {r.blob for r in known.revoked}
        # A revoked key is never trusted, whatever host line also lists it.
        known.entries = [e for e in known.entries if e.key.asbytes() not in revoked_blobs]
        known.patterned = [(p, k) for p, k in known.patterned if k.asbytes() not in revoked_blobs]
    return known


def load_host_keys(path: Union[str, Path]) -> KnownHosts:
    """Read a known_hosts file tolerantly; a missing file is an empty one.

    Parsed once per content (keyed by its SHA-256, so never stale), however many connections
    ask: decoding keys costs ~0.15 ms a line and every host of a cluster connects at once.
    The result is shared between callers: read it, do not modify it.

    Raises:
        BackendError: the file exists but cannot be read (a directory, no permission).
    """
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return KnownHosts(path=path)
    except OSError as err:
        raise BackendError(f"known_hosts {path}: cannot read: {err.strerror or err}; fix the file or "
                           "set ssh.known_hosts to another one") from None
    digest = hashlib.sha256(data).digest()
    with _CACHE_LOCK:
        cached = _CACHE.get(path)
    if cached is not None and cached[0] == digest:
        return cached[1]
    known = parse_known_hosts(data.decode("utf-8", "replace"), path)
    with _CACHE_LOCK:
        _CACHE[path] = (digest, known)
    return known


_CACHE: dict[Path, tuple[bytes, KnownHosts]] = {}
_CACHE_LOCK = threading.Lock()


def _usable_name(name: str) -> bool:
    """False for a malformed hashed name, which would make paramiko's lookup raise."""
    if not name.startswith("|"):
        return True
    parts = name.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        return all(len(base64.b64decode(p, validate=True)) == 20 for p in parts[2:])
    except (binascii.Error, ValueError):
        return False


def _is_pattern(name: str) -> bool:
    return name.startswith("!") or "*" in name or "?" in name


def _bare(hostname: str) -> str:
    """`addr` from `[addr]:port`; anything else unchanged."""
    if hostname.startswith("[") and "]:" in hostname:
        return hostname[1:hostname.index("]:")]
    return hostname


@functools.lru_cache(maxsize=1024)
def _wildcard(pattern: str) -> "re.Pattern[str]":
    """OpenSSH wildcards: only `*` and `?` (so `[host]:22` stays literal, unlike fnmatch)."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern),
                      re.DOTALL)


def _patterns_match(patterns: tuple[str, ...], hostname: str) -> bool:
    """OpenSSH host pattern list semantics: a positive match and no negated (`!`) match."""
    matched = False
    for pat in patterns:
        negated = pat.startswith("!")
        pat = pat[1:] if negated else pat
        if pat.startswith("|1|"):
            hit = _usable_name(pat) and paramiko.HostKeys.hash_host(hostname, pat) == pat
        elif "*" in pat or "?" in pat:
            hit = _wildcard(pat.lower()).fullmatch(hostname.lower()) is not None
        else:
            hit = pat.lower() == hostname.lower()
        if hit and negated:
            return False
        matched = matched or hit
    return matched


# --------------------------------------------------------------------------- writing


def record_host_key(path: Union[str, Path], hostname: str, key: paramiko.PKey) -> bool:
    """Append `hostname keytype base64` to known_hosts unless the host is already there.

    Holds an exclusive flock on the file while it re-reads it and appends, so parallel
    connections (threads or processes) never lose each other's lines; the bytes already in
    the file are never rewritten. The file (and its directory) are created 0600 (0700) if missing.

    Args:
        hostname: as paramiko names it: `addr`, or `[addr]:port` when the port is not 22.

    Returns:
        True when the line was appended, False when the same key was already recorded.

    Raises:
        paramiko.BadHostKeyException: the file (now) has a different key for the host.
        RevokedHostKeyError: the file (now) revokes this key for the host.
        paramiko.SSHException: the file cannot be locked or written.
    """
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise paramiko.SSHException(f"cannot open {path} to record the key of {hostname}: "
                                    f"{err.strerror or err}") from None
    try:
        _lock(fd, path)
        # A scan, not a parse: no key is decoded, so holding the lock stays cheap for big files.
        blob, recorded = key.asbytes(), []
        for line in _read_lines(_read_all(fd).decode("utf-8", "replace"), []):
            if line.marker == "@revoked":
                if line.blob == blob and any(_patterns_match(line.names, n) for n in (hostname, _bare(hostname))):
                    raise RevokedHostKeyError(hostname, key, path, RevokedKey(line.names, line.key_type,
                                                                              line.blob, line.lineno))
            elif _patterns_match(line.names, hostname):
                recorded.append(line)
        if any(line.blob == blob for line in recorded):
            return False
        if recorded:
            # Another process recorded this host meanwhile with another key: trust neither blindly.
            raise paramiko.BadHostKeyException(hostname, key, _expected_key(recorded))
        size = os.fstat(fd).st_size
        prefix = b""
        if size and os.pread(fd, 1, size - 1) != b"\n":
            prefix = b"\n"  # a last line without newline stays intact; ours starts on its own line
        data = prefix + f"{hostname} {key.get_name()} {key.get_base64()}\n".encode()
        while data:
            written = os.write(fd, data)
            data = data[written:]
        os.fsync(fd)
        return True
    except OSError as err:
        raise paramiko.SSHException(f"cannot record the key of {hostname} in {path}: "
                                    f"{err.strerror or err}") from None
    finally:
        os.close(fd)  # releases the flock


def _expected_key(recorded: list[_Line]) -> paramiko.PKey:
    """The key the file has for the host, for BadHostKeyException (which needs a PKey)."""
    for line in recorded:
        try:
            return paramiko.PKey.from_type_string(line.key_type, line.blob)
        except Exception:  # noqa: BLE001 — a type paramiko cannot load; try the next line
            continue
    return _UnloadableKey(recorded[0].key_type)


class _UnloadableKey(paramiko.PKey):
    """Stands for a recorded key paramiko cannot decode (e.g. sk-ssh-ed25519@openssh.com)."""

    def __init__(self, key_type: str):
        self._key_type = key_type

    def get_name(self) -> str:
        return self._key_type

    def asbytes(self) -> bytes:
        return b""

    @property
    def _fields(self) -> tuple[Any, ...]:
        return (self._key_type,)


def _lock(fd: int, path: Path) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise paramiko.SSHException(f"{path} stayed locked by another process for "
                                            f"{LOCK_TIMEOUT:.0f}s; cannot record a new host key") from None
            time.sleep(0.01)


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------- policies


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host: refused (revoked keys named as such). Never writes."""

    def __init__(self, known: KnownHosts):
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if _known_by_pattern(self.known, hostname, key):
            return
        # The wording "not found in known_hosts" is paramiko's RejectPolicy's, which callers match.
        raise paramiko.SSHException(f"Server {hostname!r} not found in known_hosts ({self.known.path})")


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host: its key is appended to known_hosts (one line, under a lock) and trusted.

    A changed key never reaches this policy: paramiko raises BadHostKeyException itself when
    the loaded keys have the host.
    """

    def __init__(self, known: KnownHosts):
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not _known_by_pattern(self.known, hostname, key):
            record_host_key(self.known.path, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def _known_by_pattern(known: KnownHosts, hostname: str, key: paramiko.PKey) -> bool:
    """For a host paramiko did not find: refuse a revoked key; True when a wildcard line has
    this very key; a wildcard line with another key is a changed key (BadHostKeyException)."""
    rev = known.revoked_for(hostname, key)
    if rev is not None:
        raise RevokedHostKeyError(hostname, key, known.path, rev)
    keys = known.pattern_keys(hostname)
    if key in keys:
        return True
    if keys:
        raise paramiko.BadHostKeyException(hostname, key, keys[0])
    return False


def configure(client: paramiko.SSHClient, known_hosts: Union[str, Path], policy: str) -> KnownHosts:
    """Load `known_hosts` (tolerantly) into `client` and set the missing-host-key policy.

    Replaces whatever keys and policy the client had (Fabric installs AutoAddPolicy).

    Args:
        policy: `strict` (unknown keys refused, the file never written) or `accept-new`
            (unknown keys appended to the file; changed or revoked keys refused).

    Returns:
        The parsed file (its `skipped` lines say what was not used).

    Raises:
        ValueError: an unknown policy.
        BackendError: the file exists but cannot be read.
    """
    if policy not in POLICIES:
        raise ValueError(f"host_key_policy {policy!r}: use one of {', '.join(POLICIES)}")
    known = load_host_keys(known_hosts)
    keys = client.get_host_keys()
    keys.clear()
    known.fill(keys)
    client.set_missing_host_key_policy(StrictPolicy(known) if policy == "strict" else AcceptNewPolicy(known))
    return known
