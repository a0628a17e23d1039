"""The pair algorithm, once: which hosts make every pair they are in slow or fail (standard library only).

Used in the health check's own processes (the pair gate, `healthcheck.pairwise` and `check`) and
by the launcher's localization (ddplaunch/localize.py), which measure pairs their own ways:
disjoint pairs of neighbours first (an odd one out pairs with the first host), then the median
of the faster half as the reference, then every host in a slow or failed pair re-paired with a
host known to be good. A host that is still slow with a good host is bad.
"""

import statistics
from typing import Any, Callable, Optional


def first_pairs(hosts: list[str]) -> list[tuple[str, str]]:
    """Disjoint pairs of neighbours; an odd one out pairs with the first host."""
    pairs = [(hosts[i], hosts[i + 1]) for i in range(0, len(hosts) - 1, 2)]
    if len(hosts) % 2 and len(hosts) > 1:
        pairs.append((hosts[-1], hosts[0]))
    return pairs


def healthy_median(speeds: list[float]) -> Optional[float]:
    """The median of the faster half of the pairs: what this cluster's links can do.

    A plain median is dragged down as soon as half the pairs are slow — with 4 hosts one slow
    host already spoils one of two pairs — so the reference assumes only that most links are
    fine, not that most pairs are.
    """
    if not speeds:
        return None
    top = sorted(speeds, reverse=True)[: (len(speeds) + 1) // 2]
    return statistics.median(top)


def schedule(pairs: list[tuple[str, str]], parallelism: int) -> list[list[int]]:
    """Splits pair indices into waves of disjoint pairs, at most ``parallelism`` each (0: any)."""
    waves, left = [], list(range(len(pairs)))
    while left:
        wave: list[int] = []
        busy: set[str] = set()
        for i in list(left):
            if busy.isdisjoint(pairs[i]) and (not parallelism or len(wave) < parallelism):
                wave.append(i)
                busy.update(pairs[i])
                left.remove(i)
        waves.append(wave)
    return waves


def judge(hosts: list[str], measure: Callable[[list[tuple[str, str]]], list[dict[str, Any]]],
          min_fraction: float) -> dict[str, Any]:
    """Pairs, then re-pairs of the suspects with good hosts, and the verdict.

    Args:
        hosts: host labels.
        measure: ``measure(pairs) -> probes``, one ``{"hosts": [a, b], "ok": bool, "busbw_gbps":
            float or None, "detail": str}`` per pair of labels.
        min_fraction: a pair below this fraction of the healthy median is slow.
    Returns:
        ``{"pairs", "repairs", "median_busbw_gbps", "bad_hosts", "reasons"}`` (reasons by host).
    """
    reasons: dict[str, str] = {}
    out: dict[str, Any] = {"pairs": [], "repairs": [], "median_busbw_gbps": None, "bad_hosts": [], "reasons": reasons}
    if len(hosts) < 2:
        return out
    pairs = out["pairs"] = measure(first_pairs(hosts))
    med = healthy_median([p["busbw_gbps"] for p in pairs if p["busbw_gbps"] is not None])
    out["median_busbw_gbps"] = med
    floor = (med or 0) * min_fraction
    for p in pairs:
        p["ok"] = p["ok"] and p["busbw_gbps"] is not None and p["busbw_gbps"] >= floor
    good = [h for h in hosts if all(p["ok"] for p in pairs if h in p["hosts"])]
    suspects = [h for h in hosts if h not in good]
    if suspects and good:
        repairs = out["repairs"] = measure([(s, good[i % len(good)]) for i, s in enumerate(suspects)])
        for p in repairs:
            p["ok"] = p["ok"] and p["busbw_gbps"] is not None and p["busbw_gbps"] >= floor
            if not p["ok"]:
                reasons[p["hosts"][0]] = _why(p, med, min_fraction)
    else:
        for s in suspects:
            reasons[s] = "every pair is slow or failed: no known-good host to compare with"
    out["bad_hosts"] = [h for h in hosts if h in reasons]
    return out


def _why(probe: dict[str, Any], med: Optional[float], min_fraction: float) -> str:
    partner = probe["hosts"][1]
    if probe["busbw_gbps"] is None:
        return f"failed with known-good host {partner}: {probe['detail']}"
    return (f"slow with known-good host {partner}: busbw {probe['busbw_gbps']:.3f} GB/s is below "
            f"healthcheck.min_busbw_fraction {min_fraction:g} x median {med:.3f} GB/s")
