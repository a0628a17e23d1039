"""Readers of a long run start from the fold saved beside its log (record/snapshot.py): what they
know is what folding the whole log gives, they read only the log after the snapshot, and a
snapshot that cannot be trusted is not used."""

from __future__ import annotations

import json
from pathlib import Path

from ddplaunch.plan.launch import Stage
from ddplaunch.record.events import (EVENTS_FILE, EventLog, HostState, RunEnded, RunStarted, Shown, StageStarted,
                                     StepWindow, read_events)
from ddplaunch.record.results import NodeState, RunState
from ddplaunch.record.snapshot import (HEAD_LINES, SNAPSHOT_FILE, TAIL_LINES, LogReader, Snapshots, load, read_view,
                                       screen_from)
from ddplaunch.record.view import RunView
from tests.events_util import stage_ended, straggler_named

HOSTS = [f"h{i}" for i in range(8)]


def _write_run(run_dir: Path, lines: int, end: bool, every: int = 4096) -> RunView:
    """A run's log as its supervisor writes it: the run loop's fold and the snapshots listening."""
    view = RunView()
    log = EventLog(run_dir, listeners=[view.add])
    log.listen(Snapshots(run_dir, view, log, every=every))
    log.append(RunStarted("snap", "ssh", HOSTS, 1, "here"))
    log.append(StageStarted(Stage.JOB, "h0", 29500, HOSTS))
    for h in HOSTS:
        log.append(HostState(h, Stage.JOB, NodeState.RUNNING))
    for i in range(lines):
        log.append(Shown(f"[h0:0] step={i + 1} loss=0.5"))
        if i % 20 == 19:
            log.append(StepWindow(i - 19, i, {h: [0.1, 0.01, 0.11] for h in HOSTS}))
    log.append(straggler_named("h3", [3], 0.4, 40, 0.14, 0.1, 0.04))
    if end:
        for h in HOSTS:
            log.append(HostState(h, Stage.JOB, NodeState.OK, 0))
        log.append(stage_ended({h: NodeState.OK for h in HOSTS}, {h: 0 for h in HOSTS}))
        log.append(RunEnded(RunState.OK, 0))
    log.close()
    return view


def test_the_fold_from_a_snapshot_is_the_fold_of_the_whole_log(tmp_path):
    written = _write_run(tmp_path, lines=500, end=False)
    snapshot = load(tmp_path)
    size = (tmp_path / EVENTS_FILE).stat().st_size
    assert snapshot is not None and 0 < snapshot.offset < size  # saved mid-run; the log went on
    whole = RunView.of(read_events(tmp_path))
    assert read_view(tmp_path) == whole == written
    assert whole.last_window is not None and whole.last_window.last == 499 and [s.host for s in whole.stragglers] == ["h3"]


def test_a_reader_folds_only_what_came_after_the_snapshot(tmp_path):
    """The log before the snapshot's offset blanked out: the fold is still the whole run's (it
    was never read), and blanking a byte after it changes what is read."""
    _write_run(tmp_path, lines=500, end=False)
    want = RunView.of(read_events(tmp_path))
    snapshot = load(tmp_path)
    assert snapshot is not None
    path = tmp_path / EVENTS_FILE
    data = path.read_bytes()
    path.write_bytes(b" " * (snapshot.offset - 1) + b"\n" + data[snapshot.offset:])
    assert read_view(tmp_path) == want
    assert RunView.of(read_events(tmp_path)) != want


def test_an_ended_run_has_its_snapshot_at_its_end_with_the_screen_head_and_tail(tmp_path):
    lines = HEAD_LINES + TAIL_LINES + 70
    _write_run(tmp_path, lines=lines, end=True, every=1 << 40)  # only the run's end saves one
    snapshot = load(tmp_path)
    assert snapshot is not None and snapshot.offset == (tmp_path / EVENTS_FILE).stat().st_size
    assert snapshot.view.state == RunState.OK and snapshot.view == RunView.of(read_events(tmp_path))
    shown = [e for e in screen_from(snapshot) if isinstance(e, Shown)]
    assert [e.text for e in shown[:HEAD_LINES]] == [f"[h0:0] step={i + 1} loss=0.5" for i in range(HEAD_LINES)]
    assert shown[HEAD_LINES].text == "[ddplaunch] ... 70 lines not shown here (ddplaunch logs snap has them all)"
    assert shown[-1].text == f"[h0:0] step={lines} loss=0.5" and len(shown) == HEAD_LINES + 1 + TAIL_LINES
    states = [e for e in screen_from(snapshot) if isinstance(e, HostState)]
    assert [(e.host, e.state) for e in states] == [(h, NodeState.OK) for h in HOSTS]


def test_a_snapshot_that_cannot_be_trusted_is_not_used(tmp_path):
    _write_run(tmp_path, lines=300, end=False)
    want = RunView.of(read_events(tmp_path))
    path = tmp_path / SNAPSHOT_FILE
    good = json.loads(path.read_text())
    for bad in ("{torn", json.dumps({**good, "format": 99}),
                json.dumps({**good, "offset": (tmp_path / EVENTS_FILE).stat().st_size + 1})):
        path.write_text(bad)
        assert load(tmp_path) is None
        assert read_view(tmp_path) == want
    path.unlink()
    assert read_view(tmp_path) == want
    assert oct(Path(tmp_path / EVENTS_FILE).stat().st_mode & 0o777) == "0o600"


def test_a_follower_replays_the_screen_to_the_snapshot_then_folds_what_follows(tmp_path):
    """The one way to read a run (attach, top, status): the screen up to the snapshot (its start
    first, its end last), then each event after it, folded before it is seen; live, until the run
    ends."""
    _write_run(tmp_path, lines=HEAD_LINES + TAIL_LINES + 70, end=False, every=1 << 12)
    reader = LogReader(tmp_path)
    assert reader.snapshot is not None and 0 < reader.offset < (tmp_path / EVENTS_FILE).stat().st_size
    screen = list(reader.screen())
    assert isinstance(screen[0], RunStarted) and isinstance(screen[-1], HostState)
    log = EventLog(tmp_path)
    log.append(RunEnded(RunState.OK, 0))
    log.close()
    seen = []
    for event in reader.events(alive=lambda: True):
        seen.append(event)
        assert reader.view.ended is (event if isinstance(event, RunEnded) else None)
    assert isinstance(seen[-1], RunEnded) and reader.view == RunView.of(read_events(tmp_path))
    ended = tmp_path / "ended"
    ended.mkdir()
    _write_run(ended, lines=10, end=True)
    assert list(LogReader(ended).screen())[-1] == read_events(ended)[-1]  # its end's snapshot: the screen ends it


def test_without_a_snapshot_the_screen_is_empty_and_the_whole_log_is_read(tmp_path):
    log = EventLog(tmp_path)
    log.append(RunStarted("r", "ssh", ["h0"], 1, "here"))
    log.close()
    reader = LogReader(tmp_path)
    assert list(reader.screen()) == [] and [type(e) for e in reader.events()] == [RunStarted]
    assert reader.view.run_id == "r"
