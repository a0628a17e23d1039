"""What a run killed outright leaves in the hosts' RAM (the checkpoint memory tier) is freed, on the
sim hosts: a run of train.py --ckpt-api with `checkpoint: {tier: memory}` on 2 hosts, its supervisor
and every process of it SIGKILLed (nothing ran the reaper), leaves its saves in /dev/shm; `ddplaunch
down` leaves 0 bytes of it there, each part's newest sealed step in the durable dir; the next `up` of
the same spec frees it too (and says so), while a live run of another spec keeps its RAM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from ddplaunch.hostside.ckpt import layout
from tests.ssh_util import ROOT, ddplaunch, popen_ddplaunch, poll, read_until, run_processes, sim_spec, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]
RAM = layout.ram_base(Path("/dev/shm"))


def _spec(cluster, tmp_path: Path, name: str, hosts: tuple[int, int] = (0, 1)) -> Path:
    """train.py --ckpt-api on 2 of the sim's hosts, a save every 2 steps, long enough to be killed
    mid-way."""
    where = tmp_path / name
    where.mkdir()
    every = yaml.safe_load(cluster.spec_path.read_text())["hosts"]
    return sim_spec(cluster, where, n_hosts=2, hosts=[every[i] for i in hosts], workdir=str(ROOT), nproc_per_node=1,
                    healthcheck={"enabled": False},
                    checkpoint={"path": str(where / "ckpt"), "tier": "memory", "replicas": 1},
                    job={"script": "jobs/train.py",
                         "args": ["--epochs", "1", "--samples", "20000", "--batch-size", "8", "--ckpt-every", "2",
                                  "--log-every", "1", "--seed", "3", "--step-sleep", "0.3", "--ckpt-api"]})


def _sealed_parts(run_id: str) -> list[Path]:
    """The part directories of the run's RAM that hold a sealed version (own saves, buddies' copies)."""
    return [part for part in [*RAM.glob(f"{run_id}/*/part-*"), *RAM.glob(f"{run_id}/*/replicas/*/part-*")]
            if layout.sealed_steps(part)]


def _newest_sealed(run_id: str) -> dict[int, int]:
    """Each part's newest sealed step in the run's RAM (own saves and buddies' copies)."""
    out: dict[int, int] = {}
    for part in _sealed_parts(run_id):
        steps = layout.sealed_steps(part)
        number = int(part.name.split("-")[1])
        if steps:
            out[number] = max(out.get(number, -1), steps[0])
    return out


def _saving(tmp_path: Path, spec: Path, run_id: str) -> subprocess.Popen:
    """`up` of `spec`, once rank 0's save (train.py's one part) is sealed in its host's RAM and in
    its buddy's."""
    proc = popen_ddplaunch(["up", str(spec), "--run-id", run_id], tmp_path)
    said = read_until(proc, "step=4 ", timeout=240)
    assert poll(lambda: len(_sealed_parts(run_id)) == 2, timeout=60), \
        ("".join(said[-30:]), sorted(str(p) for p in (RAM / run_id).rglob("*")))
    return proc


def _kill_everything(tmp_path: Path, run_id: str, up: subprocess.Popen) -> None:
    """SIGKILL the run's `up`, its supervisor and every process of it on every host, all stopped
    first so that none of them acts on another's end (nothing runs the reaper)."""
    record = json.loads((tmp_path / "state" / "runs" / run_id / "record.json").read_text())
    victims = [up.pid, record["placement"]["pid"]]
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    while set(run_processes(run_id)) - set(victims):
        for pid in set(run_processes(run_id)) - set(victims):
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
            victims.append(pid)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    up.wait(timeout=30)
    wait_for(lambda: not run_processes(run_id), timeout=30)


def _durable_has(durable: Path, sealed: dict[int, int]) -> bool:
    return all((durable / layout.step_name(step) / f"part-{part}" / layout.MANIFEST).is_file()
               for part, step in sealed.items())


def test_down_frees_what_a_run_killed_outright_left_in_ram(sim_cluster, tmp_path):
    run_id = "ckc-down"
    spec = _spec(sim_cluster, tmp_path, "down")
    _kill_everything(tmp_path, run_id, _saving(tmp_path, spec, run_id))
    sealed = _newest_sealed(run_id)
    assert len(sealed) == 1 and len(_sealed_parts(run_id)) == 2  # nothing freed it
    down = ddplaunch(["down", run_id], tmp_path, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (RAM / run_id).exists(), list((RAM / run_id).rglob("*"))
    assert _durable_has(tmp_path / "down" / "ckpt", sealed), (sealed, sorted(os.listdir(tmp_path / "down" / "ckpt")))


def test_the_next_up_of_the_spec_frees_it_and_leaves_a_live_runs_ram(sim_cluster, tmp_path):
    spec, other = _spec(sim_cluster, tmp_path, "mine"), _spec(sim_cluster, tmp_path, "other", (2, 3))
    live = _saving(tmp_path, other, "ckc-live")  # another spec's run on the other hosts, going on throughout
    try:
        _kill_everything(tmp_path, "ckc-killed", _saving(tmp_path, spec, "ckc-killed"))
        sealed = _newest_sealed("ckc-killed")
        assert len(sealed) == 1 and len(_sealed_parts("ckc-killed")) == 2
        again = popen_ddplaunch(["up", str(spec), "--run-id", "ckc-again"], tmp_path)
        said = read_until(again, "freed from RAM", timeout=120)
        assert "(ckc-killed), their newest sealed versions persisted to the durable dir first" in said[-1], said
        assert not (RAM / "ckc-killed").exists()
        assert _durable_has(tmp_path / "mine" / "ckpt", sealed)
        assert len(_sealed_parts("ckc-live")) == 2 and live.poll() is None  # the live run's RAM is its own
        for run_id in ("ckc-again", "ckc-live"):
            assert ddplaunch(["down", run_id], tmp_path, timeout=120).returncode == 0
        again.wait(timeout=60)
        for run_id in ("ckc-again", "ckc-live"):
            assert not (RAM / run_id).exists()  # `down` of a live run frees its RAM too
    finally:
        if live.poll() is None:
            ddplaunch(["down", "ckc-live"], tmp_path, timeout=120)
            live.wait(timeout=60)
