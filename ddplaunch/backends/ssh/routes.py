"""How each host is reached: the user's ssh config as the source of truth, the spec where it says more.

A host's `addr` is what the user types after `ssh`: an address, a name, or an alias of their
`~/.ssh/config` (`Host gpu-1` with `HostName`, `User`, `Port`, `IdentityFile`, `ProxyJump` or
`ProxyCommand`). `resolve_routes` looks every host up there (paramiko's parser, the one Fabric
uses) and lets the spec's values win (`hosts[].user/port`, `ssh.user/port/key`); what neither
says is OpenSSH's default (port 22, the local user, the default keys and the agent). Each value
remembers where it came from, for `validate` and the dry run. Jump hosts are routes too
(`ProxyJump a,b`: b reached through a), each looked up in the same config. Pure: reads the config
file, connects nowhere.
"""

from __future__ import annotations

import getpass
import ipaddress
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import paramiko

from ddplaunch.errors import BackendError
from ddplaunch.spec.model import ClusterSpec, HostSpec

#: The user's ssh config, as OpenSSH reads it (HOME decides, as for ssh itself).
USER_SSH_CONFIG = "~/.ssh/config"
#: Jumps through jumps (`ProxyJump` on the jump host's own entry) deeper than this are refused.
MAX_JUMPS = 8
SPEC, CONFIG, DEFAULT = "spec", "ssh config", "default"


@dataclass(frozen=True)
class Route:
    """Where to connect for one host (or jump host), and how."""

    alias: str  # what the spec (or a ProxyJump) wrote
    hostname: str
    port: int
    user: str
    keys: tuple[str, ...] = ()  # empty: the default keys and the agent
    jump: Optional["Route"] = None
    proxy_command: Optional[str] = None
    #: value -> where it came from ("spec", "ssh config", "default"), for hostname/user/port/keys/jump
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def where(self) -> str:
        """`user@hostname:port`, as people write it."""
        return f"{self.user}@{self.hostname}:{self.port}"

    def hops(self) -> list["Route"]:
        """The jump hosts in the order they are connected to (the first one is reached directly)."""
        out: list[Route] = []
        hop = self.jump
        while hop is not None:
            out.insert(0, hop)
            hop = hop.jump
        return out

    def describe(self) -> str:
        """`root@10.0.0.3:22 via gpu-1 (hostname, user: ssh config; port: default)`."""
        via = "".join(f" via {h.alias}" for h in reversed(self.hops())) if self.jump else ""
        via += " via ProxyCommand" if self.proxy_command else ""
        keys = f" key {', '.join(self.keys)}" if self.keys else ""
        by: dict[str, list[str]] = {}
        for what, source in self.sources.items():
            by.setdefault(source, []).append(what)
        said = "; ".join(f"{', '.join(sorted(w))}: {s}" for s, w in sorted(by.items()))
        return f"{self.where}{keys}{via} ({said})"


def load_ssh_config(path: str = USER_SSH_CONFIG) -> paramiko.SSHConfig:
    """The parsed ssh config at `path` (an empty one when there is none).

    Raises:
        BackendError: the file exists and cannot be read or parsed.
    """
    full = Path(os.path.expanduser(path))
    if not full.is_file():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(full))
    except (OSError, UnicodeDecodeError, ValueError, paramiko.SSHException) as err:
        raise BackendError(f"{full}: cannot read this ssh config: {err}",
                           fix="fix the file (ssh -G HOST shows how OpenSSH reads it)") from None


def is_ip(text: str) -> bool:
    """Whether `text` is an IPv4 or IPv6 address (not a name)."""
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def resolve_route(spec: ClusterSpec, host: HostSpec, config: paramiko.SSHConfig) -> Route:
    """How to reach `host`: the spec's values first, then the ssh config's, then OpenSSH's defaults.

    Raises:
        BackendError: a ProxyJump that cannot be followed (a loop, too deep, unparsable).
    """
    ssh = spec.ssh
    user = host.user or ssh.user
    port = host.port or ssh.port
    keys = (str(spec.resolve(ssh.key)),) if ssh.key else None
    return _route(host.addr, config, user, port, keys, depth=0, seen=())


def _route(alias: str, config: paramiko.SSHConfig, user: Optional[str], port: Optional[int],
           keys: Optional[tuple[str, ...]], depth: int, seen: tuple[str, ...]) -> Route:
    found = config.lookup(alias)
    sources: dict[str, str] = {}
    named_by = SPEC if depth == 0 else CONFIG  # the name itself: the spec's addr, or a ProxyJump's

    def pick(what: str, given: object, key: str, default: object) -> object:
        if given is not None:
            sources[what] = SPEC
            return given
        if key in found and (key != "hostname" or found[key] != alias):
            sources[what] = CONFIG
            return found[key]
        sources[what] = named_by if key == "hostname" else DEFAULT
        return default
    hostname = str(pick("hostname", None, "hostname", alias))
    chosen_user = str(pick("user", user, "user", getpass.getuser()))
    try:
        chosen_port = int(str(pick("port", port, "port", 22)))
    except ValueError:
        raise BackendError(f"{alias}: the ssh config's Port {found.get('port')!r} is not a number",
                           fix="fix the Port line of that Host entry") from None
    chosen_keys: tuple[str, ...] = keys if keys is not None else tuple(found.get("identityfile", ()))
    if keys is not None:
        sources["keys"] = SPEC
    elif chosen_keys:
        sources["keys"] = CONFIG
    jump, command = _proxy(alias, found, config, depth, seen)
    if jump is not None:
        sources["jump"] = CONFIG
    return Route(alias=alias, hostname=hostname, port=chosen_port, user=chosen_user, keys=chosen_keys,
                 jump=jump, proxy_command=command, sources=sources)


def _proxy(alias: str, found: paramiko.SSHConfigDict, config: paramiko.SSHConfig, depth: int,
           seen: tuple[str, ...]) -> tuple[Optional[Route], Optional[str]]:
    """The jump route (ProxyJump) or the command (ProxyCommand) an entry asks for, if any."""
    jump_text = str(found.get("proxyjump", "none"))
    if jump_text.lower() != "none":
        if alias in seen or depth >= MAX_JUMPS:
            raise BackendError(f"{alias}: ProxyJump {' -> '.join([*seen, alias])} loops or goes deeper than "
                               f"{MAX_JUMPS} jumps", fix="fix the ProxyJump lines of your ssh config")
        jump: Optional[Route] = None
        for hop in jump_text.split(","):  # `a,b`: b is reached through a
            hop_user, hop_alias, hop_port = _parse_hop(alias, hop.strip())
            route = _route(hop_alias, config, hop_user, hop_port, None, depth + 1, (*seen, alias))
            jump = route if jump is None else _through(route, jump)
        return jump, None
    command = found.get("proxycommand")
    return None, (str(command) if command and str(command).lower() != "none" else None)


def _through(route: Route, first: Route) -> Route:
    """`route` reached through `first` (`ProxyJump first,route`: the list's order wins over the
    hop's own ProxyJump line, as for `ssh -J`)."""
    return replace(route, jump=first, proxy_command=None)


def _parse_hop(alias: str, hop: str) -> tuple[Optional[str], str, Optional[int]]:
    """`[user@]host[:port]` of a ProxyJump entry."""
    user, _, rest = hop.rpartition("@")
    name, port = rest, None
    if rest.count(":") == 1:
        name, _, text = rest.partition(":")
        if not text.isdigit():
            raise BackendError(f"{alias}: ProxyJump {hop!r}: the port is not a number",
                               fix="write ProxyJump [user@]host[:port]")
        port = int(text)
    if not name:
        raise BackendError(f"{alias}: ProxyJump {hop!r} names no host", fix="write ProxyJump [user@]host[:port]")
    return user or None, name, port


def resolve_routes(spec: ClusterSpec, hosts: list[HostSpec],
                   config: Optional[paramiko.SSHConfig] = None) -> dict[str, Route]:
    """Every host's route, by label (the user's ssh config read once)."""
    config = load_ssh_config() if config is None else config
    return {h.label: resolve_route(spec, h, config) for h in hosts}


def reach_addr(host: HostSpec, route: Route) -> Optional[str]:
    """The address the other hosts reach `host` by, when the launcher's name for it is not one
    they know: the ssh config's HostName when it is an address (None: `addr` serves, or the
    host must be asked: `needs_asking`)."""
    if route.hostname != host.addr and is_ip(route.hostname):
        return route.hostname.strip("[]")
    return None


def needs_asking(host: HostSpec, route: Route) -> bool:
    """Whether only the host itself can say its address: an alias whose HostName is a name (or a
    host behind a ProxyCommand): the name may resolve only where the launcher is."""
    aliased = route.hostname != host.addr or route.proxy_command is not None
    return aliased and not is_ip(route.hostname)
