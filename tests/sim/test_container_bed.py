"""The real-container test bed: the test image (ddplaunch/sim/image.py) builds or is found,
podman runs it on this machine and, through real SSH, on sim hosts (runc + cgroupfs and
rlimits from its containers.conf), and torchrun inside it completes a gloo all_reduce across two
sim hosts (`--network host`: the sim host's own address). What the launcher's container support
stands on; podman is real, nothing is faked. Two ranks in one container on each sim host are
tests/backends/test_containers.py's (`up` of 3 hosts x 2 inside the image, its health check's all_reduce).
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ddplaunch.sim.image import (DEFAULT_IMAGE, IMAGE_MARKER, IMAGE_VENV, apt_mirror, build_lock, containers_conf_text,
                                 ensure_test_image, podman_env, podman_run_argv, podman_shell_env, ulimit_values)
from ddplaunch.sim.testing import ssh_client
from tests.simfixture import podman_skip_reason, real_system

PY = f"{IMAGE_VENV}/bin/python"
PROBE = 'import torch, os; print(torch.__version__, os.path.exists("/etc/ddplaunch-test-image"))'
ALLREDUCE_JOB = """\
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
x = torch.full((1024,), float(r + 1))
dist.all_reduce(x)
ok = bool(torch.all(x == w * (w + 1) / 2))
# one write per line: the ranks share one stdout, and print() writes text and newline apart
os.write(1, f"ALLREDUCE rank={r} world={w} ok={ok} host={socket.gethostname()} "
            f"image={os.path.exists('/etc/ddplaunch-test-image')}\\n".encode())
dist.destroy_process_group()
"""


def _podman_cmd(image: str, argv: list[str], extra: list[str] | None = None) -> str:
    """The shell command line that runs `argv` in `image` on a sim host (or here)."""
    return f"{podman_shell_env()} {shlex.join(podman_run_argv(image, argv, extra=extra or []))}"


def _ssh(cluster, host: str, command: str, timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `command` on `host` over real SSH."""
    client = ssh_client(cluster, host)
    try:
        _, stdout, stderr = client.exec_command(command, timeout=timeout)
        out, err = stdout.read().decode(), stderr.read().decode()
        return stdout.channel.recv_exit_status(), out, err
    finally:
        client.close()


def _rm_containers(names: list[str]) -> None:
    """Remove our named containers (one left by a timed-out SSH session keeps running)."""
    subprocess.run(["podman", "rm", "-f", "--time", "0", "--ignore", *names], capture_output=True, timeout=60,
                   env={**os.environ, **podman_env()})


def _name(tag: str) -> str:
    return f"ddpl-bed-{tag}-{os.getpid()}-{random.randrange(1 << 30):x}"


# ----------------------------------------------------------------------------- pure parts

def test_containers_conf_asks_for_runc_cgroupfs_and_no_more_than_our_limits():
    import resource

    text = containers_conf_text({"nofile": 1024, "nproc": 4096})
    assert 'runtime = "runc"' in text and 'cgroup_manager = "cgroupfs"' in text
    assert 'default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]' in text
    limits = ulimit_values()
    for name, rl in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft = resource.getrlimit(rl)[0]
        assert 0 < limits[name] and (soft == resource.RLIM_INFINITY or limits[name] <= soft)


def test_apt_mirror_reads_deb822_and_one_line_sources(tmp_path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://security.example/debian-security\n\n"
                      "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n")
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb [arch=amd64] http://other.example/debian bookworm main\n")
    assert apt_mirror([tmp_path / "missing", deb822]) == "http://mirror.example/debian"
    assert apt_mirror([one_line]) == "http://other.example/debian"
    assert apt_mirror([tmp_path / "missing"]) == "http://deb.debian.org/debian"


def test_a_second_builder_waits_for_the_build_lock(tmp_path, monkeypatch):
    import ddplaunch.sim.image as image_mod

    monkeypatch.setattr(image_mod, "WORK_DIR", tmp_path)
    code = ("import sys, ddplaunch.sim.image as m\nfrom pathlib import Path\nm.WORK_DIR = Path(sys.argv[1])\n"
            "with m.build_lock(timeout=0.3): print('GOT IT')\n")
    with build_lock():   # held here: another process waits, then gives up with one clear line
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "GOT IT" not in proc.stdout
    assert f"another process holds {tmp_path / 'build.lock'} for more than 0.3s" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "GOT IT", proc.stderr   # free again once the holder let go


def test_two_concurrent_callers_build_the_image_once(tmp_path):
    """ensure_test_image in two processes at once, the image missing: one builds, the other
    waits on the lock, finds the image and builds nothing (podman and the build are stubbed)."""
    code = ("import sys, time, ddplaunch.sim.image as m\nfrom pathlib import Path\n"
            "d = Path(sys.argv[1]); m.WORK_DIR = d\n"
            "m.image_exists = lambda name: (d / 'image').exists()\n"
            "def build(name, verbose=False):\n"
            "    with open(d / 'builds', 'a') as f: f.write(sys.argv[2] + '\\n')\n"
            "    time.sleep(1.5); (d / 'image').write_text(name)\n"
            "m.build_image = build\nprint(m.ensure_test_image('localhost/x:y'))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["localhost/x:y"] * 2
    assert len((tmp_path / "builds").read_text().split()) == 1


# ----------------------------------------------------------------------------- real podman

@real_system(podman_skip_reason())
@pytest.mark.slow
def test_the_image_is_there_and_only_the_image_has_its_venv_and_marker(image):
    assert image == DEFAULT_IMAGE
    assert subprocess.run(["podman", "image", "exists", image], env={**os.environ, **podman_env()},
                          timeout=60).returncode == 0
    # the proof that a passing test ran inside the image: this machine has neither path
    assert not Path(IMAGE_VENV).exists() and not Path(IMAGE_MARKER).exists()
    assert ensure_test_image(image) == image   # found, not rebuilt


@real_system(podman_skip_reason())
@pytest.mark.slow
def test_podman_runs_torch_in_the_image_here(image):
    name = _name("local")
    argv = podman_run_argv(image, [PY, "-c", PROBE], extra=["--name", name])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **podman_env()})
    finally:
        _rm_containers([name])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2.13.0+cpu", "True"], proc.stdout + proc.stderr[-2000:]


@pytest.mark.slow
def test_podman_runs_torch_in_the_image_on_a_sim_host_with_its_network(sim_cluster, image):
    host, peer = sim_cluster.hosts[1], sim_cluster.hosts[0]
    # the source address toward a peer shows whose network the container uses
    code = (PROBE + "; import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"s.connect(('{peer.addr}', 9)); print(socket.gethostname(), s.getsockname()[0])")
    name = _name("ssh")
    try:
        rc, out, err = _ssh(sim_cluster, host.name, _podman_cmd(image, [PY, "-c", code], ["--name", name]),
                            timeout=120)
    finally:
        _rm_containers([name])
    assert rc == 0, err[-2000:]
    assert out.split() == ["2.13.0+cpu", "True", host.name, host.addr], out + err[-2000:]


def _allreduce_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("ALLREDUCE ")]


@pytest.mark.slow
def test_all_reduce_between_containers_on_two_sim_hosts(sim_cluster, image, tmp_path):
    """One rank per host, each in its own container on its own sim host: gloo crosses the
    sim network from container to container. The sim's nsswitch.conf is bound in, so the
    ranks print no c10d `err=-3` lines (the image's `hosts: files dns` would ask a dead DNS)."""
    (tmp_path / "job.py").write_text(ALLREDUCE_JOB)
    hosts = sim_cluster.hosts[:2]
    port = random.randrange(41000, 42000)
    names = [_name(f"node{i}") for i in range(2)]
    results: dict[int, tuple[int, str, str]] = {}

    def node(i: int) -> None:
        extra = ["--name", names[i], "-e", f"GLOO_SOCKET_IFNAME={sim_cluster.ifname}", "-v", f"{tmp_path}:/job:ro",
                 "-v", "/etc/nsswitch.conf:/etc/nsswitch.conf:ro"]
        cmd = _podman_cmd(image, [f"{IMAGE_VENV}/bin/torchrun", "--nnodes", "2", "--node-rank", str(i),
                                  "--nproc-per-node", "1", "--master-addr", hosts[0].addr, "--master-port",
                                  str(port), "--rdzv-conf", "timeout=60", "/job/job.py"], extra)
        try:
            results[i] = _ssh(sim_cluster, hosts[i].name, cmd, timeout=240)
        except Exception as exc:  # noqa: BLE001  (reported by the asserts below)
            results[i] = (-1, "", repr(exc))

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        _rm_containers(names)
    for i in range(2):
        rc, out, err = results.get(i, (-1, "", "no result"))
        assert rc == 0, f"node {i}: {(out + err)[-3000:]}"
        assert "err=-3" not in err, err[-2000:]
    lines = sorted(ln for i in range(2) for ln in _allreduce_lines(results[i][1]))
    assert lines == [f"ALLREDUCE rank={r} world=2 ok=True host={hosts[r].name} image=True" for r in (0, 1)], lines
