"""One real OpenSSH sshd per sim host, plus the client key and known_hosts that trust them.

Each sshd listens on its host's address, port 22, with its own ed25519 host key and pid
file; root logs in with the sim's client key only. The daemon is started through the host
wrapper (so sessions get the host's hostname and /etc/hosts) and found again by its pid file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from ddplaunch.sim.proc import (SimError, pid_alive, pid_cmdline, read_pid, require_tool, run, run_concurrently,
                                stop_pids, wait_until)

SSHD = "/usr/sbin/sshd"
SSHD_FIX = "install OpenSSH's server: apt-get install openssh-server"
START_TIMEOUT_S = 10.0
ACCEPT_ENV = "LANG LC_* DDP_* DDPLAUNCH_* GLOO_* NCCL_* TORCH_* MASTER_* OMP_*"


def require_sshd() -> str:
    """Path of sshd and ssh-keygen checks; raises SimError with the apt-get fix."""
    require_tool("ssh-keygen", "install OpenSSH: apt-get install openssh-client")
    return require_tool(SSHD, SSHD_FIX)


def new_keypair(path: Path, comment: str) -> Path:
    """Create a fresh ed25519 key pair without passphrase at `path` (0600) and `path`.pub,
    replacing whatever was there (a key we did not just make is never trusted); returns the
    .pub path. Made in-process (no ssh-keygen per key), files opened O_EXCL|O_NOFOLLOW."""
    pub = path.with_name(path.name + ".pub")
    path.unlink(missing_ok=True)
    pub.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    except ImportError:  # pragma: no cover - cryptography comes with paramiko
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
        os.chmod(path, 0o600)
        return pub
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    write_new_file(path, private, 0o600)
    write_new_file(pub, public + f" {comment}\n".encode(), 0o644)
    return pub


def write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create `path` (which must not exist; never through a symlink) with `mode` and `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)  # the umask may have taken bits off


def public_key(path: Path) -> str:
    """`ssh-ed25519 AAAA...` (type and key, no comment) of a key pair at `path`."""
    fields = path.with_name(path.name + ".pub").read_text().split()
    return f"{fields[0]} {fields[1]}"


def known_hosts_text(entries: Sequence[tuple[str, str]]) -> str:
    """known_hosts lines `ADDR ssh-ed25519 AAAA...` for (addr, public key) pairs (pure)."""
    return "".join(f"{addr} {key}\n" for addr, key in entries)


#: How root logs in to a sim host's or a throwaway sshd: its key only. StrictModes off: /tmp (1777)
#: fails its path check (cluster.py checks the state dir); no PAM: the namespaces have no login stack.
LOGIN_OPTIONS = ("StrictModes no", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
                 "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "UseDNS no")


def sshd_config_text(*, addr: str, host_key: Path, pid_file: Path, authorized_keys: Path,
                     penalties_off: bool = False, set_env: Sequence[str] = ()) -> str:
    """The sshd_config of one sim host (pure). `penalties_off` adds `PerSourcePenalties no`
    (OpenSSH 9.8+, where every login of the sim comes from the one bridge address and a few
    probes that close without authenticating would get that address refused). `set_env`: NAME=VALUE
    words without white space (sshd splits its one SetEnv line at white space)."""
    if any(len(assignment.split()) != 1 or "=" not in assignment for assignment in set_env):
        raise ValueError(f"set_env: NAME=VALUE without white space, got {list(set_env)}")
    return "\n".join([
        "# written by ddplaunch sim",
        "Port 22",
        f"ListenAddress {addr}",
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        *LOGIN_OPTIONS,
        "PrintMotd no",
        f"AcceptEnv {ACCEPT_ENV}",
        # one client (the launcher, or a test) may open 128+ logins at once: no early drops
        "MaxStartups 256:30:512",
        "MaxSessions 64",
        "Subsystem sftp /usr/lib/openssh/sftp-server",
        "LogLevel INFO",
        *(["PerSourcePenalties no"] if penalties_off else []),  # OpenSSH >= 9.8: one source IP
        # what every session of the host gets, as a site's system config would give it (podman's
        # containers.conf for this VM: runc, cgroupfs, rlimits no higher than root's here)
        # one line: sshd takes the first SetEnv line only and ignores the rest
        *([f"SetEnv {' '.join(set_env)}"] if set_env else []),
        "",
    ])


def write_sshd_config(host_dir: Path, addr: str, authorized_keys: Path, check: bool = True,
                      set_env: Sequence[str] = ()) -> Path:
    """Create a fresh host key and the sshd_config for one host under `host_dir`; returns the
    config. With `check`, `sshd -t` validates it (do it for one host: the rest differ only in
    addresses and paths)."""
    host_key = host_dir / "ssh_host_ed25519_key"
    new_keypair(host_key, f"ddplaunch-sim-host-{addr}")
    config = host_dir / "sshd_config"
    config.write_text(sshd_config_text(addr=addr, host_key=host_key, pid_file=host_dir / "sshd.pid",
                                       authorized_keys=authorized_keys, penalties_off=_penalties_option(),
                                       set_env=set_env))
    mkdir_privsep()
    if check:
        run([SSHD, "-t", "-f", str(config)])
    return config


_PENALTIES: list[bool] = []


def _penalties_option() -> bool:
    """Whether this sshd knows `PerSourcePenalties` (asked once per process)."""
    if not _PENALTIES:
        proc = run([SSHD, "-t", "-f", "/dev/null", "-o", "PerSourcePenalties=no",
                    "-o", "HostKey=/nonexistent"], check=False)
        _PENALTIES.append("PerSourcePenalties" not in proc.stderr)
    return _PENALTIES[0]


def start_sshd(host_dir: Path, enter: Sequence[str]) -> int:
    """Start the host's sshd through `enter` (the host wrapper argv prefix); return its PID.

    Raises:
        SimError: sshd exited with an error or wrote no pid file in time (see sshd.log).
    """
    return start_sshds([(host_dir, enter)])[0]


def start_sshds(hosts: Sequence[tuple[Path, Sequence[str]]]) -> list[int]:
    """Start the sshd of every (host_dir, enter) concurrently; their PIDs, in order.

    sshd daemonizes at once and writes its pid file once its listening socket is bound, so
    the pid file appearing is the readiness signal; all hosts are waited for together.

    Raises:
        SimError: an sshd exited with an error or wrote no pid file in time (see its sshd.log).
    """
    mkdir_privsep()
    for host_dir, _ in hosts:
        (host_dir / "sshd.pid").unlink(missing_ok=True)
    run_concurrently([([*enter, SSHD, "-f", str(host_dir / "sshd_config"), "-E", str(host_dir / "sshd.log")],
                       None) for host_dir, enter in hosts])
    pid_files = [host_dir / "sshd.pid" for host_dir, _ in hosts]
    timeout = START_TIMEOUT_S + 0.05 * len(hosts)
    if not wait_until(lambda: all(read_pid(f) is not None for f in pid_files), timeout, interval=0.05):
        late = next(h for (h, _), f in zip(hosts, pid_files) if read_pid(f) is None)
        raise SimError(f"sshd for {late.name} wrote no pid file within {timeout:g}s: see {late / 'sshd.log'}")
    pids = [read_pid(f) for f in pid_files]
    for (host_dir, _), pid in zip(hosts, pids):
        if not pid_alive(pid):
            raise SimError(f"sshd for {host_dir.name} exited right after start: see {host_dir / 'sshd.log'}")
    return [p for p in pids if p is not None]


def stop_sshd(pid: int | None, host_dir: Path) -> bool:
    """Stop the sshd listener with `pid` if it is still the one started for `host_dir`.

    Established sessions keep running (OpenSSH behaviour); `sim down` ends them with the
    namespace. Returns True when a process was stopped.
    """
    return bool(stop_sshds([(pid, host_dir)]))


def stop_sshds(hosts: Sequence[tuple[int | None, Path]]) -> list[int]:
    """Stop every (pid, host_dir) sshd that is still ours, all in one grace period; the PIDs
    that were stopped."""
    ours = [(pid, d) for pid, d in hosts if pid is not None and is_our_sshd(pid, d)]
    stop_pids([pid for pid, _ in ours])
    for _, d in ours:
        (d / "sshd.pid").unlink(missing_ok=True)
    return [pid for pid, _ in ours]


def is_our_sshd(pid: int | None, host_dir: Path) -> bool:
    """True when `pid` is alive and is an sshd running our config (guards against PID reuse)."""
    return pid_alive(pid) and str(host_dir / "sshd_config") in pid_cmdline(pid or 0)


def mkdir_privsep() -> None:
    """sshd needs its privilege-separation dir, which systemd would normally create."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)


@contextlib.contextmanager
def loopback_sshd(d: Path, addrs: Sequence[str] = ("127.0.0.1",), extra: Sequence[str] = ()
                  ) -> Iterator[tuple[int, Path]]:
    """A throwaway sshd on a free port of loopback addresses `addrs`, for tests and benches that
    need one sshd and no sim: its host key and a client key (`d`/host_key, `d`/client_key, the
    latter authorized for root), `extra` config lines, its log in `d`/sshd.log. Yields (port,
    the host key's .pub); ended by its PID when the block ends.

    Raises:
        SimError: sshd ended, or did not listen within START_TIMEOUT_S (its log in the message).
    """
    new_keypair(d / "host_key", "throwaway sshd")
    (d / "authorized_keys").write_bytes(new_keypair(d / "client_key", "throwaway client").read_bytes())
    with socket.socket() as s:
        s.bind((addrs[0], 0))
        port = s.getsockname()[1]
    lines = [f"Port {port}", *(f"ListenAddress {a}" for a in addrs), f"HostKey {d}/host_key",
             f"PidFile {d}/sshd.pid", f"AuthorizedKeysFile {d}/authorized_keys", *LOGIN_OPTIONS, *extra]
    (d / "sshd_config").write_text("\n".join(lines) + "\n")
    mkdir_privsep()
    with open(d / "sshd.log", "wb") as log:
        proc = subprocess.Popen([require_sshd(), "-D", "-e", "-f", str(d / "sshd_config")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        def listens() -> bool:
            if proc.poll() is not None:
                raise SimError("sshd ended: " + (d / "sshd.log").read_text()[-2000:])
            try:
                socket.create_connection((addrs[0], port), timeout=1).close()
                return True
            except OSError:
                return False
        if not wait_until(listens, START_TIMEOUT_S):
            raise SimError(f"sshd did not listen within {START_TIMEOUT_S:g}s: " + (d / "sshd.log").read_text()[-2000:])
        yield port, d / "host_key.pub"
    finally:
        proc.terminate()  # our own child: ended by its PID, waited for
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
