"""`checkpoint.watch` on one host, for real files (no launcher): which entries of a job's own
checkpoint dir are checkpoints and of which step (HF Trainer, Lightning, nanoGPT, DCP), the watch
sealing the newest complete one into the RAM tier and persisting it as the job's own files, and the
restore putting it back from RAM, a buddy's replica, or the durable dir, skipping torn copies."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ddplaunch.hostside.ckpt import jobfiles, jobwatch, layout, restore
from ddplaunch.sim.faults import wipe_memory_tier

HOST, RUN = "hosta", "run-jf"


def _hf(root: Path, step: int, *, marker: bool = True) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    (d / "rng_state_0.pth").write_bytes(b"rng0")
    if marker:
        (d / jobfiles.HF_MARKER).write_text(json.dumps({"global_step": step, "epoch": 0.5}))
    return d


def _lightning(root: Path, step: int, name: str = "last.ckpt") -> Path:
    path = root / name
    root.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "epoch": 0, "state_dict": {"w": torch.arange(64.0) * step},
                "hyper_parameters": {"lr": 0.1}}, path)
    return path


def test_each_framework_s_checkpoint_is_found_with_its_step(tmp_path):
    _hf(tmp_path, 20)
    _hf(tmp_path, 30, marker=False)  # no trainer_state.json yet: being written
    _lightning(tmp_path / "lightning", 40)
    torch.save({"iter_num": 250, "model": {"w": torch.ones(3)}}, tmp_path / "ckpt.pt")  # nanoGPT
    (tmp_path / "step_60").mkdir()
    (tmp_path / "step_60" / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / "step_60" / jobfiles.DCP_MARKER).write_bytes(b"meta")
    (tmp_path / "tmp-checkpoint-70").mkdir()  # the Trainer's own temporary: never a unit
    (tmp_path / "tmp-checkpoint-70" / jobfiles.HF_MARKER).write_text('{"global_step": 70}')
    units = {u.rel: u for u in jobfiles.find_units(tmp_path)}
    assert sorted(units) == ["checkpoint-20", "checkpoint-30", "ckpt.pt", "lightning/last.ckpt", "step_60"]
    with pytest.raises(jobfiles.Incomplete):
        jobfiles.step_of(tmp_path, units.pop("checkpoint-30"))
    assert {rel: jobfiles.step_of(tmp_path, u) for rel, u in units.items()} == \
        {"checkpoint-20": 20, "ckpt.pt": 250, "lightning/last.ckpt": 40, "step_60": 60}
    assert {f[0] for f in units["checkpoint-20"].files} == \
        {"checkpoint-20/model.safetensors", "checkpoint-20/rng_state_0.pth", "checkpoint-20/trainer_state.json"}


def test_a_half_written_torch_save_is_not_complete(tmp_path):
    whole = _lightning(tmp_path, 8).read_bytes()
    (tmp_path / "last.ckpt").write_bytes(whole[:len(whole) // 2])
    (unit,) = jobfiles.find_units(tmp_path)
    with pytest.raises(jobfiles.Unreadable):
        jobfiles.step_of(tmp_path, unit)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_reading_a_step_runs_nothing_the_pickle_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"global_step": 5, "x": _Boom()}, path)
    assert jobfiles.pickled_step(path) == 5
    assert not (tmp_path / "pwned").exists()


def _watch(tmp_path: Path, keep: int = 2) -> jobwatch.Watch:
    ram = tmp_path / "shm"
    where = restore.Where(ram, RUN, HOST, 0, tmp_path / "durable")
    return jobwatch.Watch(where.prepared(), where.host_dir, tmp_path / "durable", HOST, keep, said.append)


said: list[str] = []


def _where(tmp_path: Path, host: str = HOST, node: int = 0) -> restore.Where:
    return restore.Where(tmp_path / "shm", RUN, host, node, tmp_path / "durable")


def test_the_watch_seals_a_unit_once_unchanged_and_persists_the_job_s_own_files(tmp_path):
    watch = _watch(tmp_path)
    _hf(watch.jobdir, 10)
    assert watch.look() is None  # seen once: the job may still be writing it
    assert watch.look() == 10
    assert watch.look() is None  # nothing new
    version = watch.part_dir / layout.version_name(10)
    assert (version / layout.MANIFEST).is_file()
    for rel in ("model.safetensors", "rng_state_0.pth", "trainer_state.json"):
        assert (tmp_path / "durable" / "checkpoint-10" / rel).read_bytes() == (watch.jobdir / "checkpoint-10" / rel).read_bytes()
    (record,) = jobwatch.durable_records(tmp_path / "durable", 10)
    assert record["host"] == HOST and len(record["files"]) == 3
    for step in (20, 30):
        _hf(watch.jobdir, step)
        watch.look()
        assert watch.look() == step
    assert layout.ram_steps(watch.part_dir) == [30, 20]  # keep: 2


def test_a_unit_rewritten_under_the_same_name_is_sealed_again_at_its_new_step(tmp_path):
    watch = _watch(tmp_path)
    _lightning(watch.jobdir, 4)
    watch.look()
    assert watch.look() == 4
    _lightning(watch.jobdir, 8)
    os.utime(watch.jobdir / "last.ckpt", ns=(1, 1))  # a new mtime, whatever the clock's grain
    watch.look()
    assert watch.look() == 8
    assert torch.load(tmp_path / "durable" / "last.ckpt")["global_step"] == 8


def test_finish_makes_the_last_checkpoint_durable_without_a_second_look(tmp_path):
    watch = _watch(tmp_path)
    _lightning(watch.jobdir, 12)
    env = {"DDPLAUNCH_CHECKPOINT_WATCH": "1", "DDPLAUNCH_RUN_ID": RUN, "DDPLAUNCH_HOST": HOST,
           "DDPLAUNCH_CHECKPOINT_RAM": str(tmp_path / "shm"), "DDPLAUNCH_CHECKPOINT_DURABLE": str(tmp_path / "durable")}
    assert jobwatch.finish(env, said.append) == (12, "")
    assert torch.load(tmp_path / "durable" / "last.ckpt")["global_step"] == 12


def _sealed_hf(tmp_path: Path, steps: list[int]) -> jobwatch.Watch:
    watch = _watch(tmp_path, keep=3)
    for step in steps:
        _hf(watch.jobdir, step)
        watch.look()
        assert watch.look() == step
    return watch


def _restore(where: restore.Where) -> restore.Restored | None:
    where.prepared()
    with restore._group_of_one():
        return restore.agree(where)


def test_a_new_host_gets_the_checkpoint_back_from_a_buddy_s_replica_in_its_ram(tmp_path):
    watch = _sealed_hf(tmp_path, [10, 20])
    expected = (watch.jobdir / "checkpoint-20" / "model.safetensors").read_bytes()
    # host b holds a's part as a buddy does (replicas.py lands it here); a's RAM is gone
    replica = layout.replica_part_dir(tmp_path / "shm", RUN, "hostb", HOST, jobfiles.FILES_PART)
    replica.parent.mkdir(parents=True)
    shutil.copytree(watch.part_dir, replica)
    wipe_memory_tier(HOST, tmp_path / "shm")  # a's power lost: its parts and its node's job dir
    assert not watch.jobdir.exists()
    shutil.rmtree(tmp_path / "durable")  # nothing is read from there: it is not there
    got = _restore(_where(tmp_path, "hostb"))
    assert got is not None and (got.step, got.source, got.host, got.origin) == (20, "memory", "hostb", HOST)
    jobdir = _where(tmp_path, "hostb").jobdir
    assert (jobdir / "checkpoint-20" / "model.safetensors").read_bytes() == expected
    assert json.loads((jobdir / "checkpoint-20" / jobfiles.HF_MARKER).read_text())["global_step"] == 20


def test_a_torn_ram_copy_is_skipped_for_the_durable_copy_and_a_half_written_newer_unit_removed(tmp_path):
    watch = _sealed_hf(tmp_path, [10, 20])
    data = watch.part_dir / layout.version_name(20) / layout.DATA
    data.write_bytes(b"x" * data.stat().st_size)  # same size, other bytes: the checksum tells
    _hf(watch.jobdir, 30, marker=False)  # its host died while writing it
    shutil.rmtree(watch.jobdir / "checkpoint-20")
    got = _restore(_where(tmp_path))
    assert got is not None and (got.step, got.source) == (20, "durable")
    assert (watch.jobdir / "checkpoint-20" / jobfiles.HF_MARKER).is_file()
    assert not (watch.jobdir / "checkpoint-30").exists()


def test_a_damaged_durable_file_falls_back_to_the_older_step(tmp_path):
    watch = _sealed_hf(tmp_path, [10, 20])
    wipe_memory_tier(HOST, tmp_path / "shm")  # power loss: no RAM copy at all
    (tmp_path / "durable" / "checkpoint-20" / "model.safetensors").write_bytes(b"damaged")
    got = _restore(_where(tmp_path))
    assert got is not None and (got.step, got.source) == (10, "durable")
    assert not (_where(tmp_path).jobdir / "checkpoint-20").exists()


def test_nothing_anywhere_restores_nothing(tmp_path):
    assert _restore(_where(tmp_path)) is None
    assert os.listdir(_where(tmp_path).jobdir) == [jobfiles.OWNER]


def test_a_spare_taking_a_node_starts_with_an_empty_job_dir(tmp_path):
    """The sim's hosts share /dev/shm: the node's dir another host left is not the spare's RAM."""
    watch = _sealed_hf(tmp_path, [10])
    assert (watch.jobdir / "checkpoint-10").is_dir()
    assert _where(tmp_path, "spare").prepared() == watch.jobdir
    assert os.listdir(watch.jobdir) == [jobfiles.OWNER]
    assert (watch.jobdir / jobfiles.OWNER).read_text() == "spare"


def test_a_meta_naming_a_path_outside_the_job_dir_is_refused():
    evil = json.dumps({"format": jobfiles.FORMAT, "step": 1, "units": [["../x", "torch"]],
                       "files": [["../x", 1, 0o600]]}).encode()
    with pytest.raises(layout.TornCheckpoint, match="outside the job dir"):
        jobfiles.Packed.decode(evil)


RESTORE_ONE = ("import json, os, dataclasses; from ddplaunch.hostside.ckpt import restore; "
               "got = restore.restore(os.environ); print('GOT', json.dumps(got and dataclasses.asdict(got)))")


def test_the_restore_of_two_nodes_sends_the_part_one_holds_to_the_other(tmp_path):
    """Two nodes (hosta with two ranks, hostb new and empty) meet on a real store and a Gloo group:
    hosta's leader sends its RAM copy, hostb's writes it; hosta's second rank waits for its node."""
    import socket
    import subprocess
    import sys

    from torch.distributed import TCPStore

    watch = _sealed_hf(tmp_path, [10, 20])
    expected = (watch.jobdir / "checkpoint-20" / "model.safetensors").read_bytes()
    shutil.rmtree(watch.jobdir)  # the job dir lost (the tier's sealed part kept): put back from RAM
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # torchrun's agent store
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GROUP_WORLD_SIZE": "2",
            "DDPLAUNCH_RUN_ID": RUN, "DDPLAUNCH_CHECKPOINT_RAM": str(tmp_path / "shm"),
            "DDPLAUNCH_CHECKPOINT_DURABLE": str(tmp_path / "durable"), "LOCAL_WORLD_SIZE": "2"}
    ranks = [("hosta", 0, 0, 0), ("hosta", 0, 1, 1), ("hostb", 1, 0, 2)]
    procs = [subprocess.Popen([sys.executable, "-c", RESTORE_ONE], stdout=subprocess.PIPE, text=True,
                              env={**base, "DDPLAUNCH_HOST": host, "GROUP_RANK": str(node), "LOCAL_RANK": str(local),
                                   "RANK": str(rank)})
             for host, node, local, rank in ranks]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    del store
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    got = [json.loads(o.split("GOT ", 1)[1]) for o in outs]
    assert got[1] is None  # a node's other ranks only wait for its leader
    for g in (got[0], got[2]):
        assert (g["step"], g["source"], g["host"], g["origin"]) == (20, "memory", "hosta", HOST)
    for host in ("hosta", "hostb"):
        node = {"hosta": 0, "hostb": 1}[host]
        assert (_where(tmp_path, host, node).jobdir / "checkpoint-20" / "model.safetensors").read_bytes() == expected
