"""ddplaunch.checkpoint's DCP writer and reader (hostside/ckpt/dcp.py): a save lands in this host's
RAM and comes back from it; the durable copy is a plain DCP checkpoint torch's FileSystemReader
loads; a torn RAM copy is skipped for the durable one; a step that is not complete (unsealed in RAM,
unpublished in the durable dir) is never loaded; and FSDP2 under torchrun: saved at world 4,
resumed at world 4 from RAM and at world 2 (resharded) from the durable copy, parameters equal."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddplaunch import checkpoint
from ddplaunch.hostside import payloads
from ddplaunch.hostside.ckpt import dcp as ckdcp
from ddplaunch.hostside.ckpt import dcpfiles, layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun_util sits beside us, whatever the import mode
from torchrun_util import ROOT, run_torchrun  # noqa: E402


@pytest.fixture
def tier(tmp_path):
    run = f"test-{uuid.uuid4().hex[:12]}"
    config = checkpoint.configure(tmp_path / "durable", run_id=run, host="h1")
    yield config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        checkpoint.dcp_close()
        checkpoint.free(run)
    assert not (layout.ram_base(config.ram_root) / run).exists()


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}, "step": torch.tensor(seed), "lr": 0.5 + seed}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "step": torch.tensor(0), "lr": 0.0}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b")) and \
        torch.equal(a["step"], b["step"]) and a["lr"] == b["lr"]


def _ram_version(config, step: int) -> Path:
    return ckdcp.rank_dir(config, 0) / layout.version_name(step)


def test_a_save_comes_back_from_ram_and_its_durable_copy_is_a_plain_dcp_checkpoint(tier):
    saved = _state(1)
    checkpoint.dcp_save(saved, 1)
    assert checkpoint.dcp_wait(timeout=60) == 1
    got = _blank()
    loaded = checkpoint.dcp_load(got)
    assert loaded is not None and loaded.step == 1 and loaded.source.where is checkpoint.Where.MEMORY
    assert loaded.source.path == _ram_version(tier, 1) and _equal(got, saved)
    step_dir = tier.durable / "dcp" / layout.step_name(1)
    plain = _blank()
    dcp.load(plain, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    assert _equal(plain, saved)
    assert sorted(p.name for p in step_dir.iterdir()) == [".metadata", ".ranks", "__0_0.distcp"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in step_dir.rglob("*") if p.is_file())


def test_a_torn_ram_copy_is_skipped_for_the_durable_copy_and_said_once(tier):
    saved = _state(2)
    checkpoint.dcp_save(saved, 2)
    checkpoint.dcp_wait(timeout=60)
    data = _ram_version(tier, 2) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    got = _blank()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loaded = checkpoint.dcp_load(got)
    assert loaded is not None and loaded.step == 2 and loaded.source.where is checkpoint.Where.DURABLE
    assert _equal(got, saved)
    assert [str(w.message) for w in said if "torn" in str(w.message)] != []


def test_a_step_that_is_not_complete_anywhere_is_never_loaded(tier):
    """Step 2 unsealed in RAM (no MANIFEST) and unpublished in the durable dir (no .metadata):
    step 1 is loaded."""
    first = _state(1)
    checkpoint.dcp_save(first, 1)
    checkpoint.dcp_save(_state(2), 2)
    checkpoint.dcp_wait(timeout=60)
    (_ram_version(tier, 2) / layout.MANIFEST).unlink()
    (tier.durable / "dcp" / layout.step_name(2) / ".metadata").unlink()
    assert ckdcp.published_steps(tier.durable) == [1]
    got = _blank()
    loaded = checkpoint.dcp_load(got)
    assert loaded is not None and loaded.step == 1 and _equal(got, first)


def test_rank_0_publishes_a_step_only_once_every_rank_has_persisted_its_files(tier):
    """A save of 2 ranks whose rank 1 never persists: rank 0's files are durable, the step is not
    (no .metadata; the reason says which rank is missing)."""
    checkpoint.dcp_save(_state(3), 3)
    checkpoint.dcp_wait(timeout=60)
    manifest = ckdcp.RankManifest.read(_ram_version(tier, 3) / layout.MANIFEST)
    lone = ckdcp.DcpTier(tier, publish_timeout=0.2)
    job = ckdcp._Job(4, 0, 2, "a-save-of-two-ranks", _ram_version(tier, 3))
    with pytest.raises(checkpoint.CheckpointError, match=r"ranks \[1\] did not persist"):
        lone._persist_one(job)
    target = tier.durable / "dcp" / layout.step_name(4)
    assert (target / "__0_0.distcp").is_file() and not (target / ".metadata").exists()
    assert ckdcp.published_steps(tier.durable) == [3] and manifest.world == 1


def test_nothing_saved_loads_none(tier):
    assert checkpoint.dcp_load(_blank()) is None and checkpoint.dcp_wait() is None


def _payloads(out: str) -> list:
    """The payload lines a job printed, read as ddplaunch reads them."""
    got = []
    for line in out.splitlines():
        m = re.match(r"DDPLAUNCH_([A-Z_]+)_JSON (.*)$", line)
        if m:
            got.append(payloads.read_payload(m.group(1), m.group(2)))
    return got


def test_under_ddplaunch_rank_0_says_what_it_loaded_and_that_its_newest_save_is_durable(tier, monkeypatch, capsys):
    """The Loaded and Durable payloads the run's summary reads: `resumed ... at step 5 from h1's
    memory` (then `from the durable dir` once the RAM copy is torn) and `checkpoint step 5 durable`."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    checkpoint.dcp_save(_state(5), 5)
    checkpoint.dcp_wait(timeout=60)
    checkpoint.dcp_load(_blank())
    assert _payloads(capsys.readouterr().out) == []  # not under torchrun: nobody reads them
    monkeypatch.setenv("DDPLAUNCH_RUN_ID", tier.run_id)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    loaded = checkpoint.dcp_load(_blank())
    assert loaded is not None
    [said] = _payloads(capsys.readouterr().out)
    assert isinstance(said, payloads.Loaded) and (said.rank, said.step, said.source, said.host, said.origin) == \
        (0, 5, "memory", "h1", "h1") and said.path == str(_ram_version(tier, 5))
    data = _ram_version(tier, 5) / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 0xFF]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        checkpoint.dcp_load(_blank())
    [said] = _payloads(capsys.readouterr().out)
    assert (said.step, said.source, said.host) == (5, "durable", "")
    checkpoint.dcp_save(_state(6), 6)
    assert checkpoint.dcp_close() == 6
    [durable] = _payloads(capsys.readouterr().out)
    assert isinstance(durable, payloads.Durable) and (durable.rank, durable.step, durable.failed) == (0, 6, "")


def _direct_leftovers(durable: Path) -> list[str]:
    return [p.name for p in (durable / "dcp").iterdir() if p.name.startswith(".")]


def test_past_memory_limit_a_save_goes_straight_to_the_durable_dir_said_once(tmp_path):
    run = f"test-{uuid.uuid4().hex[:12]}"
    config = checkpoint.configure(tmp_path / "durable", run_id=run, host="h1", memory_limit=100)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in (1, 2):
                checkpoint.dcp_save(_state(step), step)
            assert checkpoint.dcp_wait(timeout=60) == 2
        assert [str(w.message) for w in said if "memory_limit" in str(w.message)] != []
        assert len([w for w in said if issubclass(w.category, checkpoint.CheckpointWarning)]) == 1
        assert not ckdcp.rank_dir(config, 0).exists() or layout.ram_steps(ckdcp.rank_dir(config, 0)) == []
        assert ckdcp.published_steps(config.durable) == [2, 1] and _direct_leftovers(config.durable) == []
        got = _blank()
        loaded = checkpoint.dcp_load(got)
        assert loaded is not None and loaded.step == 2 and loaded.source.where is checkpoint.Where.DURABLE
        assert _equal(got, _state(2))
    finally:
        checkpoint.dcp_close()
        checkpoint.free(run)


def test_a_full_dev_shm_sends_the_save_to_the_durable_dir_said_once(tier, monkeypatch):
    """ENOSPC while DCP writes into RAM (it arrives wrapped in DCP's CheckpointException)."""
    real = dcp.FileSystemWriter.write_data
    ram = layout.ram_base(tier.ram_root)

    def full(self, plan, planner):
        if Path(self.path).is_relative_to(ram):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, plan, planner)
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        checkpoint.dcp_save(_state(7), 7)
        checkpoint.dcp_save(_state(8), 8)
        assert checkpoint.dcp_wait(timeout=60) == 8
    assert len([w for w in said if "is full" in str(w.message)]) == 1
    assert ckdcp.published_steps(tier.durable)[0] == 8 and _direct_leftovers(tier.durable) == []
    plain = _blank()
    dcp.load(plain, storage_reader=dcp.FileSystemReader(tier.durable / "dcp" / layout.step_name(8)), no_dist=True)
    assert _equal(plain, _state(8))


def test_rank_0_gives_a_step_up_soon_when_nothing_in_it_changes(tier):
    """Rank 1 died: rank 0 does not wait the whole publish timeout (600 s) but as long as nothing in
    the step's durable dir moves."""
    checkpoint.dcp_save(_state(3), 3)
    checkpoint.dcp_wait(timeout=60)
    lone = ckdcp.DcpTier(tier, publish_timeout=600, stall_timeout=0.3)
    job = ckdcp._Job(4, 0, 2, "a-save-of-two-ranks", _ram_version(tier, 3))
    with pytest.raises(checkpoint.CheckpointError, match=r"ranks \[1\] did not persist .* changed for 0.3 s"):
        lone._persist_one(job)
    assert not (tier.durable / "dcp" / layout.step_name(4) / ".metadata").exists()


_RAN = []


def _evil() -> str:
    _RAN.append(True)
    return "ran"


class _Evil:
    def __reduce__(self):
        return (_evil, ())


def test_rank_0_never_runs_code_from_a_rank_s_metadata(tier):
    """A rank's `.ranks/R.metadata` that names any global but DCP's metadata classes is refused
    unread: the step is not published."""
    checkpoint.dcp_save(_state(3), 3)
    checkpoint.dcp_wait(timeout=60)
    target = tier.durable / "dcp" / layout.step_name(3)
    (target / ".metadata").unlink()
    (target / ".ranks" / "0.metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(checkpoint.TornCheckpoint, match="refusing .*_evil"):
        dcpfiles.publish(target, 1)
    assert _RAN == [] and not (target / ".metadata").exists()


_JOB = """
import hashlib, json, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from ddplaunch import checkpoint

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
checkpoint.configure(host=f"h{rank // 2}")  # two ranks a host: each host's RAM apart
phase, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0 if phase == "save" else 99)
model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
mesh = init_device_mesh("cpu", (world,))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=0.01)


def full_digest():
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name in sorted(msd):
        h.update(name.encode()); h.update(msd[name].numpy().tobytes())
    for name in sorted(osd["state"]):
        for key in sorted(osd["state"][name]):
            h.update(f"{name}.{key}".encode()); h.update(torch.as_tensor(osd["state"][name][key]).numpy().tobytes())
    return h.hexdigest()


def state():
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


if phase == "save":
    for step in (1, 2):
        opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()
        checkpoint.dcp_save(state(), step)
    checkpoint.dcp_wait(timeout=120)
    dist.barrier()
    digest, where, plain = full_digest(), "", ""
else:
    opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()  # optimizer state to load into
    sd = state()
    got = checkpoint.dcp_load(sd)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    digest, where, plain = full_digest(), got.source.where.value, ""
    if phase == "plain":  # the durable dir as torch's own reader sees it, at this world size
        sd = state()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(sys.argv[3]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        plain = full_digest()
with open(f"{out}/{phase}-{world}-{rank}.json", "w") as f:
    json.dump({"rank": rank, "step": got.step if phase != "save" else 2, "where": where, "digest": digest,
               "plain": plain}, f)
dist.destroy_process_group()
"""


def _results(where: Path, phase: str, world: int) -> list[dict]:
    return [json.loads((where / f"{phase}-{world}-{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_fsdp2_saved_at_4_ranks_resumes_at_4_from_ram_and_at_2_resharded_from_the_durable_copy(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    run = f"test-{uuid.uuid4().hex[:12]}"
    durable = tmp_path / "durable"
    env = {"DDPLAUNCH_CHECKPOINT_DIR": str(durable), "DDPLAUNCH_RUN_ID": run, "PYTHONPATH": str(ROOT)}
    try:
        saved = run_torchrun(script, "save", tmp_path, nproc=4, env=env, timeout=240)
        assert saved.returncode == 0, saved.stdout
        want = {d["digest"] for d in _results(tmp_path, "save", 4)}
        assert len(want) == 1
        assert ckdcp.published_steps(durable) == [2, 1]
        assert sorted(p.name for p in (durable / "dcp" / layout.step_name(2)).glob("*.distcp")) == \
            [f"__{r}_0.distcp" for r in range(4)]
        for host in ("h0", "h1"):  # each host's RAM holds its own ranks' shards only
            ranks = sorted(os.listdir(layout.ram_base(Path("/dev/shm")) / run / host / "dcp"))
            assert ranks == ([f"rank-{r}" for r in (0, 1)] if host == "h0" else [f"rank-{r}" for r in (2, 3)])

        same = run_torchrun(script, "load", tmp_path, nproc=4, env=env, timeout=240)
        assert same.returncode == 0, same.stdout
        assert [(d["step"], d["where"], d["digest"]) for d in _results(tmp_path, "load", 4)] == \
            [(2, "memory", *want)] * 4

        fewer = run_torchrun(script, "plain", tmp_path, durable / "dcp" / layout.step_name(2), nproc=2,
                             env=env, timeout=240)
        assert fewer.returncode == 0, fewer.stdout
        assert [(d["step"], d["where"], d["digest"], d["plain"]) for d in _results(tmp_path, "plain", 2)] == \
            [(2, "durable", *want, *want)] * 2
    finally:
        checkpoint.free(run)


@pytest.mark.slow
def test_fsdp_train_with_ckpt_tier_resumes_from_ram_then_resharded_from_the_durable_copy(tmp_path):
    """jobs/fsdp_train.py --ckpt-tier: saved by 2 ranks at step 4; resumed by 2 ranks from RAM and
    by 1 rank from the durable copy, each with the very parameters that were saved."""
    run = f"test-{uuid.uuid4().hex[:12]}"
    env = {"DDPLAUNCH_RUN_ID": run, "PYTHONPATH": str(ROOT)}
    script = ROOT / "jobs" / "fsdp_train.py"
    args = ("--ckpt-tier", "--ckpt-dir", tmp_path / "ckpt", "--steps", 4, "--ckpt-every", 0, "--global-batch", 8)
    try:
        saved = run_torchrun(script, *args, nproc=2, env=env, timeout=240)
        assert saved.returncode == 0, saved.stdout
        want = re.search(r"^rank=0 full_params_sha256=([0-9a-f]{64})$", saved.stdout, re.M)
        assert want and ckdcp.published_steps(tmp_path / "ckpt") == [4], saved.stdout
        said = [p for p in _payloads(saved.stdout) if isinstance(p, payloads.Durable)]  # rank 0's alone
        assert [(p.rank, p.step, p.failed) for p in said] == [(0, 4, "")], saved.stdout
        for nproc, where in ((2, "memory"), (1, "durable")):
            resumed = run_torchrun(script, *args, nproc=nproc, env=env, timeout=240)
            assert resumed.returncode == 0, resumed.stdout
            assert f"at step 4 (written by 2 ranks with fsdp, now {nproc} with fsdp)" in resumed.stdout, resumed.stdout
            assert f"resumed_source={where}\n" in resumed.stdout, resumed.stdout
            assert f"resumed_full_params_sha256={want.group(1)}" in resumed.stdout, resumed.stdout
            loaded = [p for p in _payloads(resumed.stdout) if isinstance(p, payloads.Loaded)]
            assert [(p.rank, p.step, p.source) for p in loaded] == [(0, 4, where)], resumed.stdout
    finally:
        checkpoint.free(run)
