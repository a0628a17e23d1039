"""The sim cluster: pure parts without root, then real hosts (namespaces + sshd) as root.

Real-host tests share the session cluster (dlt1..dlt4) from simfixture; each fault test uses
its own host and clears its fault. The lifecycle test builds a second, private cluster.
"""

import json
import os
import pwd
import random
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest
import yaml
from click.testing import CliRunner

from ddplaunch.sim import (RC_NOISE_STDERR, RC_NOISE_STDOUT, Naming, SimCluster, SimConfig, SimError, SimHost,
                           check_state_dir, simcli as sim_cli, load_cluster, render_spec, secure_state_dir, sim_down,
                           sim_fault, sim_status, sim_up)
from ddplaunch.sim.cluster import noisy_rc_text
from ddplaunch.sim.netns import nsswitch_text, pids_by_netns
from ddplaunch.sim.proc import pid_alive, wait_until
from ddplaunch.sim.sshd import sshd_config_text
from ddplaunch.sim.statedir import prefix_lock
from ddplaunch.sim.testing import is_listening, shared_cluster, ssh_client, ssh_run, wait_listening
from tests.simfixture import real_system, sim_cluster, sim_skip_reason  # noqa: F401  (fixture)
from tests.timing import no_hang

LIFECYCLE_PREFIX = os.environ.get("DDPLAUNCH_TEST_PREFIX2", "dlx")
LIFECYCLE_SUBNET = os.environ.get("DDPLAUNCH_TEST_SUBNET2", "10.213.8.0/24")
needs_sim = real_system(sim_skip_reason())
needs_root = real_system(None if os.geteuid() == 0 else "needs root (chown to another user)")


# ----------------------------------------------------------------------------- pure parts

def test_naming_derives_short_names_and_addresses():
    n = Naming.parse("dls", "10.213.0.0/24")
    assert (n.bridge, n.ifname, n.ns(3), n.veth(3), str(n.addr(3)), str(n.bridge_addr)) == \
        ("dlsbr0", "dls0", "dls3", "dls3h", "10.213.0.13", "10.213.0.1")
    longest = Naming.parse("abcdefghij", "10.0.0.0/16")
    assert len(longest.veth(longest.max_hosts)) <= 15
    assert n.owns_netns("dls12") and not n.owns_netns("dlsx1") and not n.owns_netns("dls")
    assert n.owns_link("dls2h") and n.owns_link("dlsbr0") and not n.owns_link("dls2hx")


@pytest.mark.parametrize("prefix,subnet", [("Dls", "10.0.0.0/24"), ("dls1", "10.0.0.0/24"),
                                           ("waytoolongprefix", "10.0.0.0/24"), ("dls", "10.0.0.0/29"),
                                           ("dls", "not-a-net")])
def test_naming_rejects_bad_input(prefix, subnet):
    with pytest.raises(SimError):
        Naming.parse(prefix, subnet)


def _fake_cluster(tmp_path):
    hosts = [SimHost(i, f"dls{i}", f"10.213.0.{10 + i}", f"dls{i}") for i in (1, 2)]
    return SimCluster("dls", "10.213.0.0/24", tmp_path, hosts, "dlsbr0", "dls0", tmp_path / "client_key",
                      tmp_path / "known_hosts", tmp_path / "cluster.yaml", tmp_path / "etc/hosts",
                      tmp_path / "etc/resolv.conf")


def test_render_spec_has_the_agreed_keys(tmp_path):
    text = render_spec(_fake_cluster(tmp_path), python="/venv/bin/python", workdir=Path("/work/x y"))
    spec = yaml.safe_load(text)
    assert text.startswith("# written by `ddplaunch sim up`")
    assert spec["hosts"] == [{"addr": "10.213.0.11", "name": "dls1"}, {"addr": "10.213.0.12", "name": "dls2"}]
    assert spec["workdir"] == "/work/x y" and spec["socket_ifname"] == "dls0"
    assert spec["ssh"] == {"user": "root", "key": str(tmp_path / "client_key"),
                           "known_hosts": str(tmp_path / "known_hosts"), "host_key_policy": "strict",
                           "connect_timeout": 5}
    assert spec["healthcheck"] == {"pair_parallelism": 1}  # sim hosts share the CPUs
    assert spec["preflight"] == {"timeout": 15}  # 2 hosts; 90 s at 128 (their probes share the CPUs)
    assert list(spec) == ["name", "backend", "hosts", "nproc_per_node", "python", "workdir",
                          "dist_backend", "socket_ifname", "rdzv_timeout", "healthcheck", "ssh", "preflight",
                          "job"]


def test_exec_argv_enters_with_nsenter_not_ip_netns_exec(tmp_path):
    argv = _fake_cluster(tmp_path).exec_argv("10.213.0.12", ["hostname"])
    assert argv[:2] == ["nsenter", "--net=/run/netns/dls2"] and argv[-2:] == ["dls2", "hostname"]
    assert "--uts" in argv and "--mount" in argv and "netns" not in argv[:2]
    with pytest.raises(SimError, match="valid hosts are dls1"):
        _fake_cluster(tmp_path).exec_argv("dls9", ["true"])


def test_sshd_config_has_the_testbed_settings(tmp_path):
    text = sshd_config_text(addr="10.0.0.11", host_key=tmp_path / "k", pid_file=tmp_path / "p",
                            authorized_keys=tmp_path / "a")
    for line in ("ListenAddress 10.0.0.11", "UsePAM no", "StrictModes no", "PasswordAuthentication no",
                 "PermitRootLogin prohibit-password", "MaxStartups 256:30:512", "MaxSessions 64"):
        assert line in text.splitlines()
    assert "PerSourcePenalties no" not in text
    assert "PerSourcePenalties no" in sshd_config_text(addr="10.0.0.11", host_key=tmp_path / "k",
                                                       pid_file=tmp_path / "p", authorized_keys=tmp_path / "a",
                                                       penalties_off=True).splitlines()


def test_every_session_setting_is_on_the_one_setenv_line_sshd_reads(tmp_path):
    """sshd takes the first SetEnv line and ignores later ones: a clean HOME on a second line was
    never set (every session read root's ~/.bashrc)."""
    paths = dict(addr="10.0.0.11", host_key=tmp_path / "k", pid_file=tmp_path / "p", authorized_keys=tmp_path / "a")
    text = sshd_config_text(**paths, set_env=["CONTAINERS_CONF=/c.conf", "HOME=/h"])
    assert [line for line in text.splitlines() if line.startswith("SetEnv")] == ["SetEnv CONTAINERS_CONF=/c.conf HOME=/h"]
    assert not [line for line in sshd_config_text(**paths).splitlines() if line.startswith("SetEnv")]
    with pytest.raises(ValueError, match="without white space"):
        sshd_config_text(**paths, set_env=["HOME=/a b"])


def test_nsswitch_asks_only_the_hosts_file_and_keeps_the_rest():
    text = nsswitch_text("passwd: files systemd\nhosts:          files mdns4_minimal dns\nnetworks: files\n")
    lines = text.splitlines()
    assert [ln for ln in lines if ln.startswith("hosts")] == ["hosts:          files"]
    assert "passwd: files systemd" in lines and "networks: files" in lines


def test_noisy_rc_talks_first_and_then_runs_the_original():
    text = noisy_rc_text("export FOO=1\n")
    lines = text.splitlines()
    assert lines.index(f"echo '{RC_NOISE_STDOUT}'") < lines.index("export FOO=1")
    assert f"echo '{RC_NOISE_STDERR}' >&2" in lines and text.endswith("export FOO=1\n")


# ----------------------------------------------------------------------------- the state dir

def test_fresh_state_dir_is_private_and_ours(tmp_path):
    d = tmp_path / "new" / "st"
    assert secure_state_dir(d) is True
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert secure_state_dir(d, 0o711) is False  # ours already: accepted, traversal-only for munge
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o711


@needs_root
def test_state_dir_of_another_user_is_refused(tmp_path):
    d = tmp_path / "planted"
    d.mkdir(mode=0o700)
    (d / "authorized_keys").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPlanted attacker\n")
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(d, nobody, -1)
    with pytest.raises(SimError, match=r"refusing sim state dir .*planted: it belongs to user 'nobody'.*rm -rf"):
        secure_state_dir(d)
    assert os.lstat(d).st_uid == nobody and stat.S_IMODE(os.lstat(d).st_mode) == 0o700  # untouched
    with pytest.raises(SimError, match="belongs to user 'nobody'"):
        load_cluster(d)  # nor is a state file in it ever read


def test_state_dir_symlink_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(SimError, match=f"refusing sim state dir {link}: it is a symlink"):
        secure_state_dir(link)
    with pytest.raises(SimError, match="symlink"):
        check_state_dir(link)


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777])
def test_state_dir_writable_by_others_is_refused(tmp_path, mode):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(SimError, match=f"writable by group or others \\(mode {mode:04o}\\)"):
        secure_state_dir(d)
    assert stat.S_IMODE(os.lstat(d).st_mode) == mode  # refused, not "fixed"


def test_state_dir_under_a_parent_others_can_write_is_refused(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)  # not sticky: anyone could rename our dir away and put theirs there
    with pytest.raises(SimError, match="its parent .*shared"):
        secure_state_dir(parent / "st")
    assert not (parent / "st").exists()
    os.chmod(parent, 0o1777)  # sticky, like /tmp: fine
    assert secure_state_dir(parent / "st") is True


@needs_root
def test_lock_file_of_another_user_is_refused():
    suffix = f"locktest{os.getpid()}"
    path = Path(f"/tmp/ddplaunch-sim-{LIFECYCLE_PREFIX}.{suffix}")
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
        # refused either by us (owner check) or, with fs.protected_regular, by the kernel
        with pytest.raises(SimError, match="belongs to user 'nobody'|if another user created it"):
            with prefix_lock(LIFECYCLE_PREFIX, suffix):
                pass
    finally:
        path.unlink(missing_ok=True)


def test_lock_file_symlink_is_never_followed(tmp_path):
    suffix = f"linktest{os.getpid()}"
    path = Path(f"/tmp/ddplaunch-sim-{LIFECYCLE_PREFIX}.{suffix}")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path.unlink(missing_ok=True)
    path.symlink_to(victim)
    try:
        with pytest.raises(SimError, match="cannot open the sim lock file"):
            with prefix_lock(LIFECYCLE_PREFIX, suffix):
                pass
        assert victim.read_text() == "precious\n"
    finally:
        path.unlink(missing_ok=True)


def test_cli_needs_root_and_one_fault_action(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    res = CliRunner().invoke(sim_cli.sim_group, ["up", "--hosts", "2", "--state-dir", str(tmp_path)])
    assert res.exit_code == 2 and "needs root" in res.output and len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(sim_cli.sim_group, ["fault", "dls1", "--down", "--clear"])
    assert res.exit_code == 2 and "exactly one of" in res.output


# ----------------------------------------------------------------------------- real hosts

@needs_sim
def test_hosts_have_own_hostnames_and_addresses(sim_cluster):
    c = sim_cluster
    assert [c.run(h, ["hostname"]).stdout.strip() for h in c.hosts] == [h.name for h in c.hosts]
    addrs = [c.run(h, ["ip", "-4", "-o", "addr", "show", "dev", c.ifname]).stdout.split()[3] for h in c.hosts]
    assert len(set(addrs)) == len(c.hosts)
    assert [a.split("/")[0] for a in addrs] == c.addrs
    spec = yaml.safe_load(c.spec_path.read_text())
    assert [h["addr"] for h in spec["hosts"]] == c.addrs and spec["ssh"]["key"] == str(c.key)


@needs_sim
def test_real_ssh_with_strict_known_hosts(sim_cluster, tmp_path):
    c = sim_cluster
    assert len(c.known_hosts.read_text().splitlines()) == len(c.hosts)
    for h in c.hosts:
        assert ssh_run(c, h.name, "hostname") == (0, h.name + "\n")
    # a client without the sim's known_hosts is refused by RejectPolicy
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.SSHException):
        client.connect(c.hosts[0].addr, username="root", key_filename=str(c.key), look_for_keys=False,
                       allow_agent=False, timeout=5)
    client.close()


@needs_sim
def test_hosts_reach_each_other_but_nothing_else(sim_cluster):
    c = sim_cluster
    a, b = c.hosts[0], c.hosts[1]
    server = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
              "s.bind(('0.0.0.0', 47001)); s.listen(1); c, _ = s.accept();"
              "c.sendall(socket.gethostname().encode()); c.close()")
    proc = subprocess.Popen(c.exec_argv(b, [sys.executable, "-c", server]))
    try:
        wait_listening(c, b.name, 47001)
        client = f"import socket; print(socket.create_connection(('{b.name}', 47001), timeout=5).recv(64).decode())"
        assert c.run(a, [sys.executable, "-c", client]).stdout.strip() == b.name
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
    assert c.run(a, ["ip", "route", "show", "default"]).stdout.strip() == ""
    outside = "import socket; socket.create_connection(('192.0.2.1', 80), timeout=3)"
    res = c.run(a, [sys.executable, "-c", outside], check=False)
    assert res.returncode != 0 and "unreachable" in res.stderr.lower()


@needs_sim
def test_unknown_name_fails_fast_and_known_names_resolve(sim_cluster):
    c = sim_cluster
    t0 = time.monotonic()
    res = c.run(c.hosts[0], ["getent", "hosts", "no-such-host.example"], check=False)
    assert res.returncode != 0
    no_hang(time.monotonic() - t0, 3.0, "an unknown name fails at once: no resolver's 5 s timeout is waited")
    assert c.run(c.hosts[0], ["getent", "hosts", c.hosts[2].name]).stdout.split()[0] == c.hosts[2].addr


@needs_sim
def test_fault_down_breaks_ssh_and_clear_restores_it(sim_cluster):
    c, h = sim_cluster, sim_cluster.hosts[2]
    try:
        sim_fault(c, h.name, down=True)
        t0 = time.monotonic()
        with pytest.raises((OSError, paramiko.SSHException)):
            ssh_client(c, h.name, timeout=2).close()
        no_hang(time.monotonic() - t0, 8.0, "a connection to a downed host ends at its 2 s timeout (no reset)")
        assert [s.link for s in sim_status(c.state_dir) if s.name == h.name] == ["down"]
    finally:
        sim_fault(c, h.name, clear=True)
    assert ssh_run(c, h.name, "hostname")[1].strip() == h.name


def _iperf_gbits(c, client, server):
    """TCP throughput client -> server for 1 s with iperf3 (server started and ended here)."""
    port = 5201
    proc = subprocess.Popen(c.exec_argv(server, ["iperf3", "-s", "-B", server.addr, "-p", str(port)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(c, server.name, port)
        out = c.run(client, ["iperf3", "-c", server.addr, "-p", str(port), "-t", "1", "-J"], timeout=15).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9
    finally:
        proc.terminate()
        proc.wait(timeout=5)


@needs_sim
@pytest.mark.skipif(not os.path.exists("/usr/bin/iperf3"), reason="needs iperf3 (apt-get install iperf3)")
def test_fault_rate_shapes_both_directions(sim_cluster):
    c = sim_cluster
    src, shaped, free = c.hosts[0], c.hosts[1], c.hosts[3]
    try:
        sim_fault(c, shaped.name, rate="1gbit")
        inner = c.run(shaped, ["tc", "qdisc", "show", "dev", c.ifname, "root"]).stdout
        outer = subprocess.run(["tc", "qdisc", "show", "dev", c.naming.veth(shaped.index), "root"],
                               capture_output=True, text=True, check=True, timeout=5).stdout
        assert "tbf" in inner and "tbf" in outer and "rate 1Gbit" in inner
        slow = _iperf_gbits(c, src, shaped)
        fast = 0.0
        for _ in range(3):  # the unshaped rate is CPU-bound on a shared box: best of up to 3 runs
            fast = max(fast, _iperf_gbits(c, src, free))
            if fast >= 3 * slow:
                break
        assert fast >= 3 * slow, f"shaped {slow:.2f} Gbit/s vs unshaped {fast:.2f} Gbit/s"
    finally:
        sim_fault(c, shaped.name, clear=True)
    assert "tbf" not in c.run(shaped, ["tc", "qdisc", "show", "dev", c.ifname]).stdout


#: CPU seconds a burn spends; its wall time says how much CPU the host's processes get.
BURN = ("import time; w, c = time.monotonic(), time.process_time()\n"
        "while time.process_time() - c < 0.3: pass\n"
        "print(time.monotonic() - w)")


def _burn_wall(c, host: str) -> float:
    """Wall seconds 0.3 CPU-s take in a process the host's sshd starts (it inherits the host's cgroup)."""
    code, out = ssh_run(c, host, f"{sys.executable} -c {shlex.quote(BURN)}", timeout=60)
    assert code == 0, out
    return float(out.strip().splitlines()[-1])


@needs_sim
def test_fault_slow_limits_every_process_of_the_host_and_clear_lifts_it(sim_cluster):
    """--slow 10: the host's processes together get a tenth of a CPU, so a burn of 0.3 CPU-s
    takes at least ~3 s there; on a host beside it, measured in the same test, far less."""
    c, slowed, free = sim_cluster, sim_cluster.hosts[2], sim_cluster.hosts[3]
    try:
        sim_fault(c, slowed.name, slow=10)
        assert c.host(slowed.name).fault.describe() == "slowed to 10% of a CPU"
        throttled, normal = _burn_wall(c, slowed.name), _burn_wall(c, free.name)
        assert throttled >= 2.0 and throttled >= 2 * normal, (throttled, normal)
    finally:
        sim_fault(c, slowed.name, clear=True)
    assert not list(Path("/sys/fs/cgroup").glob(f"*/ddplaunch-sim-{c.prefix}-*")) and \
        not list(Path("/sys/fs/cgroup").glob(f"ddplaunch-sim-{c.prefix}-*"))
    after = _burn_wall(c, slowed.name)
    assert after < throttled / 2, (after, throttled)


LISTEN = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
          "s.bind(('', int(sys.argv[1]))); s.listen(8); s.settimeout(20)\n"
          "while True:\n  c, _ = s.accept(); c.close()")


def _connects(c, from_host, addr: str, port: int) -> bool:
    """Whether a TCP connection from `from_host` (None: this machine) to addr:port is accepted."""
    probe = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=2).close()"
    argv = [sys.executable, "-c", probe]
    proc = c.run(from_host, argv, check=False, timeout=20) if from_host else \
        subprocess.run(argv, capture_output=True, timeout=20)
    return proc.returncode == 0


@needs_sim
def test_fault_cut_training_drops_host_to_host_traffic_but_sshd_and_the_launcher(sim_cluster):
    c, cut, peer = sim_cluster, sim_cluster.hosts[1], sim_cluster.hosts[0]
    port = 29311
    listener = subprocess.Popen(c.exec_argv(cut, [sys.executable, "-c", LISTEN, str(port)]))
    try:
        wait_listening(c, cut.name, port, timeout=20)
        sim_fault(c, cut.name, cut_training=True)
        assert c.host(cut.name).fault.describe() == "training traffic cut"
        assert not _connects(c, peer, cut.addr, port)          # a peer: dropped
        assert _connects(c, peer, cut.addr, 22)                # its sshd: answers
        assert _connects(c, None, cut.addr, port)              # the launcher: untouched
        sim_fault(c, cut.name, clear=True)
        assert _connects(c, peer, cut.addr, port)
        assert "DDPLAUNCH_CUT" not in c.run(cut, ["iptables", "-w", "-S"]).stdout
    finally:
        sim_fault(c, cut.name, clear=True)
        listener.kill()
        listener.wait(timeout=10)


@needs_sim
def test_fault_sshd_stop_stops_exactly_that_sshd(sim_cluster):
    c, h = sim_cluster, sim_cluster.hosts[3]
    before = {x.name: x.sshd_pid for x in c.hosts}
    try:
        sim_fault(c, h.name, sshd_stop=True)
        assert not pid_alive(before[h.name])
        assert all(pid_alive(p) for n, p in before.items() if n != h.name)
        with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError):
            ssh_client(c, h.name, timeout=3)
    finally:
        sim_fault(c, h.name, clear=True)
    assert pid_alive(c.host(h.name).sshd_pid) and c.host(h.name).sshd_pid != before[h.name]
    assert ssh_run(c, h.name, "hostname")[1].strip() == h.name


def _our_netns(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=5).stdout
    return [line.split()[0] for line in out.splitlines() if Naming.parse(prefix, "10.0.0.0/24").owns_netns(line.split()[0])]


@needs_sim
def test_lifecycle_up_is_idempotent_and_down_removes_everything(tmp_path):
    cfg = SimConfig(n_hosts=2, prefix=LIFECYCLE_PREFIX, subnet=LIFECYCLE_SUBNET, state_dir=tmp_path / "st")
    bridge = Naming.parse(LIFECYCLE_PREFIX, LIFECYCLE_SUBNET).bridge
    with prefix_lock(LIFECYCLE_PREFIX, "session.lock", timeout=300):  # one such test per machine at a time
        _lifecycle(cfg, bridge)


def _lifecycle(cfg, bridge):
    try:
        first = sim_up(cfg)
        second = sim_up(cfg)  # up on a running cluster replaces it
        assert not any(pid_alive(h.sshd_pid) for h in first.hosts)
        assert all(pid_alive(h.sshd_pid) for h in second.hosts)
        (cfg.state_dir / "state.json").unlink()  # a crash: leftovers but no state file
        third = sim_up(cfg)
        assert not any(pid_alive(h.sshd_pid) for h in second.hosts)
        assert [third.run(h, ["hostname"]).stdout.strip() for h in third.hosts] == [f"{LIFECYCLE_PREFIX}1",
                                                                                    f"{LIFECYCLE_PREFIX}2"]
        assert load_cluster(cfg.state_dir).hosts == third.hosts
        res = CliRunner().invoke(sim_cli.sim_group, ["status", "--state-dir", str(cfg.state_dir)])
        assert res.exit_code == 0 and f"{LIFECYCLE_PREFIX}2" in res.output
        t0 = time.monotonic()
        down = sim_down(cfg.state_dir)
        no_hang(time.monotonic() - t0, 10, "sim down of 2 hosts waits on nothing")
        assert sorted(down.namespaces) == [f"{LIFECYCLE_PREFIX}1", f"{LIFECYCLE_PREFIX}2"]
        assert not any(pid_alive(h.sshd_pid) for h in third.hosts)
        assert _our_netns(LIFECYCLE_PREFIX) == []
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True, timeout=5).returncode != 0
        sim_down(cfg.state_dir)                         # down twice is fine
        sim_down(prefix=LIFECYCLE_PREFIX)                # down with nothing there is fine
    finally:
        sim_down(cfg.state_dir, prefix=LIFECYCLE_PREFIX)
    assert _our_netns(LIFECYCLE_PREFIX) == []


@needs_sim
def test_sim_exec_cli_runs_in_the_host(sim_cluster):
    c = sim_cluster
    # exec replaces the process, so run the real CLI module in a subprocess
    code = "import sys; from ddplaunch.sim.simcli import sim_group; sim_group(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, "exec", "--state-dir", str(c.state_dir),
                          c.hosts[1].addr, "--", "hostname"],
                         capture_output=True, text=True, timeout=15, check=True).stdout
    assert out.strip() == c.hosts[1].name


# ----------------------------------------------------------------------------- names, rc noise, CLI

@needs_sim
def test_every_sim_address_resolves_both_ways_inside_a_host(sim_cluster):
    c = sim_cluster
    gateway = str(c.naming.bridge_addr)
    pairs = [(h.addr, h.name) for h in c.hosts] + [(gateway, f"{c.prefix}gw")]
    for addr, name in pairs:
        assert c.run(c.hosts[0], ["getent", "hosts", addr]).stdout.split()[:2] == [addr, name]
    probe = ("import json, socket, sys, time\n"
             "t0 = time.monotonic(); out = {}\n"
             "for a in sys.argv[1:]:\n"
             "    out[a] = socket.gethostbyaddr(a)[0]\n"
             "    socket.getnameinfo(('::ffff:' + a, 0), 0)  # torch's peer address form; must not fail\n"
             "    out[socket.gethostbyname(out[a])] = out[a]\n"
             "print(json.dumps({'names': out, 's': time.monotonic() - t0}))\n")
    res = json.loads(c.run(c.hosts[1], [sys.executable, "-c", probe, *(a for a, _ in pairs)]).stdout)
    assert res["names"] == dict(pairs), res
    no_hang(res["s"], 2.5, "every name resolves from the host's own files, never waiting on a DNS server")


_GLOO_RANK = """
import datetime, os, sys
import torch, torch.distributed as dist
rank, master, port, ifname = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR=master, MASTER_PORT=port, GLOO_SOCKET_IFNAME=ifname)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {rank} sum {t.item()}", flush=True)
dist.destroy_process_group()
"""


@needs_sim
@pytest.mark.slow  # two `import torch` on shared cores: ~20 s
def test_gloo_across_two_hosts_prints_no_hostname_warning(sim_cluster):
    pytest.importorskip("torch")
    c = sim_cluster
    a, b = c.hosts[0], c.hosts[1]
    port = str(random.randint(20000, 28000))
    argv = [sys.executable, "-c", _GLOO_RANK]
    procs = [subprocess.Popen(c.exec_argv(h, [*argv, str(r), a.name, port, c.ifname]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, h in enumerate((a, b))]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} sum 2.0" in out, err
        assert "cannot be retrieved" not in err, err  # c10d's failed reverse lookup of its peer


def _openssh(c, host, command):
    return subprocess.run(["ssh", "-i", str(c.key), "-o", f"UserKnownHostsFile={c.known_hosts}",
                           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                           f"root@{c.host(host).addr}", command],
                          capture_output=True, text=True, timeout=30)


@needs_sim
@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
def test_rc_noise_reaches_stdout_and_stderr_of_every_ssh_session():
    with shared_cluster(2, prefix=LIFECYCLE_PREFIX, subnet=LIFECYCLE_SUBNET, rc_noise=True) as c:
        for h in c.hosts:
            res = _openssh(c, h.name, "echo hi")
            out = res.stdout.splitlines()
            assert res.returncode == 0 and out[0] == RC_NOISE_STDOUT and out[-1] == "hi", res
            assert RC_NOISE_STDERR in res.stderr.splitlines(), res
        assert ssh_run(c, c.hosts[0].name, "hostname") == (0, f"{RC_NOISE_STDOUT}\n{c.hosts[0].name}\n")
        assert c.rc_target is not None and c.rc_target.read_text() != c.rc_file.read_text()  # bound in hosts only
        with pytest.raises(SimError, match="without rc noise"):
            with shared_cluster(2, prefix=LIFECYCLE_PREFIX, subnet=LIFECYCLE_SUBNET):
                pass


def _cli(*args):
    res = CliRunner().invoke(sim_cli.sim_group, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


def _operstate(ns, dev):
    out = subprocess.run(["ip", "-j"] + (["-n", ns] if ns else []) + ["link", "show", "dev", dev],
                         capture_output=True, text=True, check=True, timeout=5).stdout
    return json.loads(out)[0]


def _root_qdisc_kind(ns, dev):
    argv = (["nsenter", f"--net=/run/netns/{ns}"] if ns else []) + ["tc", "-j", "qdisc", "show", "dev", dev, "root"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=5).stdout
    return [q["kind"] for q in json.loads(out or "[]")]


@needs_sim
def test_fault_cli_changes_the_link_qdisc_and_sshd_and_clear_undoes_it(sim_cluster):
    c = sim_cluster
    h = c.hosts[1]
    sd = c.state_dir
    veth = c.naming.veth(h.index)
    try:
        assert "link down" in _cli("fault", "--state-dir", sd, h.name, "--down")
        assert _operstate(h.ns, c.ifname)["operstate"] != "UP" and "UP" not in _operstate(None, veth)["flags"]
        _cli("fault", "--state-dir", sd, h.name, "--clear")
        assert "UP" in _operstate(None, veth)["flags"] and "UP" in _operstate(h.ns, c.ifname)["flags"]

        assert "rate 100mbit" in _cli("fault", "--state-dir", sd, h.addr, "--rate", "100mbit")
        assert _root_qdisc_kind(h.ns, c.ifname) == ["tbf"] and _root_qdisc_kind(None, veth) == ["tbf"]
        _cli("fault", "--state-dir", sd, h.name, "--clear")
        assert "tbf" not in _root_qdisc_kind(h.ns, c.ifname) + _root_qdisc_kind(None, veth)

        pid = load_cluster(sd).host(h.name).sshd_pid
        assert "sshd stopped" in _cli("fault", "--state-dir", sd, h.name, "--sshd-stop")
        assert not pid_alive(pid) and not is_listening(c, h.name, 22)
        _cli("fault", "--state-dir", sd, h.name, "--clear")
        assert is_listening(c, h.name, 22) and pid_alive(load_cluster(sd).host(h.name).sshd_pid)

        res = CliRunner().invoke(sim_cli.sim_group, ["fault", "--state-dir", str(sd), "nosuchhost", "--down"])
        assert res.exit_code == 2 and "valid hosts are" in res.output
    finally:
        sim_fault(c, h.name, clear=True)  # also refreshes the shared cluster's recorded PIDs
    assert ssh_run(c, h.name, "hostname") == (0, h.name + "\n")


@needs_sim
def test_up_copes_with_leftovers_and_down_cli_removes_everything(tmp_path):
    naming = Naming.parse(LIFECYCLE_PREFIX, LIFECYCLE_SUBNET)
    state_dir = tmp_path / "st"
    with prefix_lock(LIFECYCLE_PREFIX, "session.lock", timeout=300):
        try:
            # a crash left a namespace, a veth pair and the bridge of this prefix behind
            for argv in (["ip", "netns", "add", naming.ns(1)],
                         ["ip", "link", "add", naming.veth(2), "type", "veth", "peer", "name", naming.veth_peer(2)],
                         ["ip", "link", "add", naming.bridge, "type", "bridge"]):
                subprocess.run(argv, check=True, timeout=10)
            out = _cli("up", "--hosts", 2, "--prefix", LIFECYCLE_PREFIX, "--subnet", LIFECYCLE_SUBNET,
                       "--state-dir", state_dir)
            assert f"sim cluster '{LIFECYCLE_PREFIX}' up: 2 hosts" in out
            c = load_cluster(state_dir)
            assert [ssh_run(c, h.name, "hostname")[1].strip() for h in c.hosts] == [h.name for h in c.hosts]
            assert stat.S_IMODE(os.lstat(state_dir).st_mode) == 0o700
            assert "removed 2 namespaces, stopped 2 sshd" in _cli("down", "--state-dir", state_dir)
            assert _our_netns(LIFECYCLE_PREFIX) == [] and not any(pid_alive(h.sshd_pid) for h in c.hosts)
            links = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True,
                                   timeout=5).stdout
            assert not [x["ifname"] for x in json.loads(links) if naming.owns_link(x["ifname"])]
            assert "removed 0 namespaces, stopped 0 sshd" in _cli("down", "--state-dir", state_dir)  # idempotent
            assert "removed 0 namespaces" in _cli("down", "--prefix", LIFECYCLE_PREFIX)
        finally:
            sim_down(state_dir, prefix=LIFECYCLE_PREFIX)
    assert _our_netns(LIFECYCLE_PREFIX) == []


@needs_root
@needs_sim
def test_up_refuses_a_planted_state_dir_and_never_trusts_planted_keys(tmp_path):
    cfg = SimConfig(n_hosts=1, prefix=LIFECYCLE_PREFIX, subnet=LIFECYCLE_SUBNET, state_dir=tmp_path / "st")
    planted = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPlantedPlantedPlantedPlantedPlantedPlanted\n"
    cfg.state_dir.mkdir(mode=0o700)
    (cfg.state_dir / "authorized_keys").write_text(planted)
    (cfg.state_dir / "client_key.pub").write_text(planted)
    os.chown(cfg.state_dir, pwd.getpwnam("nobody").pw_uid, -1)
    with prefix_lock(LIFECYCLE_PREFIX, "session.lock", timeout=300):
        try:
            with pytest.raises(SimError, match="belongs to user 'nobody'"):
                sim_up(cfg)
            assert _our_netns(LIFECYCLE_PREFIX) == []  # refused before anything was built
            os.chown(cfg.state_dir, os.geteuid(), -1)  # now ours: accepted, but its keys are replaced
            c = sim_up(cfg)
            authorized = (cfg.state_dir / "authorized_keys").read_text()
            assert planted not in authorized and authorized.split()[:2] == \
                c.key.with_name(c.key.name + ".pub").read_text().split()[:2]
            assert stat.S_IMODE(os.lstat(c.key).st_mode) == 0o600
            assert ssh_run(c, c.hosts[0].name, "hostname") == (0, c.hosts[0].name + "\n")
        finally:
            sim_down(cfg.state_dir, prefix=LIFECYCLE_PREFIX)


SCALE_HOSTS = 128


@needs_sim
@pytest.mark.slow  # ~1 min on 2 shared cores, most of it 128 logins each running root's ~/.bashrc
def test_128_hosts_up_take_128_concurrent_logins_and_go_down(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cfg = SimConfig(n_hosts=SCALE_HOSTS, prefix=LIFECYCLE_PREFIX, subnet=LIFECYCLE_SUBNET, state_dir=tmp_path / "st")

    def login(h):
        client = ssh_client(c, h.name, timeout=120)
        try:
            _, stdout, _ = client.exec_command("hostname", timeout=120)
            return stdout.channel.recv_exit_status(), stdout.read().decode()
        finally:
            client.close()

    with prefix_lock(LIFECYCLE_PREFIX, "session.lock", timeout=300):
        try:
            t0 = time.monotonic()
            c = sim_up(cfg)
            up_s = time.monotonic() - t0
            assert len(c.hosts) == SCALE_HOSTS and all(pid_alive(h.sshd_pid) for h in c.hosts)
            assert len(_our_netns(LIFECYCLE_PREFIX)) == SCALE_HOSTS
            assert yaml.safe_load(c.spec_path.read_text())["ssh"]["connect_timeout"] == 16
            with ThreadPoolExecutor(SCALE_HOSTS) as pool:  # one client, every host at once
                results = list(pool.map(login, c.hosts))
            assert results == [(0, h.name + "\n") for h in c.hosts]
            # a closed client's session process on the host ends a moment after the close:
            # wait for every host to hold only its sshd, so `killed` names real leftovers
            namespaces, listeners = [h.ns for h in c.hosts], {h.sshd_pid for h in c.hosts}

            def sessions() -> list[int]:
                return [p for ps in pids_by_netns(namespaces).values() for p in ps if p not in listeners]
            assert wait_until(lambda: not sessions(), 60), f"sessions still running after their logins: {sessions()}"
            t0 = time.monotonic()
            down = sim_down(cfg.state_dir)
            down_s = time.monotonic() - t0
            assert len(down.namespaces) == len(down.sshd_stopped) == SCALE_HOSTS and down.killed == []
            assert _our_netns(LIFECYCLE_PREFIX) == []
            # measured 4-6 s up and 0.5-1 s down on an idle 2-core box (12.6 s / 3.5 s before batching)
            no_hang(up_s, 60, f"sim up of {SCALE_HOSTS} hosts (namespaces and sshds made in batches)")
            no_hang(down_s, 20, f"sim down of {SCALE_HOSTS} hosts")
        finally:
            sim_down(cfg.state_dir, prefix=LIFECYCLE_PREFIX)
    assert _our_netns(LIFECYCLE_PREFIX) == []
