"""Resuming never runs code from a checkpoint: a planted pickle in the checkpoint directory of
jobs/train.py or jobs/fsdp_train.py is refused with one line naming the file (exit non-zero) and
its payload, which would create a canary file, never runs; a directory others can write is
refused too; and the plain-data checkpoint format still restores model, optimizer and every RNG
exactly. Real runs use a one-process localhost torchrun (no simulated cluster)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import random
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun_util, whatever the import mode
from torchrun_util import JOBS, run_torchrun  # noqa: E402

PLANTED = "ckpt_step999999.pt"


def load_job(name: str):
    """Imports jobs/<name>.py as a module; variables it sets on import (train.py quiets C++
    warnings) are removed again, so later tests' subprocesses do not inherit them."""
    before = set(os.environ)
    spec = importlib.util.spec_from_file_location(f"ddplaunch_job_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key in set(os.environ) - before:
        del os.environ[key]
    return module


train = load_job("train")
fsdp_train = load_job("fsdp_train")


class Payload:
    """Unpickling this runs a shell command that creates ``canary``."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.canary))}",)


def plant(path: Path, canary: Path) -> None:
    """A torch.save'd dict that looks like a checkpoint, with the payload inside; the payload is
    shown to work first (unsafe loading creates the canary), so the tests below can fail."""
    torch.save({"format": train.CKPT_FORMAT, "model": {}, "step": 999999, "evil": Payload(canary)}, path)
    torch.load(path, weights_only=False)
    assert canary.exists(), "the payload does not work: the test would prove nothing"
    canary.unlink()


def refusal_lines(output: str, needle: str) -> list:
    return [line for line in output.splitlines() if needle in line]


# ----------------------------------------------------------------------------- train.py

def tiny_training(steps: int = 3):
    """A seeded model and Adam after a few steps, with numpy's and Python's Gaussian caches filled
    (has_gauss / gauss_next are part of the state)."""
    train.seed_everything(5)
    model = train.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = train.make_data(64)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    np.random.standard_normal()
    random.gauss(0, 1)
    return model, optimizer, (x, y)


def save_good(ckpt_dir: Path, step: int = 2) -> Path:
    model, optimizer, _ = tiny_training()
    args = train.parse_args(["--ckpt-dir", str(ckpt_dir)])
    train.save_checkpoint(args, train.make_checkpoint(args, model, optimizer, step, 4, 0.5, 1))
    return ckpt_dir / f"ckpt_step{step}.pt"


def draws() -> tuple:
    return (torch.rand(4).tolist(), np.random.rand(3).tolist(), np.random.standard_normal(),
            random.random(), random.gauss(0, 1))


def test_train_checkpoint_round_trip_under_weights_only_is_exact(tmp_path):
    model, optimizer, (x, y) = tiny_training()
    args = train.parse_args(["--ckpt-dir", str(tmp_path / "ckpt")])
    train.save_checkpoint(args, train.make_checkpoint(args, model, optimizer, 3, 4, 0.5, 1))
    want = draws()
    # The promise itself: a plain weights_only load, no allowlist, no helper.
    loaded = torch.load(tmp_path / "ckpt" / "ckpt_step3.pt", map_location="cpu", weights_only=True)
    assert set(loaded) == set(train.read_checkpoint(str(tmp_path / "ckpt" / "ckpt_step3.pt")))
    assert all(v is None or isinstance(v, (str, int, float, bool)) for v in loaded["config"].values())

    train.seed_everything(99)  # every RNG somewhere else entirely
    train.set_rng_state(loaded["rng"])
    assert draws() == want

    model2 = train.make_model()
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optimizer"])
    for opt in (optimizer, optimizer2):  # one more step each: Adam's moments and step count must match
        net = model if opt is optimizer else model2
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state_dict()["state"].values(), optimizer2.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert (loaded["format"], loaded["step"], loaded["epoch"], loaded["world_size"]) == \
        (train.CKPT_FORMAT, 3, 0, 1)


def test_train_refuses_a_planted_pickle_and_never_runs_it(tmp_path):
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    save_good(ckpt)
    plant(ckpt / PLANTED, canary)

    run = run_torchrun(train.__file__, "--ckpt-dir", ckpt, "--epochs", "1", "--steps-per-epoch", "2",
                       nproc=1, timeout=120)
    assert run.returncode != 0, run.stdout
    assert not canary.exists(), "the planted payload ran"
    (line,) = refusal_lines(run.stdout, PLANTED)  # one line, naming the file
    assert line.startswith(f"train: refusing {ckpt / PLANTED}: torch.load(weights_only=True) rejects it "
                           "(it needs the global posix.system)"), line
    assert "resumed from" not in run.stdout and "final_weights_sha256" not in run.stdout, run.stdout
    assert "UnpicklingError" not in run.stdout, run.stdout
    assert (ckpt / PLANTED).exists() and (ckpt / "ckpt_step2.pt").exists()  # evidence left in place


def test_train_refuses_old_format_and_bare_pickles_in_one_line(tmp_path):
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    ckpt.mkdir(mode=0o700)
    old = ckpt / "ckpt_step4.pt"  # what train.py wrote before format 2: numpy's state as an ndarray
    torch.save({"model": {}, "rng": {"numpy": np.random.get_state(), "python": random.getstate()}}, old)
    with pytest.raises(train.CheckpointRefused) as refused:
        train.read_checkpoint(str(old))
    message = str(refused.value)
    assert "\n" not in message and str(old) in message and "older train.py" in message, message
    assert "it needs the global numpy" in message, message

    bare = ckpt / "ckpt_step5.pt"
    with open(bare, "wb") as f:
        pickle.dump(Payload(canary), f)
    with pytest.raises(train.CheckpointRefused, match="not a torch.save archive"):
        train.read_checkpoint(str(bare))
    plain = ckpt / "ckpt_step6.pt"  # loads with weights_only, but is no checkpoint of train.py
    torch.save({"model": {}}, plain)
    with pytest.raises(train.CheckpointRefused, match="not a format-2 checkpoint"):
        train.read_checkpoint(str(plain))
    assert not canary.exists()


def test_train_refuses_a_checkpoint_dir_or_file_others_can_write(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    path = save_good(ckpt)
    assert (ckpt.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)
    assert train.newest_checkpoint(str(ckpt))[0] == str(path)

    ckpt.chmod(0o770)
    with pytest.raises(train.CheckpointRefused, match=r"others can write it \(mode 0770\)"):
        train.newest_checkpoint(str(ckpt))
    ckpt.chmod(0o700)
    path.chmod(0o606)
    with pytest.raises(train.CheckpointRefused, match="others can write it"):
        train.newest_checkpoint(str(ckpt))
    path.chmod(0o600)

    if os.geteuid() == 0:
        os.chown(path, 65534, -1)  # nobody's file
    else:
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 1)
    with pytest.raises(train.CheckpointRefused, match="belongs to uid"):
        train.newest_checkpoint(str(ckpt))


# ----------------------------------------------------------------------------- fsdp_train.py (DCP)

def plant_dcp_step(step_dir: Path, canary: Path) -> None:
    """A complete-looking DCP checkpoint whose .metadata is the payload (DCP's own reader pickle.loads it)."""
    step_dir.mkdir(mode=0o700)
    with open(step_dir / ".metadata", "wb") as f:
        pickle.dump(Payload(canary), f)
    (step_dir / "meta.json").write_text('{"step": 999999, "world_size": 1, "strategy": "fsdp"}')
    (step_dir / "meta.json").chmod(0o600)


def test_fsdp_refuses_planted_dcp_metadata_and_still_resumes_its_own(tmp_path):
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    first = run_torchrun(fsdp_train.__file__, "--ckpt-dir", ckpt, "--steps", "2", "--ckpt-every", "2",
                         nproc=1, timeout=120)
    assert first.returncode == 0, first.stdout
    planted = ckpt / "step_999999"
    plant_dcp_step(planted, canary)

    run = run_torchrun(fsdp_train.__file__, "--ckpt-dir", ckpt, "--steps", "4", nproc=1, timeout=120)
    assert run.returncode != 0, run.stdout
    assert not canary.exists(), "the planted payload ran"
    (line,) = refusal_lines(run.stdout, str(planted))
    assert line.startswith(f"fsdp_train: refusing {planted}/.metadata: "
                           "it needs the global posix.system"), line
    assert "resumed from" not in run.stdout, run.stdout

    # Its own checkpoint still loads through the restricted reader (metadata allowlist, and
    # Adam's param_groups through weights_only): the allowlist is not too tight.
    for path in planted.iterdir():
        path.unlink()
    planted.rmdir()
    again = run_torchrun(fsdp_train.__file__, "--ckpt-dir", ckpt, "--steps", "4", nproc=1, timeout=120)
    assert again.returncode == 0, again.stdout
    assert f"resumed from {ckpt}/step_2 at step 2" in again.stdout, again.stdout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist: one process, meant
def test_dcp_values_load_weights_only_where_dcp_alone_would_run_them(tmp_path):
    """DCP (torch 2.x) loads non-tensor values with weights_only=False: shown, then prevented."""
    canary = tmp_path / "canary"
    dcp.save({"x": torch.zeros(2), "evil": Payload(canary)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    dcp.load({"x": torch.zeros(2), "evil": None}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert canary.exists(), "DCP's own loader no longer runs the payload: revisit fsdp_train's reader"
    canary.unlink()

    with pytest.raises(dcp.CheckpointException) as failed:
        dcp.load({"x": torch.zeros(2), "evil": None}, no_dist=True,
                 storage_reader=fsdp_train.SafeFileSystemReader(tmp_path / "dcp"),
                 planner=fsdp_train.WeightsOnlyLoadPlanner())
    assert not canary.exists(), "the payload ran"
    assert any(isinstance(e, pickle.UnpicklingError) for e, _ in failed.value.failures.values())


def test_dcp_metadata_naming_files_outside_its_directory_is_refused(tmp_path):
    step = tmp_path / "step_1"
    step.mkdir()
    for name in ("../../etc/passwd", "/etc/passwd", ".."):
        md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo(name, 0, 8)})
        (step / ".metadata").write_bytes(pickle.dumps(md))
        with pytest.raises(fsdp_train.CheckpointRefused, match="not a plain file"):
            fsdp_train.read_dcp_metadata(str(step))
    md = Metadata(state_dict_metadata={},
                  storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 8)})
    (step / ".metadata").write_bytes(pickle.dumps(md))
    assert fsdp_train.read_dcp_metadata(str(step)) == md


def test_fsdp_refuses_a_step_dir_others_can_write(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    step = ckpt / "step_3"
    step.mkdir(mode=0o755)
    md = Metadata(state_dict_metadata={}, storage_data={})
    (step / ".metadata").write_bytes(pickle.dumps(md))
    (step / "meta.json").write_text('{"step": 3, "world_size": 1}')
    for path in step.iterdir():
        path.chmod(0o644)
    assert fsdp_train.pick_checkpoint(str(ckpt))[0] == str(step)
    (step / ".metadata").chmod(0o664)  # the group can rewrite it in a directory it can enter
    with pytest.raises(fsdp_train.CheckpointRefused, match="others can write it"):
        fsdp_train.pick_checkpoint(str(ckpt))
    step.chmod(0o700)  # ... but not once nobody else can enter the directory
    assert fsdp_train.pick_checkpoint(str(ckpt))[0] == str(step)
    ckpt.chmod(0o777)
    with pytest.raises(fsdp_train.CheckpointRefused, match=r"mode 0777"):
        fsdp_train.pick_checkpoint(str(ckpt))
