"""Runs that outlive the launcher, on this machine with real torchrun (local backend): a supervisor
takes the run; `up` only shows it. A SIGKILLed or hung-up `up` leaves the run going, `attach` from
a new process shows it from its first line to its end with the run's exit code, and the job's
final parameters are bitwise those of an undisturbed run; `up --detach` returns once the run is
taken, `down` stops it through its supervisor; the event log is typed and complete."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from ddplaunch.record.events import (Requested, RunEnded, RunStarted, Shown, StageEnded, StageStarted, StepWindow,
                                     read_events)
from ddplaunch.record.live import read_live
from ddplaunch.record.view import RunView
from ddplaunch.report.summary import summarize
from tests.ssh_util import (ROOT, ddplaunch, popen_ddplaunch, read_until, run_processes, run_view, supervisor_pid,
                            wait_for)

pytestmark = pytest.mark.slow
SHA_RE = re.compile(r"final_weights_sha256=([0-9a-f]{64})")


def _spec(tmp_path: Path, name: str, step_sleep: str = "0.25") -> Path:
    (tmp_path / name).mkdir()
    path = tmp_path / name / "c.yaml"
    path.write_text(f"name: sup\nworkdir: {ROOT}\nnproc_per_node: 2\nhealthcheck: {{enabled: false}}\n"
                    "stragglers: {window: 5}\n"  # its 32 steps: windows after the 20 of warmup
                    f"job: {{script: jobs/train.py, args: [--epochs, '1', --samples, '512', --batch-size, '8', "
                    f"--ckpt-every, '4', --log-every, '1', --seed, '5', --step-sleep, '{step_sleep}']}}\n"
                    f"env: {{DDPLAUNCH_CKPT_DIR: {tmp_path / name / 'ckpt'}}}\n")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The final weights of the same training, undisturbed."""
    tmp_path = tmp_path_factory.mktemp("ref")
    out = ddplaunch(["up", str(_spec(tmp_path, "ref", "0")), "--run-id", "sup-ref"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    (sha,) = SHA_RE.findall(out.stdout)
    return sha


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP], ids=["sigkill", "sighup"])
def test_the_run_outlives_its_up_and_attach_shows_it_to_the_end(tmp_path, reference, how):
    run_id = f"sup-{how.name.lower()}"
    proc = popen_ddplaunch(["up", str(_spec(tmp_path, "run")), "--run-id", run_id], tmp_path)
    head = read_until(proc, "step=3 ", timeout=120)
    proc.send_signal(how)
    proc.wait(timeout=30)
    assert proc.returncode == -how, "".join(head)
    assert run_view(tmp_path, run_id).state == "running"
    assert run_processes(run_id), "the run's ranks ended with its `up`"
    attached = ddplaunch(["attach", run_id], tmp_path, timeout=240)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr
    lines = attached.stdout.splitlines()
    # the replay starts where the screen started: the run's first line, then the job's lines, the summary
    assert lines[0].startswith(f"[ddplaunch] run {run_id}: local backend"), lines[:3]
    assert "[localhost:0] step=1 " in attached.stdout and lines[-1] == f"run {run_id}: ok (exit 0)"
    (got,) = SHA_RE.findall(attached.stdout)
    assert got == reference
    assert run_view(tmp_path, run_id).state == "ok"
    assert wait_for(lambda: not run_processes(run_id), timeout=15) is True
    _top_shows_every_host(tmp_path, run_id)


def _top_shows_every_host(tmp_path: Path, run_id: str) -> None:
    """`top --once` on the run: a row per host with its ranks' newest step, from their own timing
    as the host's agent folded it; the page plots the hosts' step times over the run."""
    shown = ddplaunch(["top", "--once", run_id], tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    rows = re.findall(r"│\s+localhost\s+│[^│]*│\s+(\d+)\s+│\s+(\d+)\s+│\s+\d+ ms", shown.stdout)
    assert len(rows) == 1 and rows[0][0] == "2" and int(rows[0][1]) >= 30, shown.stdout
    assert f"run {run_id}: ok" in shown.stdout
    page = tmp_path / "page.html"
    written = ddplaunch(["report", run_id, "--html", str(page)], tmp_path, timeout=60)
    assert written.returncode == 0 and f"run {run_id}: page written to {page}" in written.stdout, written.stderr
    assert '<polyline class="median"' in page.read_text() and '<polygon class="band"' in page.read_text()


def test_detach_returns_once_taken_and_down_stops_the_run_through_its_supervisor(tmp_path):
    run_id = "sup-down"
    out = ddplaunch(["up", str(_spec(tmp_path, "run", "0.5")), "--detach", "--run-id", run_id], tmp_path)
    assert out.returncode == 0, out.stderr
    pid = supervisor_pid(tmp_path, run_id)
    assert out.stdout == (f"run {run_id}: supervised by pid {pid} on this machine; ddplaunch attach {run_id} "
                          f"follows it, ddplaunch down {run_id} stops it\n")
    events = tmp_path / "state" / "runs" / run_id
    wait_for(lambda: any(isinstance(e, Shown) and "step=2 " in e.text for e in read_events(events)), timeout=120)
    wait_for(lambda: read_live(events) is not None, timeout=60)  # the host's agent said its ranks' steps
    status = ddplaunch(["status", run_id], tmp_path).stdout.splitlines()  # read from the event log
    assert status[0].startswith(f"{run_id}: running (local; hosts localhost; supervisor pid {pid} on "), status
    assert re.fullmatch(r"  now: stage job, step [1-9]\d* \(newest of any rank, reported \d+s ago\)", status[1]), status
    down = ddplaunch(["down", run_id], tmp_path, timeout=120)
    assert down.returncode == 0 and down.stdout.startswith(f"supervisor (pid {pid}): stopped the run\n"), down.stdout
    assert run_view(tmp_path, run_id).state == "interrupted"
    assert not run_processes(run_id)
    logged = read_events(events)
    assert isinstance(logged[0], RunStarted) and logged[0].supervisor_pid == pid
    kinds = [type(e) for e in logged if not isinstance(e, (Shown, Requested)) and type(e).__name__ != "HostState"]
    assert [k for k in kinds if k is not StepWindow] == [RunStarted, StageStarted, StageEnded, RunEnded], kinds
    end = logged[-1]
    assert isinstance(end, RunEnded) and (end.state, end.exit_code) == ("interrupted", 130)
    summary = summarize(RunView.of(logged))
    assert summary.endswith(f"run {run_id}: interrupted (exit 130)")
    again = ddplaunch(["attach", run_id], tmp_path)  # an ended run: the replay, then its exit code
    assert again.returncode == 130 and again.stdout.splitlines()[-1] == summary.splitlines()[-1]


def test_ctrl_c_in_up_stops_the_run_and_says_so_once(tmp_path):
    run_id = "sup-int"
    proc = popen_ddplaunch(["up", str(_spec(tmp_path, "run", "0.5")), "--run-id", run_id], tmp_path)
    head = read_until(proc, "step=2 ", timeout=120)
    assert sum("Ctrl-C stops the run" in line for line in head) == 1, "".join(head)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(head) + rest
    assert f"[ddplaunch] stopping run {run_id}" in rest and "stage job: INTERRUPTED" in rest
    assert run_view(tmp_path, run_id).state == "interrupted" and not run_processes(run_id)


def test_refusals_come_back_from_the_supervisor_as_before(tmp_path):
    spec = _spec(tmp_path, "run")
    for args in (["--run-id", "../x"], ["--exclude", "nohost"]):
        for mode in ([], ["--detach"]):
            out = ddplaunch(["up", str(spec), *args, *mode], tmp_path, timeout=60)
            assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
            assert out.stderr.startswith("ddplaunch: error: ") and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "state" / "runs").exists() or not list((tmp_path / "state" / "runs").iterdir())


def test_a_supervisor_that_dies_is_said_by_attach(tmp_path):
    run_id = "sup-dead"
    out = ddplaunch(["up", str(_spec(tmp_path, "run", "0.5")), "--detach", "--run-id", run_id], tmp_path)
    assert out.returncode == 0, out.stderr
    pid = supervisor_pid(tmp_path, run_id)
    attach = subprocess.Popen([os.sys.executable, "-m", "ddplaunch", "attach", run_id], cwd=ROOT,
                              env=dict(os.environ, DDPLAUNCH_HOME=str(tmp_path / "state")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        read_until(attach, "step=1 ", timeout=120)
        os.kill(pid, signal.SIGKILL)
        _, err = attach.communicate(timeout=60)
    finally:
        if attach.poll() is None:
            attach.kill()
    assert attach.returncode == 1
    assert f"the supervisor of run {run_id} (pid {pid}) ended without ending the run; `ddplaunch down {run_id}`" \
        in err, err
    status = ddplaunch(["status", run_id], tmp_path)
    assert status.stdout.startswith(f"{run_id}: supervisor died without ending the run (pid {pid} gone)"), status.stdout
    down = ddplaunch(["down", run_id], tmp_path, timeout=120)
    assert down.returncode == 0 and "supervisor" not in down.stdout, down.stdout
    assert wait_for(lambda: not run_processes(run_id), timeout=30) is True


def test_detach_on_a_backend_without_a_scheduler_prepares_the_run_once(tmp_path, monkeypatch):
    """`up --detach` on the local backend: --exclude applied and the run's id taken here, once;
    the daemon is handed the run as prepared (its id, nothing left to exclude), and nothing is
    written before it takes the run."""
    from ddplaunch.plan.stages import UpOptions
    from ddplaunch.spec.load import load_spec
    from ddplaunch.supervise import handover

    monkeypatch.setenv("DDPLAUNCH_HOME", str(tmp_path / "state"))
    handed = []

    class Taken:
        run_id = "taken"

    def fake_daemon(spec, spec_path, opts):
        handed.append((spec, opts))
        return Taken()
    monkeypatch.setattr(handover, "start_daemon", fake_daemon)
    monkeypatch.setattr(handover, "load_run", lambda run_id: run_id)
    spec = load_spec(_spec(tmp_path, "once"))
    assert handover.hand_over(spec, "c.yaml", UpOptions(detach=True, exclude=[])) == "taken"
    ((got, opts),) = handed
    assert opts.run_id is not None and opts.run_id.startswith("sup-") and opts.exclude == [] and not opts.detach
    assert got.hosts == spec.hosts and not (tmp_path / "state" / "runs").exists()
