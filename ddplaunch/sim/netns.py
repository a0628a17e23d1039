"""Sim hosts as network namespaces on one bridge, and the wrapper that enters them.

A host is a network namespace with one veth leg (named the same in every host, so one
GLOO_SOCKET_IFNAME serves all) on a bridge in the root namespace. It has no default route.
Commands enter a host with `nsenter --net` plus `unshare --uts --mount`, which gives them the
host's hostname and a private /etc/hosts and fail-fast resolv.conf. `ip netns exec` is avoided
on purpose: it remounts /sys, which breaks slurmd. Daemons (sshd, later slurmd) sit on top.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddplaunch.sim.proc import SimError, run, stop_pids

IFNAMSIZ = 15          # Linux interface names are at most 15 characters
FIRST_HOST_OFFSET = 10  # host i gets network address + 10 + i; .10 is kept for a controller
PREFIX_RE = re.compile(r"^[a-z](?:[a-z0-9]{0,8}[a-z])?$")
NETNS_DIR = Path("/run/netns")

# Enter-and-exec script: $1 hosts file, $2 resolv.conf, $3 hostname, then the command.
_ENTER_SH = ('mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf'
             ' && hostname "$3" && shift 3 && exec "$@"')


@dataclass(frozen=True)
class Naming:
    """Every name and address derived from a prefix and a subnet (pure, no effects).

    Host i (1-based) is namespace and hostname `<prefix><i>` at address network+10+i; its
    veth is `<prefix><i>h` on the bridge `<prefix>br0` (network+1) and `<prefix>0` inside.
    """

    prefix: str
    subnet: ipaddress.IPv4Network

    @classmethod
    def parse(cls, prefix: str, subnet: str) -> Naming:
        """Validate a prefix and a CIDR subnet.

        Raises:
            SimError: the prefix is not 1-10 lowercase letters/digits starting and ending with
                a letter, or the subnet is not an IPv4 CIDR with room for a host.
        """
        if not PREFIX_RE.match(prefix):
            raise SimError(f"bad sim prefix {prefix!r}: use 1-10 lowercase letters/digits that start "
                           "and end with a letter (e.g. dls), so names like <prefix>12h fit in 15 chars")
        try:
            net = ipaddress.IPv4Network(subnet, strict=False)
        except ValueError as exc:
            raise SimError(f"bad sim subnet {subnet!r}: {exc} (expected e.g. 10.213.0.0/24)") from exc
        naming = cls(prefix, net)
        if naming.max_hosts < 1:
            raise SimError(f"sim subnet {subnet} is too small: use a /24 or larger")
        return naming

    @property
    def max_hosts(self) -> int:
        return min(self.subnet.num_addresses - 2 - FIRST_HOST_OFFSET, 999)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br0"

    @property
    def ifname(self) -> str:
        """The interface name inside every host (the GLOO_SOCKET_IFNAME of the cluster)."""
        return f"{self.prefix}0"

    @property
    def bridge_addr(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 1

    def host_name(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def veth(self, i: int) -> str:
        """Bridge-side leg of host i's veth pair (lives in the root namespace)."""
        return f"{self.prefix}{i}h"

    def veth_peer(self, i: int) -> str:
        """Temporary name of the in-host leg before it moves into the namespace."""
        return f"{self.prefix}{i}n"

    def addr(self, i: int) -> ipaddress.IPv4Address:
        return self.subnet.network_address + FIRST_HOST_OFFSET + i

    # The Slurm controller is "host 0": namespace <prefix>0 at network+10, hostname <prefix>ctl.
    @property
    def controller_ns(self) -> str:
        return self.ns(0)

    @property
    def controller_name(self) -> str:
        return f"{self.prefix}ctl"

    @property
    def controller_addr(self) -> ipaddress.IPv4Address:
        return self.addr(0)

    def owns_netns(self, name: str) -> bool:
        return re.fullmatch(rf"{self.prefix}\d+", name) is not None

    def owns_link(self, name: str) -> bool:
        return name == self.bridge or re.fullmatch(rf"{self.prefix}\d+[hn]", name) is not None


# ----------------------------------------------------------------------------- queries

def list_netns() -> list[str]:
    """Names of all named network namespaces."""
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links(netns: str | None = None) -> dict[str, dict]:
    """`ip -j link` of the root namespace (or `netns`), keyed by interface name."""
    argv = ["ip", "-j", "link", "show"] if netns is None else ["ip", "-n", netns, "-j", "link", "show"]
    return {link["ifname"]: link for link in json.loads(run(argv).stdout or "[]")}


def netns_pids(ns: str) -> list[int]:
    """PIDs of all processes in namespace `ns` (empty when it does not exist)."""
    proc = run(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in proc.stdout.split()] if proc.returncode == 0 else []


def foreign_addr_in_subnet(naming: Naming) -> str | None:
    """Name an interface outside this sim that already has an address in our subnet, if any."""
    for entry in json.loads(run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        if naming.owns_link(entry["ifname"]):
            continue
        for info in entry.get("addr_info", []):
            net = ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False)
            if net.overlaps(naming.subnet):
                return f"{entry['ifname']} ({info['local']}/{info['prefixlen']})"
    return None


# ----------------------------------------------------------------------------- effects

def create_network(naming: Naming, n_hosts: int, controller: bool = False) -> None:
    """Create the bridge and hosts 1..n (and host 0, the controller, when asked):
    namespace, veth pair, address, links up.

    Assumes nothing of this prefix exists (call `destroy_network` first).
    Raises:
        SimError: an `ip` command failed (its message names the command).
    """
    plen = naming.subnet.prefixlen
    root = [f"link add {naming.bridge} type bridge",
            f"addr add {naming.bridge_addr}/{plen} dev {naming.bridge}",
            f"link set {naming.bridge} up"]
    indices = range(0 if controller else 1, n_hosts + 1)
    for i in indices:
        root += [f"netns add {naming.ns(i)}",
                 f"link add {naming.veth(i)} type veth peer name {naming.veth_peer(i)}",
                 f"link set {naming.veth(i)} master {naming.bridge} up",
                 f"link set {naming.veth_peer(i)} netns {naming.ns(i)}"]
    _ip_batch(root)
    for i in indices:
        _ip_batch([f"link set {naming.veth_peer(i)} name {naming.ifname}",
                   f"addr add {naming.addr(i)}/{plen} dev {naming.ifname}",
                   f"link set {naming.ifname} up",
                   "link set lo up"], netns=naming.ns(i))


def destroy_network(naming: Naming) -> list[int]:
    """Remove every namespace, veth and bridge of this prefix; kill what still runs inside.

    Processes inside our namespaces are ours by construction (only the sim puts them there).
    Idempotent: nothing there is fine. Returns the PIDs that were killed.
    """
    ours = [ns for ns in list_netns() if naming.owns_netns(ns)]
    killed = [pid for ns in ours for pid in netns_pids(ns)]
    stop_pids(killed, grace=3.0)  # all namespaces at once: one grace period, not one per host
    for ns in ours:
        run(["ip", "netns", "del", ns])
    # deleting a namespace deletes its veth pair; this catches half-built leftovers
    links = list_links()
    for name in sorted(links, key=lambda n: n == naming.bridge):  # bridge last
        if naming.owns_link(name):
            run(["ip", "link", "del", name], check=False)
    if naming.bridge in list_links():
        raise SimError(f"could not delete bridge {naming.bridge}: try `ip link del {naming.bridge}`")
    return killed


def _ip_batch(lines: Sequence[str], netns: str | None = None) -> None:
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-batch", "-"]
    run(argv, input="\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- entering a host

def write_etc_files(etc_dir: Path, hosts: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    """Write the private /etc/hosts (all sim hosts) and fail-fast resolv.conf every host mounts.

    Without them, name lookups inside a namespace wait 10-20 s for an unreachable DNS server.
    Returns (hosts_file, resolv_conf).
    """
    etc_dir.mkdir(parents=True, exist_ok=True)
    hosts_file, resolv = etc_dir / "hosts", etc_dir / "resolv.conf"
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{addr}\t{name}" for name, addr in hosts]
    hosts_file.write_text("# written by ddplaunch sim\n" + "\n".join(lines) + "\n")
    resolv.write_text("# written by ddplaunch sim: no DNS in the sim, fail at once\n"
                      "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    return hosts_file, resolv


def enter_prefix(ns: str, hostname: str, hosts_file: Path, resolv_conf: Path) -> list[str]:
    """The argv prefix that runs the argv appended to it inside a sim host (pure).

    The wrapper only execs (nsenter -> unshare -> sh -> exec), so the PID of the started
    process is the PID of the appended command itself.
    """
    return ["nsenter", f"--net={NETNS_DIR / ns}", "unshare", "--uts", "--mount",
            "--propagation", "private", "--", "sh", "-c", _ENTER_SH, "sh",
            str(hosts_file), str(resolv_conf), hostname]


def enter_argv(ns: str, hostname: str, hosts_file: Path, resolv_conf: Path,
               argv: Sequence[str]) -> list[str]:
    """`enter_prefix(...) + argv`; raises SimError when `argv` is empty."""
    if not argv:
        raise SimError("nothing to run: give a command after the host")
    return enter_prefix(ns, hostname, hosts_file, resolv_conf) + list(argv)
