"""ddplaunch.checkpoint reading buddies' replicas (hostside/ckpt/reader.py): a replica a host holds
of another host's part counts as a RAM copy; under a Gloo process group of three ranks, each as if on
a host of its own (one RAM root), a step held only in one host's RAM is read there and sent to every
rank (nothing read from the durable dir); a torn replica is skipped for the next copy, said once;
with nothing in RAM every rank reads the durable dir; rank 0 says what it loaded as a payload line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ddplaunch import checkpoint
from ddplaunch.hostside import payloads
from ddplaunch.hostside.ckpt import layout

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3
ORIGIN = "h9"  # the host that saved: no rank runs there any more

_WORKER = """
import hashlib, json, os, sys, warnings
import torch.distributed as dist
from ddplaunch import checkpoint
from ddplaunch.hostside.ckpt import reader

args = json.loads(sys.argv[1])
rank, durable = args["rank"], args["durable"]
dist.init_process_group("gloo", init_method="file://" + args["store"], rank=rank, world_size=args["world"])
checkpoint.configure(durable, run_id=args["run"], host=f"h{rank}", ram_root=args["ram"])
reader.WIRE_CHUNK = 1000  # one state in several broadcasts
opened, recording = [], [False]

def reads_a_file(mode, flags):  # not a write (the holder persists what it read: a write there is fine)
    if isinstance(mode, str):
        return not any(c in mode for c in "wax+")
    return isinstance(flags, int) and not flags & (os.O_WRONLY | os.O_RDWR | os.O_DIRECTORY)

def audit(event, a):
    if recording[0] and event == "open" and isinstance(a[0], (str, bytes, os.PathLike)):
        if os.fsdecode(a[0]).startswith(durable) and reads_a_file(a[1], a[2]):
            opened.append(os.fsdecode(a[0]))

sys.addaudithook(audit)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    recording[0] = True
    got = checkpoint.load()
    again = checkpoint.load()  # a torn copy is said once
    recording[0] = False
src = got.source
with open(f"{args['out']}/rank-{rank}.json", "w") as out:
    json.dump({"step": got.step, "again": again.step, "where": src.where.value, "host": src.host,
               "origin": src.origin, "path": str(src.path), "durable_opens": len(opened),
               "digest": hashlib.sha256(got.state["w"].numpy().tobytes()).hexdigest(),
               "said": [str(w.message) for w in said]}, out)
dist.destroy_process_group()
"""


def _state(step: int) -> dict:
    return {"w": torch.arange(3000, dtype=torch.float32) * step, "step": step}


def _digest(step: int) -> str:
    return hashlib.sha256(_state(step)["w"].numpy().tobytes()).hexdigest()


@pytest.fixture
def run(tmp_path):
    """A run whose steps 1 and 2 ORIGIN saved (RAM and durable dir); then ORIGIN's RAM is gone."""
    ram, durable, run_id = tmp_path / "shm", tmp_path / "durable", f"test-{uuid.uuid4().hex[:12]}"
    checkpoint.configure(durable, run_id=run_id, host=ORIGIN, ram_root=ram)
    for step in (1, 2):
        checkpoint.save(_state(step), step)
        checkpoint.wait(timeout=60)
    checkpoint.free(run_id, host="none-such", ram_root=ram)  # closes this process's tier, keeps the RAM
    kept = tmp_path / "saved"
    shutil.move(layout.ram_part_dir(ram, run_id, ORIGIN, 0), kept)
    shutil.rmtree(layout.ram_base(ram) / run_id / ORIGIN)
    yield {"ram": ram, "durable": durable, "run": run_id, "saved": kept, "dir": tmp_path}


def _replicate(run: dict, holder: str, step: int, part: int = 0) -> Path:
    """ORIGIN's sealed version of `step` copied into `holder`'s RAM as a buddy's replica; its path."""
    there = layout.replica_part_dir(run["ram"], run["run"], holder, ORIGIN, part) / layout.version_name(step)
    shutil.copytree(run["saved"] / layout.version_name(step), there)
    return there


def _flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _load_on_every_rank(run: dict) -> tuple[list[dict], str]:
    """Each of WORLD ranks (host h<rank>) loads twice; what each got, and rank 0's stdout."""
    out = run["dir"] / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               DDPLAUNCH_RUN_ID=run["run"], TORCHELASTIC_RUN_ID="test")  # as under ddplaunch's torchrun
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps({
        "rank": rank, "world": WORLD, "store": str(run["dir"] / "store"), "durable": str(run["durable"]),
        "run": run["run"], "ram": str(run["ram"]), "out": str(out)})], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT) for rank in range(WORLD)]
    try:
        said = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * WORLD, said
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(WORLD)], said[0]


def _loaded_lines(stdout: str) -> list[payloads.Loaded]:
    prefix = f"DDPLAUNCH_{payloads.Loaded.KIND}_JSON "
    return [payloads.read_payload(payloads.Loaded.KIND, line[len(prefix):])
            for line in stdout.splitlines() if line.startswith(prefix)]


def _torn_said(got: dict) -> list[str]:
    return [m for m in got["said"] if "torn copy" in m]


def test_a_step_only_in_one_hosts_replica_is_sent_to_every_rank_and_the_durable_dir_is_not_read(run):
    shutil.rmtree(run["durable"] / layout.step_name(2))  # the durable dir holds only step 1
    replica = _replicate(run, "h1", 2)
    _replicate(run, "h2", 2)
    got, stdout = _load_on_every_rank(run)
    assert [(g["step"], g["again"], g["where"], g["host"], g["origin"], g["path"]) for g in got] == \
        [(2, 2, "memory", "h1", ORIGIN, str(replica))] * WORLD  # the lowest rank holding it read it
    assert [g["digest"] for g in got] == [_digest(2)] * WORLD
    assert [g["durable_opens"] for g in got] == [0] * WORLD
    assert _loaded_lines(stdout) == [payloads.Loaded(0, str(replica), "ddplaunch.checkpoint", step=2,
                                                     source="memory", host="h1", origin=ORIGIN)] * 2


@pytest.mark.parametrize("intact_on_h2", [False, True])
def test_a_torn_replica_is_skipped_for_the_next_copy_said_once(run, intact_on_h2):
    shutil.rmtree(run["durable"] / layout.step_name(2))
    _flip_a_byte(_replicate(run, "h1", 2) / layout.DATA)
    if intact_on_h2:
        _replicate(run, "h2", 2)
    got, _ = _load_on_every_rank(run)
    want = (2, "memory", "h2", ORIGIN) if intact_on_h2 else (1, "durable", None, None)
    assert [(g["step"], g["where"], g["host"], g["origin"]) for g in got] == [want] * WORLD
    assert [g["digest"] for g in got] == [_digest(want[0])] * WORLD
    assert [len(_torn_said(g)) for g in got] == [0, 1, 0]  # only the host that read it knows; once
    assert "step 2" in _torn_said(got[1])[0]


def test_with_nothing_in_ram_every_rank_reads_the_durable_dir(run):
    got, stdout = _load_on_every_rank(run)
    assert [(g["step"], g["where"], g["host"], g["origin"], g["digest"]) for g in got] == \
        [(2, "durable", None, None, _digest(2))] * WORLD
    assert all(g["durable_opens"] > 0 for g in got)  # each rank read its own copy
    path = str(run["durable"] / layout.step_name(2) / "part-0")
    assert _loaded_lines(stdout) == [payloads.Loaded(0, path, "ddplaunch.checkpoint", step=2, source="durable")] * 2


def test_one_process_counts_the_replicas_it_holds_of_part_0_and_of_its_own_part(run, monkeypatch):
    """No process group: a replica is one of this host's RAM copies, of the one part and, with
    `all_ranks`, of this rank's own part."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    checkpoint.configure(run["durable"], run_id=run["run"], host=ORIGIN, ram_root=run["ram"])
    checkpoint.save({"w": torch.full((4,), 51.0)}, 5, all_ranks=True)  # rank 1's part of step 5
    checkpoint.wait(timeout=60)
    shutil.copytree(layout.ram_part_dir(run["ram"], run["run"], ORIGIN, 1) / layout.version_name(5),
                    layout.replica_part_dir(run["ram"], run["run"], "h1", ORIGIN, 1) / layout.version_name(5))
    shutil.rmtree(layout.ram_base(run["ram"]) / run["run"] / ORIGIN)
    shutil.rmtree(run["durable"])
    checkpoint.configure(run["durable"], run_id=run["run"], host="h1", ram_root=run["ram"])
    try:
        replica = _replicate(run, "h1", 2)
        got = checkpoint.load()
        assert (got.step, got.source) == (2, checkpoint.Source(checkpoint.Where.MEMORY, "h1", replica, ORIGIN))
        assert got.state["w"].equal(_state(2)["w"])
        mine = checkpoint.load(all_ranks=True)
        assert (mine.step, mine.source.where, mine.source.origin) == (5, checkpoint.Where.MEMORY, ORIGIN)
        assert mine.state["w"].tolist() == [51.0] * 4
    finally:
        checkpoint.free(run["run"], host="none-such", ram_root=run["ram"])


def test_the_loaded_payload_carries_step_and_source_and_old_lines_still_read():
    line = payloads.payload_line(payloads.Loaded(0, "/x", "ddplaunch.checkpoint", step=7, source="memory",
                                                 host="h1", origin="h9"))
    kind, text = line.split(" ", 1)
    assert kind == "DDPLAUNCH_LOADED_JSON"
    assert payloads.read_payload("LOADED", text) == payloads.Loaded(0, "/x", "ddplaunch.checkpoint", 7, "memory",
                                                                    "h1", "h9")
    old = payloads.read_payload("LOADED", json.dumps({"rank": 0, "path": "/ckpt.pt", "via": "torch.load"}))
    assert old == payloads.Loaded(0, "/ckpt.pt", "torch.load")
    assert (old.step, old.source, old.host, old.origin) == (None, "", "", "")
    assert payloads.read_payload("LOADED", json.dumps({"rank": 0, "path": "/x", "step": "7"})) is None


def test_a_step_loaded_from_ram_that_the_durable_dir_lacks_is_made_durable(run):
    """The saver's host was lost before it persisted step 2: the process that loads the buddy's
    copy persists it (the careful write), so the run's end loses nothing that was in RAM."""
    shutil.rmtree(run["durable"] / layout.step_name(2))
    checkpoint.configure(run["durable"], run_id=run["run"], host="h1", ram_root=run["ram"])
    try:
        _replicate(run, "h1", 2)
        got = checkpoint.load()
        assert (got.step, got.source.where) == (2, checkpoint.Where.MEMORY)
    finally:
        checkpoint.free(run["run"], host="none-such", ram_root=run["ram"])  # closes the tier: its persist ends first
    _, _, data = layout.read_verified(run["durable"] / layout.step_name(2) / "part-0", 2, 0)
    assert bytes(data) == (run["saved"] / layout.version_name(2) / layout.DATA).read_bytes()
    assert layout.durable_parts_complete(run["durable"], 2)


def test_at_exit_a_rank_that_saved_says_its_newest_save_is_durable(tmp_path):
    """Under ddplaunch (torchrun's environment), the exit of a process that saved waits for its
    newest save to be durable and says so: a `Durable` payload with the step and the wait."""
    import subprocess
    import sys

    job = ("import torch\nfrom ddplaunch import checkpoint\n"
           f"checkpoint.configure({str(tmp_path / 'durable')!r}, host='h1', ram_root={str(tmp_path / 'shm')!r})\n"
           "for step in (3, 6):\n    checkpoint.save({'w': torch.full((1 << 20,), float(step))}, step)\n")
    env = {**os.environ, "DDPLAUNCH_RUN_ID": f"test-{uuid.uuid4().hex[:12]}", "TORCHELASTIC_RUN_ID": "x"}
    out = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=120, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    (said,) = [payloads.read_payload("DURABLE", line.split(" ", 1)[1]) for line in out.stdout.splitlines()
               if line.startswith("DDPLAUNCH_DURABLE_JSON ")]
    assert (said.rank, said.step, said.failed) == (0, 6, "") and said.after_s >= 0
    assert layout.durable_parts_complete(tmp_path / "durable", 6)
    plain = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"},
                           cwd=Path(__file__).resolve().parents[2])
    assert plain.returncode == 0 and "DDPLAUNCH_DURABLE_JSON" not in plain.stdout  # a plain process: silent
