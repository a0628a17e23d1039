"""known_hosts handling of the SSH backend: tolerant reading, race-free accept-new, @revoked.

Real paramiko keys throughout; the end-to-end tests start a throwaway sshd on 127.0.0.1 (root).
"""

from __future__ import annotations

import base64
import multiprocessing
import os
import shutil
import stat
import threading
from pathlib import Path

import paramiko
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddplaunch.backends.known_hosts import (AcceptNewPolicy, RevokedHostKeyError, StrictPolicy, configure,
                                            load_host_keys, parse_known_hosts, record_host_key)
from ddplaunch.errors import BackendError
from ddplaunch.sim.sshd import loopback_sshd

N_HOSTS = 6
#: One sshd answers on all of these: six "hosts" whose keys known_hosts records separately.
LOOPBACK_HOSTS = ["127.0.0.1"] + [f"127.0.0.{i}" for i in range(2, 2 + N_HOSTS)]


def _key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


def _line(names: str, key: paramiko.PKey) -> str:
    return f"{names} {key.get_name()} {key.get_base64()}"


def _sk_line(names: str) -> str:
    """A well-formed sk-ssh-ed25519@openssh.com line (a key type paramiko cannot load)."""
    def s(b: bytes) -> bytes:
        return len(b).to_bytes(4, "big") + b
    blob = s(b"sk-ssh-ed25519@openssh.com") + s(os.urandom(32)) + s(b"ssh:")
    return f"{names} sk-ssh-ed25519@openssh.com {base64.b64encode(blob).decode()} user@yubikey"


def _accept(path: Path, hostname: str, key: paramiko.PKey) -> paramiko.SSHClient:
    """What a connection does for an unknown host under accept-new (minus the network)."""
    client = paramiko.SSHClient()
    configure(client, path, "accept-new")
    assert isinstance(client._policy, AcceptNewPolicy)
    assert client.get_host_keys().lookup(hostname) is None, "the host must be unknown for the policy to be asked"
    client._policy.missing_host_key(client, hostname, key)
    return client


def _recorded(path: Path) -> dict[str, str]:
    """hostname -> base64 key of every plain (unmarked, unhashed) line."""
    out = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and not line.startswith(("#", "@", "|")):
            out[fields[0]] = fields[2]
    return out


# --------------------------------------------------------------------------- accept-new, in parallel


def _add_in_child(path: str, hostname: str, key_b64: str, barrier) -> None:
    key = paramiko.ECDSAKey(data=base64.b64decode(key_b64))
    barrier.wait(timeout=30)
    _accept(Path(path), hostname, key)


@pytest.mark.parametrize("round_trips", [3])
def test_parallel_processes_keep_every_new_host_across_runs(tmp_path: Path, round_trips: int) -> None:
    path = tmp_path / "known_hosts"
    ctx = multiprocessing.get_context("fork")
    expected: dict[str, str] = {}
    for run in range(round_trips):
        keys = {f"host{run}-{i}": _key() for i in range(N_HOSTS)}
        barrier = ctx.Barrier(N_HOSTS)
        procs = [ctx.Process(target=_add_in_child, args=(str(path), h, k.get_base64(), barrier))
                 for h, k in keys.items()]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0] * N_HOSTS
        expected.update({h: k.get_base64() for h, k in keys.items()})
        assert _recorded(path) == expected  # this run's 6 and every earlier run's
    assert len(path.read_text().splitlines()) == N_HOSTS * round_trips


def test_parallel_threads_keep_every_new_host(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text("# my hosts\n")
    keys = {f"10.0.0.{i}" if i % 2 else f"[10.0.0.{i}]:2222": _key() for i in range(12)}
    barrier = threading.Barrier(len(keys), timeout=30)
    errors: list[BaseException] = []

    def add(hostname: str, key: paramiko.PKey) -> None:
        try:
            client = paramiko.SSHClient()
            configure(client, path, "accept-new")
            barrier.wait()
            client._policy.missing_host_key(client, hostname, key)
        except BaseException as err:  # noqa: BLE001 — reported below
            errors.append(err)

    threads = [threading.Thread(target=add, args=item) for item in keys.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert _recorded(path) == {h: k.get_base64() for h, k in keys.items()}
    assert path.read_text().startswith("# my hosts\n")


def _race_same_host(path: str, key_b64: str, barrier, results) -> None:
    key = paramiko.ECDSAKey(data=base64.b64decode(key_b64))
    client = paramiko.SSHClient()
    configure(client, Path(path), "accept-new")
    barrier.wait(timeout=30)
    try:
        client._policy.missing_host_key(client, "gpu1", key)
        results.put("accepted")
    except paramiko.BadHostKeyException:
        results.put("refused")


def test_same_new_host_with_different_keys_in_parallel_one_wins(tmp_path: Path) -> None:
    """Check and append happen under one lock: exactly one key is recorded, the others refused."""
    path = tmp_path / "known_hosts"
    ctx = multiprocessing.get_context("fork")
    for _ in range(5):  # without the lock, 2 of 3 three-round runs recorded several keys
        path.write_text("")
        barrier, results = ctx.Barrier(N_HOSTS), ctx.Queue()
        procs = [ctx.Process(target=_race_same_host, args=(str(path), _key().get_base64(), barrier, results))
                 for _ in range(N_HOSTS)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert outcomes == ["accepted"] + ["refused"] * (N_HOSTS - 1)
        assert len(path.read_text().splitlines()) == 1


def test_record_waits_for_the_lock_then_rereads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic form of the race: another writer holds the flock and adds the host meanwhile."""
    import fcntl

    import ddplaunch.backends.known_hosts as kh

    path = tmp_path / "known_hosts"
    path.write_text("# hosts\n")
    theirs, ours = _key(), _key()
    at_lock = threading.Event()
    real_lock = kh._lock

    def spy_lock(fd: int, p: Path) -> None:
        at_lock.set()
        real_lock(fd, p)

    monkeypatch.setattr(kh, "_lock", spy_lock)
    outcome: list[object] = []
    with open(path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: outcome.append(_try(lambda: record_host_key(path, "gpu1", ours))))
        worker.start()
        assert at_lock.wait(timeout=10), "record_host_key never took the lock"
        other.write(_line("gpu1", theirs) + "\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_UN)
    worker.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], paramiko.BadHostKeyException)
    assert path.read_text() == "# hosts\n" + _line("gpu1", theirs) + "\n"


def test_file_is_locked_while_reread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    import ddplaunch.backends.known_hosts as kh

    path = tmp_path / "known_hosts"
    path.write_text("")
    real_read = kh._read_all
    held: list[bool] = []

    def spy_read(fd: int) -> bytes:
        with open(path, "rb") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return real_read(fd)

    monkeypatch.setattr(kh, "_read_all", spy_read)
    assert record_host_key(path, "gpu1", _key())
    assert held == [True]


def _try(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 — the test inspects it
        return err


def test_created_0600_with_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "new" / ".ssh" / "known_hosts"
    key = _key()
    _accept(path, "gpu1", key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == _line("gpu1", key) + "\n"


def test_existing_lines_kept_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    k1, k2, k3, revoked = _key(), _key(), _key(), _key()
    original = "\n".join([
        "# fleet keys, do not edit",
        "",
        _line("gpu1,10.0.0.1", k1) + "  # two names, trailing comment",
        _line(paramiko.HostKeys.hash_host("gpu2"), k2),
        _line("[gpu3]:2222", k3),
        _sk_line("bastion"),
        "@cert-authority *.example.com " + _line("", k1).strip(),
        "@revoked * " + _line("", revoked).strip(),
        "\tgarbage line with tabs\t",
        "gpu9 ssh-ed25519 !!!not-base64!!!",
        "|1|broken-hash ssh-ed25519 AAAA",
        _line("gpu4", k1) + "\r",                              # CRLF written by another tool
        "last line without a newline " + _line("x", k2),
    ]).encode()
    path.write_bytes(original)
    new = {"n1": _key(), "[n2]:2200": _key()}
    for host, key in new.items():
        _accept(path, host, key)
    data = path.read_bytes()
    assert data.startswith(original)
    added = data[len(original):].decode()
    assert added == "\n" + "".join(_line(h, k) + "\n" for h, k in new.items())
    # the old entries still work
    keys = load_host_keys(path).host_keys()
    assert keys.lookup("gpu1")[k1.get_name()] == k1
    assert keys.lookup("10.0.0.1")[k1.get_name()] == k1
    assert keys.lookup("gpu2")[k2.get_name()] == k2
    assert keys.lookup("[gpu3]:2222")[k3.get_name()] == k3
    assert keys.lookup("gpu4")[k1.get_name()] == k1


def test_known_host_added_meanwhile_with_other_key_refused(tmp_path: Path) -> None:
    """Another process records the host after we loaded the file: its key wins, ours is refused."""
    path = tmp_path / "known_hosts"
    path.write_text("# empty\n")
    client = paramiko.SSHClient()
    configure(client, path, "accept-new")           # loaded before the other process writes
    theirs, ours = _key(), _key()
    record_host_key(path, "gpu1", theirs)
    before = path.read_bytes()
    with pytest.raises(paramiko.BadHostKeyException) as err:
        client._policy.missing_host_key(client, "gpu1", ours)
    assert err.value.expected_key == theirs
    assert path.read_bytes() == before
    client._policy.missing_host_key(client, "gpu1", theirs)  # the same key: accepted, not doubled
    assert path.read_bytes() == before


def test_unknown_policy_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="accept-new"):
        configure(paramiko.SSHClient(), tmp_path / "kh", "yes")


# --------------------------------------------------------------------------- strict, revoked, garbage


def test_strict_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(_line("gpu1", _key()) + "\n")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    client = paramiko.SSHClient()
    configure(client, path, "strict")
    assert isinstance(client._policy, StrictPolicy)
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        client._policy.missing_host_key(client, "gpu2", _key())
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    missing = tmp_path / "absent" / "known_hosts"
    configure(client, missing, "strict")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        client._policy.missing_host_key(client, "gpu2", _key())
    assert not missing.parent.exists()


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_revoked_key_refused(tmp_path: Path, policy: str) -> None:
    path = tmp_path / "known_hosts"
    bad, good = _key(), _key()
    path.write_text("\n".join([_line("gpu1", bad), _line("gpu2", good),
                               f"@revoked gpu1,gpu3 {bad.get_name()} {bad.get_base64()}", ""]))
    before = path.read_bytes()
    client = paramiko.SSHClient()
    configure(client, path, policy)
    # gpu1's only line is the revoked key: not trusted, so paramiko asks the policy, which refuses
    assert client.get_host_keys().lookup("gpu1") is None
    for host in ("gpu1", "gpu3"):
        with pytest.raises(RevokedHostKeyError, match=r"@revoked in .*known_hosts line 3"):
            client._policy.missing_host_key(client, host, bad)
    assert path.read_bytes() == before
    assert client.get_host_keys().lookup("gpu2")[good.get_name()] == good


def test_revoked_patterns_follow_openssh(tmp_path: Path) -> None:
    """`*`/`?` wildcards, `!` negation, hashed names; `[host]:port` is literal (not a glob class)."""
    bad = _key()
    text = "\n".join(f"@revoked {names} {bad.get_name()} {bad.get_base64()}" for names in (
        "*.corp,!safe.corp", "[gpu3]:2222", "gpu?", paramiko.HostKeys.hash_host("secret-host")))
    known = parse_known_hosts(text)
    for host in ("a.corp", "[a.corp]:2200", "[gpu3]:2222", "gpu7", "secret-host"):
        assert known.revoked_for(host, bad) is not None, host
    for host in ("safe.corp", "g:2222", "[gpu30]:2222", "gpu10", "other"):
        assert known.revoked_for(host, bad) is None, host
    assert known.revoked_for("a.corp", _key()) is None


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_wildcard_host_lines_work(tmp_path: Path, policy: str) -> None:
    """`*.corp,!bastion.corp key` trusts that key for a.corp (paramiko alone compares names literally)."""
    path = tmp_path / "known_hosts"
    fleet = _key()
    path.write_text(_line("*.corp,!bastion.corp", fleet) + "\n")
    before = path.read_bytes()
    client = paramiko.SSHClient()
    configure(client, path, policy)
    client._policy.missing_host_key(client, "a.corp", fleet)          # trusted, nothing written
    with pytest.raises(paramiko.BadHostKeyException):
        client._policy.missing_host_key(client, "b.corp", _key())     # the pattern says another key
    assert path.read_bytes() == before
    if policy == "strict":
        with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
            client._policy.missing_host_key(client, "bastion.corp", fleet)


def test_parsed_once_per_content(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(_line("gpu1", _key()) + "\n")
    first = load_host_keys(path)
    assert load_host_keys(path) is first
    record_host_key(path, "gpu2", _key())
    second = load_host_keys(path)
    assert second is not first and [e.hostnames for e in second.entries] == [["gpu1"], ["gpu2"]]


def test_unloadable_recorded_key_still_blocks_another(tmp_path: Path) -> None:
    """A host recorded only with a key type paramiko cannot check is not re-added with another key."""
    path = tmp_path / "known_hosts"
    path.write_text(_sk_line("gpu1") + "\n")
    before = path.read_bytes()
    with pytest.raises(paramiko.BadHostKeyException) as err:
        _accept(path, "gpu1", _key())
    assert err.value.expected_key.get_name() == "sk-ssh-ed25519@openssh.com"
    assert path.read_bytes() == before


def test_cert_authority_and_unknown_types_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    k = _key()
    path.write_text("\n".join([
        "@cert-authority *.example.com ssh-ed25519-cert-v01@openssh.com AAAA",
        "@cert-authority *.example.com " + _line("", k).strip(),
        "@future-marker host ssh-ed25519 AAAA",
        _sk_line("bastion"),
        _line("gpu1", k), ""]))
    known = load_host_keys(path)
    assert [e.hostnames for e in known.entries] == [["gpu1"]]
    assert [n for n, _ in known.skipped] == [1, 2, 3, 4]


def test_unreadable_file_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / "kh").mkdir()
    with pytest.raises(BackendError, match="cannot read"):
        configure(paramiko.SSHClient(), tmp_path / "kh", "strict")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=80),
    st.sampled_from(["@revoked", "@cert-authority", "|1|", "|1|a|b", "[h]:22", "a,b,", ",", "*", "!h",
                     "ssh-ed25519", "ssh-rsa", "AAAA", "AAAAC3NzaC1lZDI1NTE5", "#", "\t", "\x00"])),
    max_size=8).map(" ".join))
def test_any_text_parses_and_looks_up(text: str) -> None:
    known = parse_known_hosts(text + "\n" + text.replace(" ", "\n"))
    keys = known.host_keys()
    for host in ("h", "[h]:22", "a", "gpu1"):
        keys.lookup(host)
        known.revoked_for(host, _STATIC_KEY)


_STATIC_KEY = paramiko.ECDSAKey.generate()


# --------------------------------------------------------------------------- against a real sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway sshd on 127.0.0.1:<free port> (its own host key); killed by its PID."""
    if os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists() or not shutil.which("ssh-keygen"):
        pytest.skip("needs root, /usr/sbin/sshd and ssh-keygen")
    d = tmp_path_factory.mktemp("sshd")
    with loopback_sshd(d, LOOPBACK_HOSTS, ["MaxStartups 100:30:200"]) as (port, host_pub_path):
        host_pub = host_pub_path.read_text().split()
        yield {"port": port, "client_key": str(d / "client_key"), "dir": d,
               "host_key": paramiko.PKey.from_type_string(host_pub[0], base64.b64decode(host_pub[1]))}


def _connect(sshd: dict, known: Path, policy: str) -> None:
    client = paramiko.SSHClient()
    configure(client, known, policy)
    try:
        client.connect("127.0.0.1", port=sshd["port"], username="root", key_filename=sshd["client_key"],
                       look_for_keys=False, allow_agent=False, timeout=10, banner_timeout=10, auth_timeout=10)
        _, out, _ = client.exec_command("echo ok", timeout=10)
        assert out.read().strip() == b"ok"
    finally:
        client.close()


@pytest.mark.root
def test_sshd_accept_new_then_strict(sshd: dict, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        _connect(sshd, known, "strict")
    assert not known.exists()
    _connect(sshd, known, "accept-new")
    line = known.read_text()
    assert line == _line(f"[127.0.0.1]:{sshd['port']}", sshd["host_key"]) + "\n"
    mtime = known.stat().st_mtime_ns
    _connect(sshd, known, "strict")
    _connect(sshd, known, "accept-new")
    assert (known.read_text(), known.stat().st_mtime_ns) == (line, mtime)


@pytest.mark.root
@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_sshd_changed_key_refused(sshd: dict, tmp_path: Path, policy: str) -> None:
    known = tmp_path / "known_hosts"
    other = paramiko.Ed25519Key.from_private_key_file(sshd["client_key"])  # any other ed25519 key
    known.write_text(_line(f"[127.0.0.1]:{sshd['port']}", other) + "\n")
    before = known.read_bytes()
    with pytest.raises(paramiko.BadHostKeyException):
        _connect(sshd, known, policy)
    assert known.read_bytes() == before


@pytest.mark.root
@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_sshd_revoked_key_refused(sshd: dict, tmp_path: Path, policy: str) -> None:
    known = tmp_path / "known_hosts"
    host_key = sshd["host_key"]
    known.write_text(_line(f"[127.0.0.1]:{sshd['port']}", host_key) + "\n"
                     + f"@revoked 127.0.0.1 {host_key.get_name()} {host_key.get_base64()}\n")
    before = known.read_bytes()
    with pytest.raises(RevokedHostKeyError, match="@revoked"):
        _connect(sshd, known, policy)
    assert known.read_bytes() == before


@pytest.mark.root
def test_sshd_strict_with_a_messy_file(sshd: dict, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    host_key = sshd["host_key"]
    known.write_text("\n".join([
        "# comment", "", "@cert-authority * " + _line("", _key()).strip(), _sk_line("bastion"),
        "@revoked * " + _line("", _key()).strip(), "garbage", "\x00\xff",
        _line(f"other,[127.0.0.1]:{sshd['port']}", host_key), ""]))
    before = known.read_bytes()
    _connect(sshd, known, "strict")
    assert known.read_bytes() == before


@pytest.mark.root
def test_ssh_backend_accept_new_keeps_all_six_hosts_across_runs(sshd: dict, tmp_path: Path) -> None:
    """The reported bug, through SshBackend.connect: 6 new hosts at once, 3 runs, nothing lost."""
    from concurrent.futures import ThreadPoolExecutor

    from ddplaunch.backends.ssh import SshBackend
    from ddplaunch.spec.model import ClusterSpec

    known = tmp_path / "known_hosts"
    header = "# team file\n" + _line("bastion,10.9.9.9", _key()) + "\n" + _sk_line("yubi-host") + "\n"
    known.write_text(header)
    addrs = LOOPBACK_HOSTS[1:]
    spec = ClusterSpec.model_validate({
        "backend": "ssh", "hosts": [{"addr": a, "port": sshd["port"], "user": "root"} for a in addrs],
        "ssh": {"key": sshd["client_key"], "known_hosts": str(known), "host_key_policy": "accept-new"}})
    host_line = f"{sshd['host_key'].get_name()} {sshd['host_key'].get_base64()}"
    for _ in range(3):
        backend = SshBackend(spec)
        try:
            with ThreadPoolExecutor(max_workers=len(addrs)) as pool:
                list(pool.map(backend.connect, spec.hosts))
        finally:
            backend.close()
        text = known.read_text()
        assert text.startswith(header)
        assert sorted(text[len(header):].splitlines()) == sorted(f"[{a}]:{sshd['port']} {host_line}" for a in addrs)
