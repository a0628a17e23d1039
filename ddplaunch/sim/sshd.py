"""One real OpenSSH sshd per sim host, plus the client key and known_hosts that trust them.

Each sshd listens on its host's address, port 22, with its own ed25519 host key and pid
file; root logs in with the sim's client key only. The daemon is started through the host
wrapper (so sessions get the host's hostname and /etc/hosts) and found again by its pid file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ddplaunch.sim.proc import SimError, pid_alive, pid_cmdline, require_tool, run, stop_pids, wait_until

SSHD = "/usr/sbin/sshd"
SSHD_FIX = "install OpenSSH's server: apt-get install openssh-server"
START_TIMEOUT_S = 10.0
ACCEPT_ENV = "LANG LC_* DDP_* DDPLAUNCH_* GLOO_* NCCL_* TORCH_* MASTER_* OMP_*"


def require_sshd() -> str:
    """Path of sshd and ssh-keygen checks; raises SimError with the apt-get fix."""
    require_tool("ssh-keygen", "install OpenSSH: apt-get install openssh-client")
    return require_tool(SSHD, SSHD_FIX)


def ensure_keypair(path: Path, comment: str) -> Path:
    """Create an ed25519 key without passphrase at `path` (+ .pub) unless a valid one is there."""
    pub = path.with_name(path.name + ".pub")
    if not (path.is_file() and pub.is_file() and pub.read_text().startswith("ssh-ed25519 ")):
        path.unlink(missing_ok=True)
        pub.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    os.chmod(path, 0o600)
    return pub


def public_key(path: Path) -> str:
    """`ssh-ed25519 AAAA...` (type and key, no comment) of a key pair at `path`."""
    fields = path.with_name(path.name + ".pub").read_text().split()
    return f"{fields[0]} {fields[1]}"


def known_hosts_text(entries: Sequence[tuple[str, str]]) -> str:
    """known_hosts lines `ADDR ssh-ed25519 AAAA...` for (addr, public key) pairs (pure)."""
    return "".join(f"{addr} {key}\n" for addr, key in entries)


def sshd_config_text(*, addr: str, host_key: Path, pid_file: Path, authorized_keys: Path) -> str:
    """The sshd_config of one sim host (pure)."""
    return "\n".join([
        "# written by ddplaunch sim",
        "Port 22",
        f"ListenAddress {addr}",
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        "StrictModes no",              # the state dir lives in /tmp; sshd would reject it
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",                   # PAM needs a login stack the namespaces do not have
        "UseDNS no",
        "PrintMotd no",
        f"AcceptEnv {ACCEPT_ENV}",
        "MaxStartups 100:30:200",      # many parallel launches from one client
        "MaxSessions 50",
        "Subsystem sftp /usr/lib/openssh/sftp-server",
        "LogLevel INFO",
        "",
    ])


def write_sshd_config(host_dir: Path, addr: str, authorized_keys: Path) -> Path:
    """Create the host key and sshd_config for one host under `host_dir`; returns the config."""
    host_key = host_dir / "ssh_host_ed25519_key"
    ensure_keypair(host_key, f"ddplaunch-sim-host-{addr}")
    config = host_dir / "sshd_config"
    config.write_text(sshd_config_text(addr=addr, host_key=host_key, pid_file=host_dir / "sshd.pid",
                                       authorized_keys=authorized_keys))
    mkdir_privsep()
    run([SSHD, "-t", "-f", str(config)])
    return config


def start_sshd(host_dir: Path, enter: Sequence[str]) -> int:
    """Start the host's sshd through `enter` (the host wrapper argv prefix); return its PID.

    sshd daemonizes and writes its pid file once its listening socket is bound, so the pid
    file appearing is the readiness signal.

    Raises:
        SimError: sshd exited with an error or wrote no pid file in time (see sshd.log).
    """
    config, pid_file, log = host_dir / "sshd_config", host_dir / "sshd.pid", host_dir / "sshd.log"
    pid_file.unlink(missing_ok=True)
    mkdir_privsep()
    run([*enter, SSHD, "-f", str(config), "-E", str(log)])
    if not wait_until(lambda: _read_pid(pid_file) is not None, START_TIMEOUT_S):
        raise SimError(f"sshd for {host_dir.name} wrote no pid file within {START_TIMEOUT_S:g}s: see {log}")
    pid = _read_pid(pid_file)
    assert pid is not None
    if not pid_alive(pid):
        raise SimError(f"sshd for {host_dir.name} exited right after start: see {log}")
    return pid


def stop_sshd(pid: int | None, host_dir: Path) -> bool:
    """Stop the sshd listener with `pid` if it is still the one started for `host_dir`.

    Established sessions keep running (OpenSSH behaviour); `sim down` ends them with the
    namespace. Returns True when a process was stopped.
    """
    if not is_our_sshd(pid, host_dir):
        return False
    assert pid is not None
    stop_pids([pid])
    (host_dir / "sshd.pid").unlink(missing_ok=True)
    return True


def is_our_sshd(pid: int | None, host_dir: Path) -> bool:
    """True when `pid` is alive and is an sshd running our config (guards against PID reuse)."""
    return pid_alive(pid) and str(host_dir / "sshd_config") in pid_cmdline(pid or 0)


def mkdir_privsep() -> None:
    """sshd needs its privilege-separation dir, which systemd would normally create."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)


def _read_pid(pid_file: Path) -> int | None:
    try:
        text = pid_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
