"""What frees the checkpoint memory tier (hostside/ckpt/): the reaper at a run's end and at `down`
(never between stages: a relaunch loads from there), and a sim host's crash, which empties that
host's part as a power loss would. On files: no namespaces, no hosts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ddplaunch.backends.shell import reaper_command
from ddplaunch.hostside import reaper
from ddplaunch.hostside.ckpt import config, injob as ckpt, layout, reader, tier
from ddplaunch.sim.faults import wipe_memory_tier

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _saved(ram_root: Path, run_id: str, host: str, durable: Path, step: int = 3) -> Path:
    """A complete RAM version of `run_id` on `host`, saved through the tier itself; its part dir."""
    ckpt.configure(durable, run_id=run_id, host=host, ram_root=ram_root)
    try:
        ckpt.save({"w": torch.arange(4.0)}, step)
        ckpt.wait(timeout=60)
    finally:
        ckpt.free(run_id, host="none-such", ram_root=ram_root)  # closes this process's tier, keeps the RAM
    part = layout.ram_part_dir(ram_root, run_id, host, 0)
    assert layout.ram_steps(part) == [step]
    return part


def test_a_crash_empties_the_crashed_hosts_memory_tier_of_every_run(tmp_path):
    ram = tmp_path / "shm"
    a1, b1 = _saved(ram, "run1", "a", tmp_path / "d1"), _saved(ram, "run1", "b", tmp_path / "d1")
    a2 = _saved(ram, "run2", "a", tmp_path / "d2")
    other_user = ram / "ddplaunch-ckpt-4242" / "run3" / "a"
    other_user.mkdir(parents=True)
    removed = wipe_memory_tier("a", ram_root=ram)
    assert sorted(removed) == sorted([a1.parent, a2.parent, other_user])
    assert not a1.exists() and not a2.exists() and not other_user.exists()
    assert layout.ram_steps(b1) == [3]  # another host's part on the same machine stays
    # the run resumes from the durable copy (this host's RAM is gone)
    got = reader.load(tier.Tier(config.resolve(tmp_path / "d1", "run1", "a", ram_root=ram)),
                           False, None)
    assert got is not None and got.step == 3 and got.source.where is ckpt.Where.DURABLE
    with pytest.raises(ckpt.CheckpointError):
        wipe_memory_tier("../a", ram_root=ram)


def test_the_reapers_path_is_the_tiers():
    assert reaper.CKPT_RAM.format(uid=os.getuid()) == str(layout.ram_base(Path("/dev/shm")))


def _reap(run_id: str, free: bool) -> dict:
    command, nonce = reaper_command(sys.executable, run_id, kill=False, free_checkpoints=free)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    (answer,) = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
                 if line.startswith(f"DDPLAUNCH_ANSWER_{nonce} ")]
    return answer


def test_the_reaper_frees_a_runs_ram_only_when_asked_and_nothing_of_the_run_is_left():
    run_id = f"free-{uuid.uuid4().hex[:8]}"
    run_dir = layout.ram_base(Path("/dev/shm")) / run_id
    (run_dir / "h1" / "part-0").mkdir(parents=True)
    try:
        assert _reap(run_id, free=False)["freed"] is False and run_dir.exists()  # between stages: kept
        alive = subprocess.Popen(SLEEPER, env=dict(os.environ, DDPLAUNCH_RUN_ID=run_id))
        try:
            assert _reap(run_id, free=True)["freed"] is False and run_dir.exists()  # the run still runs here
        finally:
            alive.kill()
            alive.wait()
        assert _reap(run_id, free=True)["freed"] is True and not run_dir.exists()
        assert _reap(run_id, free=True)["freed"] is False  # nothing left to free
    finally:
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)
    assert reaper.free_checkpoints("..") is False and reaper.free_checkpoints("a/b") is False


def test_the_reapers_names_are_the_tiers():
    assert reaper.CKPT_STEP.format(12) == layout.step_name(12)
    assert reaper.CKPT_VERSION.fullmatch(layout.version_name(12)) and reaper.CKPT_FILES == (layout.DATA, layout.META)


def test_what_only_ram_holds_is_made_durable_before_the_ram_is_freed(tmp_path):
    """A job stopped by a signal before its tier persisted its newest save (SIGTERM ends Python
    without its exit handlers), or a run killed outright: the reaper's free at the run's end (and
    `down`) first writes each part's newest intact sealed version that the durable dir lacks (here
    a buddy's copy of step 5; the newer step 9 is torn), as the tier writes it; then frees the RAM."""
    run_id = f"free-{uuid.uuid4().hex[:8]}"
    ram, durable = Path("/dev/shm"), tmp_path / "durable"
    try:
        _saved(ram, run_id, "h1", durable, step=3)
        own = _saved(ram, run_id, "h2", durable, step=5)
        replica = layout.replica_part_dir(ram, run_id, "h9", "h2", 0)
        replica.mkdir(parents=True)
        shutil.move(str(own / layout.version_name(5)), str(replica / layout.version_name(5)))
        torn = _saved(ram, run_id, "h3", durable, step=9) / layout.version_name(9) / layout.DATA
        torn.write_bytes(bytes([torn.read_bytes()[0] ^ 0xFF]) + torn.read_bytes()[1:])
        for step in (3, 5, 9):  # none of them persisted yet
            shutil.rmtree(durable / layout.step_name(step))
        command, nonce = reaper_command(sys.executable, run_id, kill=False, free_checkpoints=True,
                                        durable=str(durable))
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert f"DDPLAUNCH_ANSWER_{nonce} " in out.stdout and '"freed": true' in out.stdout, out.stdout + out.stderr
        assert layout.durable_steps(durable) == [5] and layout.durable_parts_complete(durable, 5)
        layout.read_verified(durable / layout.step_name(5) / "part-0", 5, 0)  # whole: it matches its manifest
        assert oct(os.stat(durable / layout.step_name(5) / "part-0" / layout.DATA).st_mode & 0o777) == "0o600"
        assert not (layout.ram_base(ram) / run_id).exists()
    finally:
        shutil.rmtree(layout.ram_base(ram) / run_id, ignore_errors=True)
