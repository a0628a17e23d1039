"""What the checks found, as data: the pre-flight's table (`PreflightReport`), the health check's
verdict (`HealthVerdict`, rank 0's `DDPLAUNCH_HEALTHCHECK_JSON`) and a localization's
(`Localization`: which hosts fail alone or slow every pair they are in). The diagnose/ modules
fill them; the event log keeps them (record/codec.py); `to_dict` is their `--json` shape
(docs/check-schema.json). Data only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Optional

from ddplaunch.record.codec import from_data
from ddplaunch.record.probefacts import HostFacts

CHECKS = ("reach", "image", "python", "torch", "versions", "gpus", "leftovers", "master_dns", "iface", "port",
          "clock", "disk", "workdir", "checkpoint", "shm")


class Gate(StrEnum):
    """A check that decides whether, and where, the job runs: its value is how people name it."""

    PREFLIGHT = "pre-flight"
    HEALTHCHECK = "health check"
    #: hosts an earlier run recorded bad, left out before anything runs (run/hostmemory.py)
    HOST_HEALTH = "host health"


@dataclass
class Check:
    """One cell of the table: ok (True/False, None = not applicable), what was seen, the fix."""

    ok: Optional[bool]
    seen: str = ""
    fix: str = ""
    #: ok, but worth saying (shown after the failures, with its fix)
    warn: bool = False


@dataclass
class HostReport:
    host: str
    addr: str
    checks: dict[str, Check] = field(default_factory=dict)
    facts: HostFacts = field(default_factory=lambda: HostFacts())

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks.values())

    def failures(self) -> list[tuple[str, Check]]:
        return [(name, c) for name, c in self.checks.items() if c.ok is False]


@dataclass
class PreflightReport:
    """Every host's checks; `socket_ifname` is the interface detected for Gloo/NCCL (or None)."""

    hosts: list[HostReport]
    socket_ifname: Optional[str] = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    @property
    def bad_hosts(self) -> list[str]:
        return [h.host for h in self.hosts if not h.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "elapsed_s": round(self.elapsed_s, 3), "socket_ifname": self.socket_ifname,
                "checks": list(CHECKS), "bad_hosts": self.bad_hosts,
                "hosts": [{"host": h.host, "addr": h.addr, "ok": h.ok,
                           "checks": {k: _cell(v) for k, v in h.checks.items()}} for h in self.hosts]}


def _cell(check: Check) -> dict[str, Any]:
    """A check's cell in the JSON summary: `warn` only where it is set."""
    cell = asdict(check)
    if not check.warn:
        del cell["warn"]
    return cell


@dataclass
class Probe:
    """One health check on a subset of hosts."""

    hosts: tuple[str, ...]
    ok: bool
    busbw_gbps: Optional[float]
    detail: str = ""


@dataclass
class Localization:
    """What the localization found; `bad_hosts` is the verdict."""

    singles: list[Probe] = field(default_factory=list)
    pairs: list[Probe] = field(default_factory=list)
    repairs: list[Probe] = field(default_factory=list)
    median_busbw_gbps: Optional[float] = None
    bad_hosts: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Localization":
        """From the health check's in-process pair gate (the same shape as `to_dict`)."""
        def probes(key: str) -> list[Probe]:
            return [Probe(tuple(p["hosts"]), bool(p["ok"]), p.get("busbw_gbps"), p.get("detail", ""))
                    for p in data.get(key) or []]
        return cls(singles=probes("singles"), pairs=probes("pairs"), repairs=probes("repairs"),
                   median_busbw_gbps=data.get("median_busbw_gbps"), bad_hosts=list(data.get("bad_hosts") or []),
                   reasons=dict(data.get("reasons") or {}))

    def summary(self) -> str:
        lines = ["localization (busbw of one rank per host, large all_reduce):"]
        for p in self.singles:
            lines.append(f"  alone {p.hosts[0]:<16} {'ok' if p.ok else 'FAILED ' + p.detail}")
        med = self.median_busbw_gbps
        for kind, probes in (("pair", self.pairs), ("re-pair", self.repairs)):
            for p in probes:
                bw = "failed" if p.busbw_gbps is None else f"{p.busbw_gbps:.3f} GB/s"
                ratio = f" ({p.busbw_gbps / med:.2f} x median)" if med and p.busbw_gbps is not None else ""
                lines.append(f"  {kind:<7} {' + '.join(p.hosts):<28} {bw}{ratio}{'' if p.ok else '  <- slow/failed'}")
        lines.append("  bad hosts: " + (", ".join(f"{h} ({self.reasons[h]})" for h in self.bad_hosts)
                                        if self.bad_hosts else "none found"))
        return "\n".join(lines)


@dataclass
class HealthFailure:
    """One failed check of the health check: the rank and host to blame (None: no one rank is)."""

    check: str
    message: str
    rank: Optional[int] = None
    host: Optional[str] = None

    def describe(self) -> str:
        """`rank R (host H): message` (no prefix when no rank is to blame)."""
        return ("" if self.rank is None else f"rank {self.rank} (host {self.host}): ") + self.message


@dataclass
class BandwidthRow:
    """One collective at one message size, as the health check timed it (hostside/collectives.py)."""

    collective: str
    bytes: int
    busbw_gbps: float
    algbw_gbps: float = 0.0
    time_us: float = 0.0
    count: int = 0
    iters: int = 0


@dataclass
class HealthVerdict:
    """Rank 0's verdict of one health check (hostside/healthcheck.py): ok, the world it saw, every
    failure, the bandwidth per collective and size, each rank's facts, and the pair gate's
    localization when it ran (`healthcheck.pairwise`, `check`)."""

    ok: bool
    world_size: Optional[int] = None
    backend: Optional[str] = None
    failures: list[HealthFailure] = field(default_factory=list)
    bandwidth: list[BandwidthRow] = field(default_factory=list)
    #: each rank's facts (rank, host, device, versions), as it said them
    ranks: list[dict[str, Any]] = field(default_factory=list)
    pairs: Optional[Localization] = None
    #: collectives the backend does not support, each with why
    unsupported: dict[str, str] = field(default_factory=dict)
    min_busbw_gbps: Optional[float] = None
    elapsed_s: Optional[float] = None

    @classmethod
    def from_payload(cls, data: dict[str, Any]) -> Optional["HealthVerdict"]:
        """The verdict a rank printed, None when it is not one (a malformed payload)."""
        try:
            return from_data(cls, data)
        except ValueError:
            return None

    @property
    def bad_hosts(self) -> list[str]:
        """The hosts the pair gate found bad (none without a pair gate)."""
        return list(self.pairs.bad_hosts) if self.pairs is not None else []

    def to_dict(self) -> dict[str, Any]:
        """The verdict as `--json` shows it: only what the health check said."""
        data = asdict(self)
        return {k: v for k, v in data.items() if v is not None or k in ("ok", "world_size", "backend")}
