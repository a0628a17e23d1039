"""`ddplaunch ckpt ls|verify DIR|RUN` on real tier directories saved through ddplaunch.checkpoint:
every step newest first with where it lives (the durable dir, a host's RAM, a buddy's replica naming
its origin), incomplete steps by their missing parts, --json as the same data; verify reads every
copy against its manifest, names the file of a flipped byte (exit 1), never unpickles a meta; a
missing dir or unknown run is one line, exit 2."""

from __future__ import annotations

import json
import pickle
import shutil
import uuid
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ddplaunch import checkpoint
from ddplaunch.cli import cli
from ddplaunch.hostside.ckpt import layout

ROOT = Path(__file__).resolve().parents[2]
SAVER, BUDDY = "h1", "h2"


@pytest.fixture
def tier(tmp_path):
    """Steps 10, 20, 30 saved by SAVER (keep 2: RAM holds 20 and 30; all three durable); BUDDY holds
    a replica of SAVER's step 30."""
    ram, durable, run_id = tmp_path / "shm", tmp_path / "durable", f"ck-{uuid.uuid4().hex[:10]}"
    checkpoint.configure(durable, run_id=run_id, host=SAVER, ram_root=ram, keep=2)
    for step in (10, 20, 30):
        checkpoint.save({"w": torch.arange(2000, dtype=torch.float32) * step, "step": step}, step)
        checkpoint.wait(timeout=60)
    checkpoint.free(run_id, host="none-such", ram_root=ram)  # closes this process's tier, keeps the RAM
    saved = layout.ram_part_dir(ram, run_id, SAVER, 0)
    assert layout.ram_steps(saved) == [30, 20] and layout.durable_steps(durable) == [30, 20, 10]
    shutil.copytree(saved / layout.version_name(30),
                    layout.replica_part_dir(ram, run_id, BUDDY, SAVER, 0) / layout.version_name(30))
    return {"ram": ram, "durable": durable, "run": run_id, "dir": tmp_path}


def ckpt(*args: str):
    return CliRunner().invoke(cli, ["ckpt", *map(str, args)])


def rows(output: str) -> list[list[str]]:
    """The table's rows after its header, each split on runs of two spaces."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step "))
    return [[cell.strip() for cell in line.split("  ") if cell.strip()] for line in lines[start + 1:]]


def recorded_run(tier: dict, monkeypatch) -> str:
    """A run recorded in a fresh DDPLAUNCH_HOME whose spec's checkpoint: section names the durable dir."""
    from ddplaunch.record.runs import Local, RunRecord
    from ddplaunch.spec.load import load_spec

    monkeypatch.setenv("DDPLAUNCH_HOME", str(tier["dir"] / "state"))
    spec = tier["dir"] / "c.yaml"
    spec.write_text(f"name: t\nworkdir: {ROOT}\nnproc_per_node: 1\nhealthcheck: {{enabled: false}}\n"
                    f"checkpoint: {{path: job-ckpt, durable: {tier['durable']}, tier: memory}}\n")
    RunRecord.planned(tier["run"], str(spec), load_spec(spec), Local.this_process()).save()
    return tier["run"]


def _part_dir(durable: Path, step: int, part: int = 0) -> Path:
    return durable / layout.step_name(step) / f"part-{part}"


def _flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_ls_of_a_run_lists_each_step_newest_first_and_every_place_that_holds_it(tier, monkeypatch):
    run = recorded_run(tier, monkeypatch)
    out = ckpt("ls", run, "--ram-root", tier["ram"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].startswith(f"run {run}: durable {tier['durable']}")
    got = rows(out.output)
    assert [r[0] for r in got] == ["30", "20", "10"]
    assert all(r[1] == "complete" and r[2].endswith("KiB") and r[3].endswith("ago") for r in got), got
    assert [r[4] for r in got] == [f"durable, RAM {SAVER}, RAM {BUDDY} (replica of {SAVER})",
                                   f"durable, RAM {SAVER}", "durable"]


def test_ls_of_a_dir_lists_its_steps_and_an_incomplete_one_by_its_missing_part(tier):
    layout.write_durable(tier["durable"], 40, 0, 2, b"meta", layout.copy_file_writer(
        _part_dir(tier["durable"], 30) / layout.DATA), tag="t")  # part 0 of 2: part 1 never arrived
    out = ckpt("ls", tier["durable"])
    assert out.exit_code == 0, out.output
    got = rows(out.output)
    assert [(r[0], r[1], r[4]) for r in got] == [("40", "incomplete: part 1 missing", "durable part 0"),
                                                 ("30", "complete", "durable"), ("20", "complete", "durable"),
                                                 ("10", "complete", "durable")]


def test_ls_json_is_the_same_as_data(tier, monkeypatch):
    run = recorded_run(tier, monkeypatch)
    out = ckpt("ls", run, "--ram-root", tier["ram"], "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["run_id"] == run and data["durable"] == str(tier["durable"]) and data["durable_found"]
    assert [s["step"] for s in data["steps"]] == [30, 20, 10]
    newest = data["steps"][0]
    assert newest["complete"] and newest["parts"] == 1 and newest["missing"] == [] and not newest["corrupt"]
    assert newest["bytes"] > 8000 and newest["age_s"] >= 0
    assert [(w["place"], w["host"], w["origin"], w["parts"]) for w in newest["where"]] == [
        ("durable", None, None, [0]), ("memory", SAVER, SAVER, [0]), ("memory", BUDDY, SAVER, [0])]
    assert newest["where"][2]["path"].endswith(f"{BUDDY}/replicas/{SAVER}")


def test_verify_reads_every_copy_and_says_ok(tier, monkeypatch):
    run = recorded_run(tier, monkeypatch)
    out = ckpt("verify", run, "--ram-root", tier["ram"])
    assert out.exit_code == 0, out.output
    assert f"step 30: OK: durable, RAM {SAVER}, RAM {BUDDY} (replica of {SAVER})" in out.output
    assert out.output.splitlines()[-1] == "3 step(s): 3 OK, 0 corrupt, 0 incomplete"


def test_verify_names_the_file_of_a_flipped_byte_and_exits_1(tier, monkeypatch):
    run = recorded_run(tier, monkeypatch)
    assert ckpt("ls", tier["durable"]).exit_code == 0
    bad = _part_dir(tier["durable"], 20) / layout.DATA
    _flip_a_byte(bad)  # same size: only the checksum can tell
    replica = layout.replica_part_dir(tier["ram"], run, BUDDY, SAVER, 0) / layout.version_name(30) / layout.META
    replica.write_bytes(replica.read_bytes()[:-3])  # cut short: its size tells
    out = ckpt("verify", run, "--ram-root", tier["ram"])
    assert out.exit_code == 1, out.output
    lines = out.output.splitlines()
    assert f"step 20: CORRUPT: intact in RAM {SAVER}" in lines
    assert f"step 30: CORRUPT: intact in durable, RAM {SAVER}" in lines
    assert any(line.startswith("  durable part 0: data does not match its checksum") and line.endswith(f": {bad}")
               for line in lines), out.output
    assert any(f"RAM {BUDDY} (replica of {SAVER}) part 0: meta holds" in line and line.endswith(f": {replica}")
               for line in lines), out.output
    assert lines[-1] == "3 step(s): 1 OK, 2 corrupt, 0 incomplete"
    listed = rows(ckpt("ls", run, "--ram-root", tier["ram"]).output)  # ls reads sizes only
    assert listed[0][4] == f"durable, RAM {SAVER} (+1 torn or damaged: ckpt verify)"
    assert listed[1][4] == f"durable, RAM {SAVER}"
    assert ckpt("verify", tier["durable"], "--json").exit_code == 1


def test_a_missing_or_torn_part_is_incomplete_not_corrupt(tier):
    shutil.rmtree(_part_dir(tier["durable"], 20))
    (_part_dir(tier["durable"], 10) / layout.MANIFEST).unlink()
    layout.write_durable(tier["durable"], 40, 1, 2, b"meta", layout.copy_file_writer(
        _part_dir(tier["durable"], 30) / layout.DATA), tag="t")  # part 1 of 2: part 0 never arrived
    out = ckpt("verify", tier["durable"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert "step 40: incomplete (never loaded): part 0 missing" in lines
    assert "step 20: incomplete (never loaded): no part" in lines
    assert "step 10: incomplete (never loaded): no manifest" in lines
    assert f"  durable part 0: no MANIFEST: torn; never loaded: {_part_dir(tier['durable'], 10) / 'MANIFEST'}" \
        in lines
    assert lines[-1] == "4 step(s): 1 OK, 0 corrupt, 3 incomplete"


def test_verify_never_unpickles_a_meta(tmp_path):
    """A meta that would run code when unpickled, with a manifest that matches it: checked, not run."""
    marker = tmp_path / "ran"
    meta = pickle.dumps(_Runs(str(marker)))
    data = b"\0" * 64
    part = tmp_path / "d" / layout.step_name(5) / "part-0"
    part.mkdir(parents=True)
    (part / layout.META).write_bytes(meta)
    (part / layout.DATA).write_bytes(data)
    manifest = layout.Manifest(5, 0, 1, {layout.META: (len(meta), zlib.crc32(meta)),
                                         layout.DATA: (len(data), zlib.crc32(data))})
    (part / layout.MANIFEST).write_bytes(manifest.encode())
    out = ckpt("verify", tmp_path / "d")
    assert out.exit_code == 0 and "step 5: OK: durable" in out.output, out.output
    assert not marker.exists()


class _Runs:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_a_missing_dir_or_unknown_run_is_one_line_exit_2(tmp_path, monkeypatch, command):
    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    for target in (tmp_path / "nope", "no-such-run"):
        out = ckpt(command, target)
        assert out.exit_code == 2, out.output
        assert out.output.count("\n") == 1 and "Traceback" not in out.output, out.output
        assert out.output.startswith(f"ddplaunch: error: {target}: no such directory, and no recorded run")
    (tmp_path / "empty").mkdir()
    empty = ckpt(command, tmp_path / "empty")
    assert empty.exit_code == 0 and empty.output.splitlines() == [f"durable {tmp_path / 'empty'}", "no checkpoints"]


def test_dcp_steps_are_listed_complete_once_published_and_verified_rank_by_rank(tmp_path):
    """`<durable>/dcp/` steps saved by dcp_save: complete = `.metadata` published; verify reads each
    rank's files against its manifest's CRC and names the file of a flipped byte."""
    durable, run_id = tmp_path / "durable", f"ck-{uuid.uuid4().hex[:10]}"
    checkpoint.configure(durable, run_id=run_id, host=SAVER, ram_root=tmp_path / "shm")
    for step in (5, 6):
        checkpoint.dcp_save({"w": torch.arange(2000, dtype=torch.float32) * step}, step)
        checkpoint.dcp_wait(timeout=60)
    checkpoint.dcp_close()
    checkpoint.free(run_id, ram_root=tmp_path / "shm")
    dcp_dir = durable / "dcp"
    six = dcp_dir / layout.step_name(6)
    for step, world in ((7, 1), (8, 2)):  # 7: every rank's files there, never published; 8: rank 1 never came
        shutil.copytree(six, dcp_dir / layout.step_name(step))
        (dcp_dir / layout.step_name(step) / ".metadata").unlink()
        mark = dcp_dir / layout.step_name(step) / ".ranks" / "0.json"
        mark.write_text(json.dumps(dict(json.loads(mark.read_text()), step=step, world=world)))
    listed = rows(ckpt("ls", durable).output)
    assert [(r[0], r[1], r[4]) for r in listed] == [
        ("8", "incomplete: rank 1 missing", "durable DCP rank 0"),
        ("7", "incomplete: not published (no .metadata)", "durable DCP"),
        ("6", "complete", "durable DCP"), ("5", "complete", "durable DCP")]
    bad = dcp_dir / layout.step_name(5) / "__0_0.distcp"
    _flip_a_byte(bad)
    out = ckpt("verify", durable)
    assert out.exit_code == 1, out.output
    lines = out.output.splitlines()
    assert "step 6: OK: durable DCP" in lines and "step 5: CORRUPT: rank 0 missing" in lines
    assert "step 7: incomplete (never loaded): not published (no .metadata)" in lines
    assert any(line.startswith("  durable DCP rank 0: __0_0.distcp does not match its checksum")
               and line.endswith(f": {bad}") for line in lines), out.output
    assert lines[-1] == "4 step(s): 1 OK, 1 corrupt, 2 incomplete"
    data = json.loads(ckpt("ls", durable, "--json").output)
    assert [(s["step"], s["format"], s["complete"], s["parts"]) for s in data["steps"]] == [
        (8, "dcp", False, 2), (7, "dcp", False, 1), (6, "dcp", True, 1), (5, "dcp", True, 1)]
