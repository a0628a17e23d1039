"""How each host is reached (backends/ssh/routes.py): the user's ssh config as ssh reads it, the
spec's values winning, jump hosts as routes of their own, and the rendezvous address a cluster can
use where a host's name is an alias only the launcher knows; which host the backend asks (the
master's port, `down` on spares too). Pure: no connection is made."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import paramiko
import pytest

from ddplaunch.backends.ssh.routes import needs_asking, reach_addr, resolve_route
from ddplaunch.errors import BackendError
from ddplaunch.spec.load import load_spec_data

ROOT = Path(__file__).resolve().parents[2]

CONFIG = textwrap.dedent("""\
    Host gpu-*
      User ubuntu
    Host gpu-1
      HostName 10.0.0.1
      Port 2222
      IdentityFile /keys/cluster
    Host gpu-2
      HostName gpu-2.internal
    Host gpu-3
      HostName 10.0.0.3
      ProxyJump gpu-1
    Host deep
      HostName 10.0.0.9
      ProxyJump admin@gpu-1:2200,gpu-3
    Host loop-a
      ProxyJump loop-b
    Host loop-b
      ProxyJump loop-a
""")


def _spec(hosts, **ssh):
    return load_spec_data({"backend": "ssh", "hosts": hosts, "workdir": "/srv", "ssh": ssh,
                           "job": {"script": "jobs/train.py"}}, base_dir=ROOT)


def _route(spec, i=0):
    return resolve_route(spec, spec.hosts[i], paramiko.SSHConfig.from_text(CONFIG))


def test_an_alias_takes_every_value_from_the_ssh_config():
    route = _route(_spec(["gpu-1"]))
    assert (route.hostname, route.port, route.user, route.keys, route.jump) == \
        ("10.0.0.1", 2222, "ubuntu", ("/keys/cluster",), None)
    assert route.sources == {"hostname": "ssh config", "user": "ssh config", "port": "ssh config",
                             "keys": "ssh config"}


def test_the_specs_values_win_over_the_ssh_config():
    spec = _spec([{"addr": "gpu-1", "port": 22}], user="root", key="/keys/mine")
    route = _route(spec)
    assert (route.hostname, route.port, route.user, route.keys) == ("10.0.0.1", 22, "root", ("/keys/mine",))
    assert route.sources["port"] == route.sources["user"] == route.sources["keys"] == "spec"


def test_a_host_unknown_to_the_config_gets_openssh_defaults():
    route = _route(_spec(["10.9.9.9"]))
    assert (route.hostname, route.port, route.keys, route.jump) == ("10.9.9.9", 22, (), None)
    assert route.sources == {"hostname": "spec", "user": "default", "port": "default"}


def test_proxyjump_is_a_route_of_its_own_and_chains_in_order():
    jumped = _route(_spec(["gpu-3"]))
    assert jumped.hostname == "10.0.0.3" and jumped.jump is not None
    assert (jumped.jump.alias, jumped.jump.hostname, jumped.jump.port) == ("gpu-1", "10.0.0.1", 2222)
    assert "via gpu-1" in jumped.describe()
    deep = _route(_spec(["deep"]))
    assert [h.alias for h in deep.hops()] == ["gpu-1", "gpu-3"]  # gpu-1 first, then gpu-3 through it
    first = deep.hops()[0]
    assert (first.user, first.port) == ("admin", 2200)  # what the ProxyJump entry says wins


def test_a_proxyjump_loop_is_one_clear_error():
    with pytest.raises(BackendError, match="loop-a: ProxyJump loop-a -> loop-b -> loop-a loops"):
        _route(_spec(["loop-a"]))


def test_the_rendezvous_address_of_an_alias():
    spec = _spec(["gpu-1", "gpu-2", "10.0.0.5"])
    routes = [_route(spec, i) for i in range(3)]
    assert reach_addr(spec.hosts[0], routes[0]) == "10.0.0.1" and not needs_asking(spec.hosts[0], routes[0])
    # an alias for a name: only the host can say which address the others reach it by
    assert reach_addr(spec.hosts[1], routes[1]) is None and needs_asking(spec.hosts[1], routes[1])
    # a plain address needs nothing
    assert reach_addr(spec.hosts[2], routes[2]) is None and not needs_asking(spec.hosts[2], routes[2])


def test_a_spec_cannot_set_the_found_address(tmp_path):
    from ddplaunch.errors import SpecError

    with pytest.raises(SpecError, match="unknown key 'reach'"):
        _spec([{"addr": "gpu-1", "reach": "10.0.0.1"}])


def test_dry_run_and_validate_show_the_routes_and_the_master_address(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(CONFIG)
    spec = tmp_path / "c.yaml"
    spec.write_text("backend: ssh\nhosts: [gpu-1, gpu-3]\nworkdir: /srv\njob: {script: jobs/train.py}\n"
                    f"ssh: {{known_hosts: {tmp_path}/kh}}\n")
    env = dict(os.environ, HOME=str(home), DDPLAUNCH_HOME=str(tmp_path / "state"))
    dry = subprocess.run([sys.executable, "-m", "ddplaunch", "up", str(spec), "--dry-run"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "#   gpu-3: ubuntu@10.0.0.3:22 via gpu-1 (" in dry.stdout
    assert "# master address: 10.0.0.1 (gpu-1's HostName in your ssh config)" in dry.stdout
    assert "--master-addr 10.0.0.1 " in dry.stdout and "--master-addr gpu-1" not in dry.stdout
    valid = subprocess.run([sys.executable, "-m", "ddplaunch", "validate", str(spec)], capture_output=True,
                           text=True, timeout=60, cwd=ROOT, env=env)
    assert "#   gpu-1: ubuntu@10.0.0.1:2222 key /keys/cluster (" in valid.stdout, valid.stdout + valid.stderr


def test_the_master_port_is_probed_on_the_host_at_that_address_a_spare_too(monkeypatch):
    """After the master was lost, the new master is a spare: its port is probed there, not on the
    dead first host (which cost the connect timeout and checked nothing)."""
    from ddplaunch.backends.ssh import SshBackend

    spec = load_spec_data({"backend": "ssh", "hosts": ["10.0.0.1", "10.0.0.2"], "workdir": "/srv",
                           "recovery": {"max_host_failures": 1, "spares": ["10.0.0.9"]},
                           "job": {"script": "jobs/train.py"}}, base_dir=ROOT)
    backend = SshBackend(spec)
    asked: list[str] = []
    monkeypatch.setattr(backend, "_exec", lambda host, command, **_: (asked.append(host.label), (0, ""))[1])
    assert backend.port_free("10.0.0.9", 29500) and backend.port_free("10.0.0.2", 29500)
    assert asked == ["10.0.0.9", "10.0.0.2"]


def test_down_reaches_the_spares_too(monkeypatch):
    """A spare may have replaced a lost host: `down` ends the run's processes there as well."""
    from types import SimpleNamespace

    from ddplaunch.backends.ssh import SshBackend

    spec = load_spec_data({"backend": "ssh", "hosts": ["10.0.0.1", "10.0.0.2"], "workdir": "/srv",
                           "recovery": {"max_host_failures": 1, "spares": ["10.0.0.9"]},
                           "job": {"script": "jobs/train.py"}}, base_dir=ROOT)
    backend = SshBackend(spec)
    monkeypatch.setattr(backend, "_reap", lambda host, run_id, **_: f"{run_id}: nothing left")
    assert backend.down(SimpleNamespace(run_id="r1")) == [f"{h}: r1: nothing left"
                                                          for h in ("10.0.0.1", "10.0.0.2", "10.0.0.9")]
