"""A supervisor holding more than 1,024 descriptors (a few per host: ~350 hosts) still reaches
hosts behind a ProxyCommand: paramiko's own ProxyCommand waits with select(), which raises
ValueError for a descriptor numbered 1024 or more; ours polls. On real sim hosts, each reached
through `ssh -W` via another host (the ProxyCommand users write). A supervisor raises its own
limit on open files to the hard limit."""

from __future__ import annotations

import os
import resource

from ddplaunch.backends.ssh.connect import Connector, PolledProxyCommand, raise_fd_limit
from ddplaunch.backends.ssh.routes import load_ssh_config, resolve_routes
from ddplaunch.spec.load import load_spec
from tests.backends.test_bastion import alias_spec, ssh_home

#: Descriptors open before the check starts: its own come after them.
HELD = 1100


def test_raise_fd_limit_takes_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        got = raise_fd_limit()
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert got == hard or (hard == resource.RLIM_INFINITY and got >= 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_hosts_behind_a_proxycommand_answer_past_descriptor_1024(sim_cluster, tmp_path):
    """The run's connections (backends/ssh/connect.py), made in this process once it holds
    1,100 descriptors: each host's ProxyCommand reads from a descriptor past 1023 and the host
    answers a command over the connection."""
    h = sim_cluster.hosts
    hop = (f"ssh -i {sim_cluster.key} -o UserKnownHostsFile={sim_cluster.known_hosts} -o StrictHostKeyChecking=yes "
           f"-o BatchMode=yes -o ConnectTimeout=5 -W %h:%p root@{h[0].addr}")
    home = ssh_home(sim_cluster, tmp_path, {f"pc-{i + 1}": {"HostName": host.addr, "ProxyCommand": hop}
                                            for i, host in enumerate(h)})
    spec = load_spec(alias_spec(sim_cluster, tmp_path, [f"pc-{i + 1}" for i in range(len(h))]))
    routes = resolve_routes(spec, spec.hosts, load_ssh_config(str(home / ".ssh" / "config")))
    assert all(r.proxy_command for r in routes.values())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(4096, hard)), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(HELD)]
    connector = Connector(spec, routes)
    try:
        for i, host in enumerate(h):
            conn = connector.connect(f"pc-{i + 1}")
            proxy = conn.transport.sock
            assert isinstance(proxy, PolledProxyCommand) and proxy.process.stdout.fileno() >= 1024
            nonce = f"ddpl-fd-{i}"
            channel = conn.transport.open_session(timeout=30)
            channel.settimeout(30)
            channel.exec_command(f"echo {nonce}=$(hostname)")
            answer = channel.makefile("rb").read().decode()
            assert f"{nonce}={host.name}" in answer, answer
    finally:
        connector.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
