"""A real container image for the container tests, built here without any registry, and the
podman settings that make podman run on these machines (test bed only, not product code).

`ensure_test_image()` returns the image name, building it only when `podman image exists`
says it is missing: a Debian rootfs (`debootstrap --variant=minbase`, python3 + python3-venv,
from the apt mirror this machine already uses), a venv made with this machine's Debian
/usr/bin/python3.11 and `pip install torch==2.13.0 numpy` (this machine's pip config, so its
wheel mirror; pip does not work inside the chroot), placed at /opt/imgvenv (a path the
machine itself does not have, so a test that passes proves it ran inside the image) plus the
marker file /etc/ddplaunch-test-image, streamed with `tar | podman import`. About 1.3 GB.

Why a containers.conf (see /work/shared/notes/containers.md): crun fails on this hybrid
cgroup v1/v2 machine, so runc with the cgroupfs manager (no systemd); and root here lacks
CAP_SYS_RESOURCE, so podman's default rlimits (nofile=1048576, nproc=32768) fail in
setrlimit; `default_ulimits` at or below the caller's limits work (`--ulimit` was not
honoured by podman 4.3). `podman_env()` writes it and returns CONTAINERS_CONF for it.

    python -m ddplaunch.sim.image           # build if missing, print the image name
"""

from __future__ import annotations

import fcntl
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ddplaunch.sim.proc import SimError

DEFAULT_IMAGE = "localhost/ddplaunch-test:torch2.13"
IMAGE_VENV = "/opt/imgvenv"
IMAGE_MARKER = "/etc/ddplaunch-test-image"
TORCH_REQUIREMENT = "torch==2.13.0"
HOST_PYTHON = "/usr/bin/python3.11"   # Debian's; the image's python3 is the same 3.11
SUITE = "bookworm"
#: containers.conf, the build lock and the build temp dirs live here (not /tmp: the rootfs
#: needs exec and device nodes, and tmpfs /tmp would hold 1.3 GB in memory on other machines)
WORK_DIR = Path(os.environ.get("DDPLAUNCH_PODMAN_DIR", "/var/tmp/ddplaunch-podman"))
#: podman's own defaults as root; the conf never asks for more than the caller has
PODMAN_DEFAULT_ULIMITS = {"nofile": 1048576, "nproc": 32768}
_RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC}
APT_SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
FALLBACK_MIRROR = "http://deb.debian.org/debian"
BUILD_LOCK_TIMEOUT_S = 3600.0
PODMAN_FIX = "install podman: apt-get install podman runc uidmap (or scripts/bootstrap.sh --test)"


class ImageError(SimError):
    """The test image or podman's configuration could not be made (one line: what, stderr tail)."""


# ----------------------------------------------------------------------------- podman settings

def ulimit_values() -> dict[str, int]:
    """The default_ulimits to ask for (pure but for getrlimit): podman's default, capped at
    this process's soft limit (soft <= hard), the same value as soft and hard."""
    out = {}
    for name, default in PODMAN_DEFAULT_ULIMITS.items():
        soft, _hard = resource.getrlimit(_RLIMITS[name])
        out[name] = default if soft == resource.RLIM_INFINITY else min(default, soft)
    return out


def containers_conf_text(ulimits: Mapping[str, int]) -> str:
    """containers.conf for this machine: runc + cgroupfs, rlimits no higher than ours (pure)."""
    limits = ", ".join(f'"{k}={v}:{v}"' for k, v in sorted(ulimits.items()))
    return ("# written by ddplaunch.sim.image: runc + cgroupfs (crun fails on hybrid cgroups, no\n"
            "# systemd here), rlimits at or below the caller's (no CAP_SYS_RESOURCE to raise them)\n"
            "[containers]\n"
            f"default_ulimits = [{limits}]\n"
            "\n[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n')


def write_containers_conf(path: Path | None = None, ulimits: Mapping[str, int] | None = None) -> Path:
    """Write the containers.conf (default WORK_DIR/containers.conf) atomically, so concurrent
    callers and running podmans never read half a file; returns its path."""
    path = path or WORK_DIR / "containers.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = containers_conf_text(ulimit_values() if ulimits is None else ulimits)
    try:
        if path.read_text() == text:
            return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=".containers.conf.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)   # sessions of other users (sim hosts' job users) read it too
    os.replace(tmp, path)
    return path


def podman_env(conf: Path | None = None) -> dict[str, str]:
    """The environment additions podman needs here: {"CONTAINERS_CONF": <written conf>}."""
    return {"CONTAINERS_CONF": str(write_containers_conf(conf))}


def podman_run_argv(image: str, argv: Sequence[str], *, extra: Sequence[str] = ()) -> list[str]:
    """`podman run --rm --network host --ipc host [extra] IMAGE ARGV` (pure); run it with
    `podman_env()` (through ssh: prefix it with `podman_shell_env()`)."""
    return ["podman", "run", "--rm", "--network", "host", "--ipc", "host", *extra, image, *argv]


def podman_shell_env(conf: Path | None = None) -> str:
    """`CONTAINERS_CONF=/path` for a remote shell command line (quoted)."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in podman_env(conf).items())


# ----------------------------------------------------------------------------- subprocesses

def _tail(text: str, lines: int = 3, width: int = 400) -> str:
    got = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return (" | ".join(got) or "no output")[-width:]


def _run(argv: Sequence[str], what: str, timeout: float, *, env: Mapping[str, str] | None = None,
         ok: tuple[int, ...] = (0,)) -> str:
    """Run `argv` in its own process group; its stdout. On a timeout the whole group is killed.

    Raises:
        ImageError: `what` failed: not found, timed out, or exited non-zero (with stderr tail).
    """
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
    except FileNotFoundError as exc:
        raise ImageError(f"{what}: command not found: {argv[0]}") from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise ImageError(f"{what} timed out after {timeout:g}s: {_tail(err or out)}") from None
    except BaseException:  # Ctrl-C: leave nothing running behind us
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode not in ok:
        raise ImageError(f"{what} failed (exit {proc.returncode}): {_tail(err or out)}")
    return out


def image_exists(name: str = DEFAULT_IMAGE) -> bool:
    """`podman image exists NAME` (exit 0 yes, 1 no).

    Raises:
        ImageError: podman is missing or answered something else.
    """
    if shutil.which("podman") is None:
        raise ImageError(f"podman not found: {PODMAN_FIX}")
    proc = subprocess.run(["podman", "image", "exists", name], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **podman_env()})
    if proc.returncode not in (0, 1):
        raise ImageError(f"podman image exists {name} failed (exit {proc.returncode}): {_tail(proc.stderr)}")
    return proc.returncode == 0


# ----------------------------------------------------------------------------- the build

def apt_mirror(sources: Sequence[Path] = APT_SOURCES) -> str:
    """The first Debian (not security) URI of this machine's apt sources, deb822 or one-line."""
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^\s*URIs:\s*(\S+)", text, re.M) + \
                re.findall(r"^\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            if "security" not in uri:
                return uri
    return FALLBACK_MIRROR


@contextmanager
def build_lock(timeout: float = BUILD_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold WORK_DIR/build.lock (flock): a second caller waits for the first build to end."""
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    path = WORK_DIR / "build.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    print(f"ddplaunch image: waiting for {path} (another build runs)", file=sys.stderr, flush=True)
                    told = True
                if time.monotonic() > deadline:
                    raise ImageError(f"another process holds {path} for more than {timeout:g}s") from None
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)   # releases the flock


def ensure_test_image(name: str = DEFAULT_IMAGE, *, verbose: bool = False) -> str:
    """The image name; builds the image first when `podman image exists` says it is missing
    (several minutes, ~1.3 GB). Safe with concurrent callers: one builds, the rest wait on
    the build lock and then find it.

    Raises:
        ImageError: podman/debootstrap missing, or a build step failed (what, stderr tail).
    """
    if image_exists(name):
        return name
    with build_lock():
        if not image_exists(name):      # the caller before us may have built it meanwhile
            build_image(name, verbose=verbose)
    return name


def build_image(name: str = DEFAULT_IMAGE, *, verbose: bool = False) -> float:
    """Build and import the image unconditionally (callers hold `build_lock`); the seconds taken.
    Everything is made in a temp dir under WORK_DIR that is removed afterwards, also on errors."""
    for tool, fix in (("debootstrap", "apt-get install debootstrap"), ("podman", PODMAN_FIX),
                      (HOST_PYTHON, "apt-get install python3-venv (Debian's python3.11)")):
        if shutil.which(tool) is None:
            raise ImageError(f"cannot build {name}: {tool} not found: {fix}")
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=WORK_DIR))
    try:
        rootfs = tmp / "rootfs"
        steps = [("debootstrap", lambda: _debootstrap(rootfs)), ("venv", lambda: _make_venv(rootfs)),
                 ("finish", lambda: _finish_rootfs(rootfs, name)), ("import", lambda: _import(rootfs, name))]
        for step, fn in steps:
            t = time.monotonic()
            fn()
            if verbose:
                print(f"ddplaunch image: {step} {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
    finally:
        _remove_tree(tmp)
    return time.monotonic() - t0


def _debootstrap(rootfs: Path) -> None:
    # in a private mount namespace: the proc/sys mounts debootstrap makes inside the rootfs
    # vanish with it, whatever way it ends (a timeout, a kill), and never reach the host
    _run(["unshare", "--mount", "--propagation", "private", "debootstrap", "--variant=minbase",
          "--include=python3,python3-venv", SUITE, str(rootfs), apt_mirror()],
         "debootstrap", timeout=1800, env={"DEBIAN_FRONTEND": "noninteractive"})
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / junk).glob("*"):
            if p.is_file():
                p.unlink()


def _make_venv(rootfs: Path) -> None:
    """The venv at ROOTFS/opt/imgvenv, made and filled by this machine's python and pip, then
    made to work at /opt/imgvenv: script shebangs and activate files rewritten, .pyc files
    compiled with their in-image paths."""
    venv = rootfs / IMAGE_VENV.lstrip("/")
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([HOST_PYTHON, "-m", "venv", str(venv)], "python3.11 -m venv", timeout=300)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", TORCH_REQUIREMENT, "numpy"],
         f"pip install {TORCH_REQUIREMENT} numpy", timeout=2400)
    old = str(venv)
    for path in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old.encode() in data[:65536] and b"\0" not in data[:1024]:   # text: scripts, activate*
            path.write_bytes(data.replace(old.encode(), IMAGE_VENV.encode()))
    # exit 1: some files did not compile (torch ships test files in newer syntax); pip ignores
    # those too, and Python compiles nothing at import time that failed here
    _run([HOST_PYTHON, "-m", "compileall", "-q", "-j", "0", "-s", str(rootfs), str(venv / "lib")],
         "compileall of the venv", timeout=1800, ok=(0, 1))


def _finish_rootfs(rootfs: Path, name: str) -> None:
    marker = rootfs / IMAGE_MARKER.lstrip("/")
    marker.write_text(f"ddplaunch test image {name}\n{TORCH_REQUIREMENT}\nvenv {IMAGE_VENV}\n"
                      f"built {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")


def _import(rootfs: Path, name: str) -> None:
    # /dev, /proc and /sys are the runtime's to fill; their mount points stay in the tar
    script = (f"set -o pipefail; tar -C {shlex.quote(str(rootfs))} --numeric-owner "
              "--exclude=./dev/* --exclude=./proc/* --exclude=./sys/* -cf - . "
              f"| podman import --change 'CMD=[\"/bin/bash\"]' - {shlex.quote(name)}")
    _run(["bash", "-c", script], f"tar | podman import {name}", timeout=1800, env=podman_env())


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = [ln.split()[4].encode().decode("unicode_escape") for ln in lines]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    """rm -rf `path`, but never through a mount left inside it (unmounted first, deepest first;
    refused when one stays): rmtree through a bind of /dev or /proc would hit the host."""
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)
    left = _mounts_under(path)
    if left:
        raise ImageError(f"build dir {path} still has mounts ({left[0]}): unmount them, then rm -rf {path}")
    shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ddplaunch.sim.image [NAME]`: build if missing, print the image name."""
    args = list(sys.argv[1:] if argv is None else argv)
    t0 = time.monotonic()
    try:
        name = ensure_test_image(args[0] if args else DEFAULT_IMAGE, verbose=True)
    except SimError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    print(name)
    print(f"ddplaunch image: ready in {time.monotonic() - t0:.1f}s; run it with "
          f"{podman_shell_env()} {shlex.join(podman_run_argv(name, [IMAGE_VENV + '/bin/python', '-V']))}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
