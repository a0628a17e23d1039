"""`ddplaunch ckpt ls` and `ckpt verify` rendered from what record/ckptscan.py found: one row per
step, newest first (complete or which parts are missing, size, age, where it lives: the durable dir
and each host's RAM, a buddy's replica naming its origin; a DCP step as `durable DCP`, its parts
its saving ranks, incomplete until published), each verified step's verdict with every damaged
copy's file, and the same as data for `--json`.

Pure: a listing and the time now in, lines or JSON-ready data out."""

from __future__ import annotations

from typing import Any, Optional

from ddplaunch.record.ckptscan import Copy, Format, Listing, PartCopy, PartState, Place, StoredStep
from ddplaunch.report.goodput import duration


def size_text(nbytes: int) -> str:
    """`512 B`, `4.0 KiB`, `1.2 MiB`, `3.5 GiB`."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"


def copy_label(copy: Copy, parts: Optional[int]) -> str:
    """`durable`, `RAM gpu1`, `RAM gpu2 (replica of gpu1)`; `part 0` when it holds only some parts."""
    name = "durable" if copy.place is Place.DURABLE else f"RAM {copy.host}"
    unit = "rank" if copy.published is not None else "part"
    if copy.published is not None:
        name += " DCP"
    ok = copy.ok_parts
    if parts is not None and parts > 1 and len(ok) < parts:
        name += f" {unit}{'s' if len(ok) > 1 else ''} {','.join(map(str, ok))}"
    if copy.place is Place.MEMORY and copy.origin != copy.host:
        name += f" (replica of {copy.origin})"
    return name


def held_text(step: StoredStep) -> str:
    """The copies that hold an intact part of the step, the durable dir first."""
    return ", ".join(copy_label(c, step.parts) for c in step.copies if c.ok_parts) or "nowhere intact"


def where_text(step: StoredStep) -> str:
    """`held_text`, and how many copies are torn or damaged (`ckpt verify` says which)."""
    damaged = sum(1 for c in step.copies if any(p.state is not PartState.OK for p in c.parts))
    return held_text(step) + (f" (+{damaged} torn or damaged: ckpt verify)" if damaged else "")


def missing_text(step: StoredStep) -> str:
    """`part 1 missing`, `parts 0,2 missing`, `no manifest` (no part says how many there are); a DCP
    step's `rank 1 missing`, or `not published (no .metadata)` when every rank's files are there."""
    unit = "rank" if step.format is Format.DCP else "part"
    if step.parts is None:
        return "no manifest" if any(c.parts for c in step.copies) else f"no {unit}"
    missing = step.missing
    if not missing and step.unpublished:
        return "not published (no .metadata)"
    return f"{unit}{'s' if len(missing) > 1 else ''} {','.join(map(str, missing))} missing"


def state_text(step: StoredStep) -> str:
    return "complete" if step.complete else f"incomplete: {missing_text(step)}"


def _places_line(listing: Listing) -> str:
    places = listing.places
    durable = "no durable dir (the run's spec has no checkpoint: section)" if places.durable is None else \
        f"durable {places.durable}" + ("" if listing.durable_found else " (not on this machine)")
    if places.run_id is None:
        return durable
    return f"run {places.run_id}: {durable}; RAM on this machine {places.ram}"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def ls_lines(listing: Listing, now: float) -> list[str]:
    """What `ckpt ls` prints: where it looked, then one row per step, newest first."""
    if not listing.steps:
        return [_places_line(listing), "no checkpoints"]
    rows: list[tuple[str, ...]] = [("step", "state", "size", "age", "where")]
    for s in listing.steps:
        age = f"{duration(max(0.0, now - s.mtime))} ago" if s.mtime is not None else "-"
        rows.append((str(s.step), state_text(s), size_text(s.nbytes), age, where_text(s)))
    return [_places_line(listing), *_aligned(rows)]


def problem_text(copy: Copy, part: PartCopy) -> str:
    """`durable part 0: data does not match its checksum (...): /path/data`."""
    dcp = copy.published is not None
    what = {
        PartState.TORN: ("no manifest: not persisted yet, or torn" if dcp else "no MANIFEST: "
                         + ("not sealed yet, or torn" if copy.place is Place.MEMORY else "torn")) + "; never loaded",
        PartState.BAD_MANIFEST: "manifest unreadable, or it names another step, rank or save" if dcp else
                                "MANIFEST unreadable, or it names another step or part",
        PartState.MISSING_FILE: f"{part.file} is missing (or not a regular file)",
        PartState.SIZE_MISMATCH: f"{part.file} holds {part.found} bytes, its manifest says {part.expected}",
        PartState.CRC_MISMATCH: f"{part.file} does not match its checksum (CRC-32 {part.found or 0:08x}, "
                                f"manifest {part.expected or 0:08x})",
    }[part.state]
    at = part.path / part.file if part.file else part.path
    return f"{copy_label(copy, None)} {'rank' if dcp else 'part'} {part.part}: {what}: {at}"


def verdict(step: StoredStep) -> str:
    """`OK: <where intact>`, `CORRUPT: ...` (a copy whose manifest says complete does not match
    it) or `incomplete (never loaded): <which parts are missing>`."""
    if step.corrupt:
        return f"CORRUPT: intact in {held_text(step)}" if step.complete else f"CORRUPT: {missing_text(step)}"
    return f"OK: {held_text(step)}" if step.complete else f"incomplete (never loaded): {missing_text(step)}"


def verify_lines(listing: Listing) -> list[str]:
    """What `ckpt verify` prints: each step's verdict and where it is intact, then every torn or
    damaged copy by its file, then the count."""
    if not listing.steps:
        return [_places_line(listing), "no checkpoints"]
    out = [_places_line(listing)]
    for s in listing.steps:
        out.append(f"step {s.step}: {verdict(s)}")
        out += [f"  {problem_text(c, p)}" for c in s.copies for p in c.parts if p.state is not PartState.OK]
    bad = sum(1 for s in listing.steps if s.corrupt)
    ok = sum(1 for s in listing.steps if s.complete and not s.corrupt)
    out.append(f"{len(listing.steps)} step(s): {ok} OK, {bad} corrupt, {len(listing.steps) - ok - bad} incomplete")
    return out


def _copy_data(copy: Copy) -> dict[str, Any]:
    return {"place": copy.place.value, "host": copy.host, "origin": copy.origin, "path": str(copy.path),
            "parts": copy.ok_parts, "published": copy.published,
            "problems": [{"part": p.part, "state": p.state.value, "file": p.file, "path": str(p.path),
                          "expected": p.expected, "found": p.found} for p in copy.parts if p.state is not PartState.OK]}


def listing_data(listing: Listing, now: float) -> dict[str, Any]:
    """`ckpt ls --json` (and `verify --json`): the places and every step as data."""
    places = listing.places
    return {
        "durable": str(places.durable) if places.durable is not None else None,
        "durable_found": listing.durable_found, "run_id": places.run_id,
        "ram": str(places.ram) if places.ram is not None else None, "checksums": listing.checksums,
        "steps": [{"step": s.step, "format": s.format.value, "complete": s.complete, "corrupt": bool(s.corrupt), "parts": s.parts,
                   "missing": s.missing, "bytes": s.nbytes, "mtime": s.mtime,
                   "age_s": None if s.mtime is None else round(max(0.0, now - s.mtime), 3),
                   "where": [_copy_data(c) for c in s.copies]} for s in listing.steps],
    }
