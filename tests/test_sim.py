"""The sim cluster: pure parts without root, then real hosts (namespaces + sshd) as root.

Real-host tests share the session cluster (dlt1..dlt4) from simfixture; each fault test uses
its own host and clears its fault. The lifecycle test builds a second, private cluster.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest
import yaml
from click.testing import CliRunner

from ddplaunch.sim import (Naming, SimCluster, SimConfig, SimError, SimHost, load_cluster,
                           render_spec, sim_down, sim_fault, sim_status, sim_up)
from ddplaunch.sim import cli as sim_cli
from ddplaunch.sim.cluster import prefix_lock
from ddplaunch.sim.proc import pid_alive
from ddplaunch.sim.sshd import sshd_config_text
from ddplaunch.sim.testing import ssh_client, ssh_run, wait_listening
from tests.simfixture import sim_cluster, sim_skip_reason  # noqa: F401  (fixture)

LIFECYCLE_PREFIX = os.environ.get("DDPLAUNCH_TEST_PREFIX2", "dlx")
LIFECYCLE_SUBNET = os.environ.get("DDPLAUNCH_TEST_SUBNET2", "10.213.8.0/24")
needs_sim = pytest.mark.skipif(bool(sim_skip_reason()), reason=sim_skip_reason() or "")


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
    assert list(spec) == ["name", "backend", "hosts", "nproc_per_node", "python", "workdir",
                          "dist_backend", "socket_ifname", "rdzv_timeout", "healthcheck", "ssh", "job"]


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
                 "PermitRootLogin prohibit-password", "MaxStartups 100:30:200", "MaxSessions 50"):
        assert line in text.splitlines()


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
    assert res.returncode != 0 and time.monotonic() - t0 < 3.0
    assert c.run(c.hosts[0], ["getent", "hosts", c.hosts[2].name]).stdout.split()[0] == c.hosts[2].addr


@needs_sim
def test_fault_down_breaks_ssh_and_clear_restores_it(sim_cluster):
    c, h = sim_cluster, sim_cluster.hosts[2]
    try:
        sim_fault(c, h.name, down=True)
        t0 = time.monotonic()
        with pytest.raises((OSError, paramiko.SSHException)):
            ssh_client(c, h.name, timeout=2).close()
        assert time.monotonic() - t0 < 4.0
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
        assert time.monotonic() - t0 < 10
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
    code = "import sys; from ddplaunch.sim.cli import sim_group; sim_group(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, "exec", "--state-dir", str(c.state_dir),
                          c.hosts[1].addr, "--", "hostname"],
                         capture_output=True, text=True, timeout=15, check=True).stdout
    assert out.strip() == c.hosts[1].name
