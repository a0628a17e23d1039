"""`sync:` over SFTP: the spec's files and directories copied into every host's workdir.

Each file is written into a private (0700) directory in workdir, then renamed into place: no
other user can open it while it is written, no rank reads half a file, and where the host
shares the launcher's file system (workdir holding the very files synced) a file is replaced
by a copy of itself instead of being truncated before it is read.
"""

from __future__ import annotations

import contextlib
import secrets
import stat
from pathlib import Path

import paramiko

from ddplaunch.spec.model import ClusterSpec


def sync(sftp: paramiko.SFTPClient, spec: ClusterSpec, workdir: str) -> None:
    """Copy each `sync:` path (relative to the spec's directory) into the host's workdir: a file to
    workdir/NAME, a directory's files to workdir/NAME/..., each with its mode and mtime."""
    stage = f"{workdir}/.ddplaunch-sync-{secrets.token_hex(8)}"
    sftp.mkdir(stage, 0o700)
    try:
        for entry in spec.sync:
            src = spec.resolve(entry)
            files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
            for path in files:
                rel = Path(entry).name if src.is_file() else Path(Path(entry).name) / path.relative_to(src)
                remote = Path(workdir) / rel
                _mkdirs(sftp, str(remote.parent))
                st = path.stat()
                tmp = f"{stage}/file"
                sftp.put(str(path), tmp)
                sftp.chmod(tmp, stat.S_IMODE(st.st_mode))
                sftp.utime(tmp, (int(st.st_atime), int(st.st_mtime)))
                sftp.posix_rename(tmp, str(remote))
    finally:
        with contextlib.suppress(OSError):
            sftp.remove(f"{stage}/file")
        with contextlib.suppress(OSError):
            sftp.rmdir(stage)


def _mkdirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        p = str(Path(*parts[:i]))
        try:
            sftp.stat(p)
        except OSError:
            sftp.mkdir(p)
