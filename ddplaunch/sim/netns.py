"""Sim hosts as network namespaces on one bridge, and the wrapper that enters them.

A host is a network namespace with one veth leg (named the same in every host, so one
GLOO_SOCKET_IFNAME serves all) on a bridge in the root namespace. It has no default route.
Commands enter a host with `nsenter --net` plus `unshare --uts --mount`, which gives them the
host's hostname and, bind-mounted in the private mount namespace, the sim's /etc/hosts (every
sim address, the bridge included), a fail-fast resolv.conf and an nsswitch.conf that asks
only the hosts file (and optionally a noisy ~/.bashrc, see cluster.py). `ip netns exec` is
avoided on purpose: it remounts /sys, which breaks slurmd. Daemons (sshd, slurmd) sit on top.

Why nsswitch `hosts: files`: the TCPStore of torch listens on a dual-stack socket, so a peer
shows up as `::ffff:10.x.y.z`. nss_files has no entry for such a v4-mapped address (the DNS
module would unmap it), glibc then asks DNS, the unreachable resolver answers "try again",
and getnameinfo() fails with EAI_AGAIN (-3), which c10d logs as "The hostname of the client
socket cannot be retrieved. err=-3" on every rank. Without DNS in the list the lookup ends in
"not found" and getnameinfo() returns the numeric address, as it does on a host whose DNS
answers. Forward and reverse lookups of every IPv4 sim address come from the hosts file.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddplaunch.sim.proc import SimError, run, run_concurrently, stop_pids

IFNAMSIZ = 15          # Linux interface names are at most 15 characters
FIRST_HOST_OFFSET = 10  # host i gets network address + 10 + i; .10 is kept for a controller
PREFIX_RE = re.compile(r"^[a-z](?:[a-z0-9]{0,8}[a-z])?$")
NETNS_DIR = Path("/run/netns")

# Enter-and-exec script: $1 the number N of bind mounts, then N (source, target) pairs, then
# the hostname, then the command. It only execs, so the command keeps the wrapper's PID.
_ENTER_SH = ('n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind "$1" "$2" || exit 125; shift 2;'
             ' n=$((n - 1)); done; hostname "$1" && shift && exec "$@"')
NSSWITCH = Path("/etc/nsswitch.conf")


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

    @staticmethod
    def mac(addr: ipaddress.IPv4Address) -> str:
        """A fixed, locally administered MAC for an address of the sim network (02:00 + the IP)."""
        return "02:00:" + ":".join(f"{b:02x}" for b in addr.packed)

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
    return pids_by_netns([ns]).get(ns, [])


def pids_by_netns(names: Sequence[str]) -> dict[str, list[int]]:
    """PIDs of all processes in each of the named namespaces, from one scan of /proc (what
    `ip netns pids` does, without a process per namespace). Missing namespaces map to []."""
    inodes: dict[tuple[int, int], str] = {}
    for ns in names:
        try:
            st = os.stat(NETNS_DIR / ns)
        except OSError:
            continue
        inodes[(st.st_dev, st.st_ino)] = ns
    out: dict[str, list[int]] = {ns: [] for ns in names}
    if not inodes:
        return out
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:
            continue  # gone, or a kernel thread
        owner = inodes.get((st.st_dev, st.st_ino))
        if owner is not None:
            out[owner].append(int(entry.name))
    return out


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
    namespace, veth pair with a fixed MAC, address, links up, and a permanent neighbour entry
    for every other address of the network in every namespace (the root one too).

    Static neighbours: every host resolving every other with ARP broadcasts at once (a 32-rank
    Gloo mesh: ~1,000 broadcasts, each copied to every port of the bridge on one CPU) overflows
    the kernel's backlog (netdev_max_backlog, 1,000 packets) and dropped ARP requests surface
    as "No route to host" — a flood no real cluster funnels through two cores.

    The root namespace's part is one `ip -batch`; each host's part is one `ip -n NS -batch`,
    and those run concurrently (128 hosts: about a second).
    Assumes nothing of this prefix exists (call `destroy_network` first).
    Raises:
        SimError: an `ip` command failed (its message names the command).
    """
    plen = naming.subnet.prefixlen
    indices = range(0 if controller else 1, n_hosts + 1)
    macs = {naming.addr(i): naming.mac(naming.addr(i)) for i in indices}
    macs[naming.bridge_addr] = naming.mac(naming.bridge_addr)
    root = [f"link add {naming.bridge} address {macs[naming.bridge_addr]} type bridge",
            f"addr add {naming.bridge_addr}/{plen} dev {naming.bridge}",
            f"link set {naming.bridge} up"]
    for i in indices:
        # the in-host leg is created in its namespace under its final name: no rename step
        root += [f"netns add {naming.ns(i)}",
                 f"link add {naming.veth(i)} type veth peer name {naming.ifname} "
                 f"address {macs[naming.addr(i)]} netns {naming.ns(i)}",
                 f"link set {naming.veth(i)} master {naming.bridge} up"]
    root += _neighbours(macs, naming.bridge_addr, naming.bridge)
    _ip_batch(root)
    run_concurrently([(["ip", "-n", naming.ns(i), "-batch", "-"],
                       "\n".join([f"addr add {naming.addr(i)}/{plen} dev {naming.ifname}",
                                   f"link set {naming.ifname} up",
                                   "link set lo up",
                                   *_neighbours(macs, naming.addr(i), naming.ifname)]) + "\n")
                      for i in indices])


def _neighbours(macs: dict, own: ipaddress.IPv4Address, dev: str) -> list[str]:
    return [f"neigh replace {addr} lladdr {mac} dev {dev} nud permanent"
            for addr, mac in macs.items() if addr != own]


def destroy_network(naming: Naming) -> list[int]:
    """Remove every namespace, veth and bridge of this prefix; kill what still runs inside.

    Processes inside our namespaces are ours by construction (only the sim puts them there).
    All of them get one grace period together, the namespaces and links go in one `ip -batch`
    each. Idempotent: nothing there is fine. Returns the PIDs that were killed.
    """
    ours = [ns for ns in list_netns() if naming.owns_netns(ns)]
    by_ns = pids_by_netns(ours)
    killed = [pid for ns in ours for pid in by_ns.get(ns, [])]
    stop_pids(killed, grace=3.0)  # all namespaces at once: one grace period, not one per host
    if ours:
        run(["ip", "-force", "-batch", "-"], input="".join(f"netns del {ns}\n" for ns in ours),
            check=False, timeout=60)
        left = [ns for ns in list_netns() if naming.owns_netns(ns)]
        if left:
            raise SimError(f"could not delete network namespace(s) {', '.join(left[:5])}: "
                           f"try `ip netns del {left[0]}`")
    # deleting a namespace deletes its veth pair (the kernel may do it a moment later);
    # this also catches half-built leftovers
    links = [name for name in list_links() if naming.owns_link(name)]
    links.sort(key=lambda n: n == naming.bridge)  # bridge last
    if links:
        run(["ip", "-force", "-batch", "-"], input="".join(f"link del {name}\n" for name in links),
            check=False, timeout=60)
    if naming.bridge in list_links():
        raise SimError(f"could not delete bridge {naming.bridge}: try `ip link del {naming.bridge}`")
    return killed


def _ip_batch(lines: Sequence[str], netns: str | None = None) -> None:
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-batch", "-"]
    run(argv, input="\n".join(lines) + "\n", timeout=60)


# ----------------------------------------------------------------------------- entering a host

def write_etc_files(etc_dir: Path, hosts: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    """Write the private /etc/hosts (every (name, addr) in `hosts`), the fail-fast resolv.conf
    and the nsswitch.conf (hosts from the file only, see the module doc) every host mounts.

    Without them, name lookups inside a namespace wait 10-20 s for an unreachable DNS server.
    Returns (hosts_file, resolv_conf); the nsswitch.conf is `nsswitch_path(hosts_file)`.
    """
    etc_dir.mkdir(parents=True, exist_ok=True)
    hosts_file, resolv = etc_dir / "hosts", etc_dir / "resolv.conf"
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{addr}\t{name}" for name, addr in hosts]
    hosts_file.write_text("# written by ddplaunch sim\n" + "\n".join(lines) + "\n")
    resolv.write_text("# written by ddplaunch sim: no DNS in the sim, fail at once\n"
                      "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    nsswitch_path(hosts_file).write_text(nsswitch_text(_read_text(NSSWITCH)))
    return hosts_file, resolv


def nsswitch_path(hosts_file: Path) -> Path:
    """The sim's nsswitch.conf, next to its hosts file."""
    return hosts_file.parent / "nsswitch.conf"


def nsswitch_text(original: str) -> str:
    """`original` (the machine's nsswitch.conf) with its hosts line replaced by `hosts: files`
    (pure); every other database is left as the machine has it."""
    lines = [line for line in original.splitlines() if not re.match(r"\s*hosts\s*:", line)]
    return "\n".join(["# written by ddplaunch sim: host names come from the sim's hosts file only",
                      "hosts:          files", *lines, ""])


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def enter_prefix(ns: str, hostname: str, hosts_file: Path, resolv_conf: Path,
                 binds: Sequence[tuple[Path, Path]] = ()) -> list[str]:
    """The argv prefix that runs the argv appended to it inside a sim host (pure).

    Inside the host's private mount namespace `hosts_file`, `resolv_conf` and (when it is
    there) the nsswitch.conf next to `hosts_file` are bind-mounted over their /etc files,
    then each (source, target) of `binds`. The wrapper only execs (nsenter -> unshare -> sh
    -> exec), so the PID of the started process is the PID of the appended command itself.
    """
    mounts = [(hosts_file, Path("/etc/hosts")), (resolv_conf, Path("/etc/resolv.conf"))]
    nsswitch = nsswitch_path(hosts_file)
    if nsswitch.is_file():  # state dirs written before it existed lack it
        mounts.append((nsswitch, NSSWITCH))
    mounts += list(binds)
    return ["nsenter", f"--net={NETNS_DIR / ns}", "unshare", "--uts", "--mount",
            "--propagation", "private", "--", "sh", "-c", _ENTER_SH, "sh", str(len(mounts)),
            *(str(p) for pair in mounts for p in pair), hostname]


def enter_argv(ns: str, hostname: str, hosts_file: Path, resolv_conf: Path,
               argv: Sequence[str], binds: Sequence[tuple[Path, Path]] = ()) -> list[str]:
    """`enter_prefix(...) + argv`; raises SimError when `argv` is empty."""
    if not argv:
        raise SimError("nothing to run: give a command after the host")
    return enter_prefix(ns, hostname, hosts_file, resolv_conf, binds) + list(argv)
