"""ddplaunch/hostside/entry.py: the health check in-process, then the job script exactly as
``python SCRIPT`` would run it, and a clean leave (os._exit) once the script has returned."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun_util sits beside us, whatever the import mode
from torchrun_util import JOBS, ROOT, free_port, run_torchrun  # noqa: E402

ENTRY = ROOT / "ddplaunch" / "hostside" / "entry.py"
RANKEXIT_RE = re.compile(r"^DDPLAUNCH_RANKEXIT_JSON (\{.*\})$", re.M)


def script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def run_python(*argv, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python ARGV`` with separate stdout and stderr (entry.py without torchrun: no torch needed)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def rank_exits(output: str) -> list:
    return [json.loads(m) for m in RANKEXIT_RE.findall(output)]


def without_rankexit(output: str) -> str:
    return "".join(line for line in output.splitlines(keepends=True) if not RANKEXIT_RE.match(line))


CASES = {
    "returns": ("print('hi')\n", 0),
    "exit_none": ("import sys\nsys.exit()\n", 0),
    "exit_3": ("import sys\nprint('three')\nsys.exit(3)\n", 3),
    "exit_300": ("import sys\nsys.exit(300)\n", 300 & 0xFF),
    "exit_str": ("import sys\nsys.exit('goodbye: bad input')\n", 1),
    "raises": ("def f():\n    raise ValueError('boom')\nprint('before')\nf()\n", 1),
    "syntax_error": ("def (:\n", 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_status_and_output_match_plain_python(tmp_path, case):
    body, expected = CASES[case]
    job = script(tmp_path, body)
    plain = run_python(job, "a1")
    entry = run_python(ENTRY, "--no-healthcheck", "--", job, "a1")
    assert plain.returncode == expected, plain.stderr
    assert entry.returncode == expected, entry.stdout + entry.stderr
    assert entry.stderr == plain.stderr  # the same traceback / message, no frames of ours
    assert rank_exits(entry.stdout) == [{"rank": 0, "code": expected}]
    assert entry.stdout.endswith(f'DDPLAUNCH_RANKEXIT_JSON {{"rank": 0, "code": {expected}}}\n')
    assert without_rankexit(entry.stdout) == plain.stdout


def test_a_printed_line_reaches_its_file_whole(tmp_path):
    """print() writes its text and its newline separately; under PYTHONUNBUFFERED each was a system
    call of its own, and torchrun's tailer could copy a line without its end (the next line's
    prefix glued to it on screen). The script looks at its own stdout's pipe between the two."""
    job = script(tmp_path, """\
        import os, sys
        r, w = os.pipe()
        os.set_blocking(r, False)
        saved = os.dup(1)
        os.dup2(w, 1)
        sys.stdout.write("LAYOUT " + "x" * 700)  # what print() does first ...
        try:
            early = os.read(r, 4096)
        except BlockingIOError:
            early = b""
        sys.stdout.write("\\n")  # ... and then
        whole = os.read(r, 4096)
        os.dup2(saved, 1)
        print(len(early), len(whole))
    """)
    entry = run_python(ENTRY, "--no-healthcheck", "--", job)
    assert entry.returncode == 0, entry.stderr
    assert without_rankexit(entry.stdout) == "0 708\n"


def test_uncaught_exception_prints_the_scripts_traceback(tmp_path):
    job = script(tmp_path, "def f():\n    raise ValueError('boom')\nf()\n")
    entry = run_python(ENTRY, "--no-healthcheck", "--", job)
    assert entry.returncode == 1
    assert entry.stderr.startswith("Traceback (most recent call last):\n")
    assert f'File "{job}", line 3, in <module>' in entry.stderr
    assert entry.stderr.rstrip().endswith("ValueError: boom")
    assert "runpy" not in entry.stderr and "entry.py" not in entry.stderr


def test_keyboard_interrupt_exits_130(tmp_path):
    job = script(tmp_path, "raise KeyboardInterrupt\n")
    entry = run_python(ENTRY, "--no-healthcheck", "--", job)
    assert entry.returncode == 130, entry.stderr
    assert "KeyboardInterrupt" in entry.stderr
    assert rank_exits(entry.stdout) == [{"rank": 0, "code": 130}]


def test_script_sees_argv_path_name_and_file_like_plain_python(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    job = script(tmp_path, """
        import sys, helper_mod
        print(sys.argv, sys.path[0], __name__, __file__, helper_mod.VALUE)
        print(sorted(k for k in globals() if not k.startswith('__')))
    """)
    plain = run_python(job, "--x", "1", "--", "y")
    entry = run_python(ENTRY, "--no-healthcheck", "--", job, "--x", "1", "--", "y")
    assert plain.returncode == 0 and entry.returncode == 0, entry.stderr
    assert without_rankexit(entry.stdout) == plain.stdout
    assert "42" in plain.stdout and "__main__" in plain.stdout


def test_threads_joined_and_atexit_run_before_the_rank_exit_line(tmp_path):
    job = script(tmp_path, """
        import atexit, threading, time
        atexit.register(lambda: print("atexit ran", flush=True))
        def work():
            time.sleep(0.5)  # still running when the script returns
            print("thread done", flush=True)
        threading.Thread(target=work).start()
        threading.Thread(target=lambda: time.sleep(600), daemon=True).start()  # not waited for
        print("script returned", flush=True)
    """)
    entry = run_python(ENTRY, "--no-healthcheck", "--", job, timeout=30)
    assert entry.returncode == 0, entry.stderr
    lines = entry.stdout.splitlines()
    assert lines == ["script returned", "thread done", "atexit ran",
                     'DDPLAUNCH_RANKEXIT_JSON {"rank": 0, "code": 0}']


def test_leaves_without_finalization_unless_finalize(tmp_path):
    job = script(tmp_path, """
        import sys
        class Witness:
            def __del__(self):
                sys.stdout.write("finalized\\n")
        witness = Witness()
        sys.exit(4)
    """)
    quick = run_python(ENTRY, "--no-healthcheck", "--", job)
    full = run_python(ENTRY, "--no-healthcheck", "--finalize", "--", job)
    plain = run_python(job)
    assert "finalized" in plain.stdout  # python SCRIPT finalizes the module
    assert quick.returncode == full.returncode == plain.returncode == 4
    assert "finalized" not in quick.stdout  # os._exit: no interpreter finalization
    assert "finalized" in full.stdout
    assert rank_exits(quick.stdout) == rank_exits(full.stdout) == [{"rank": 0, "code": 4}]


def test_bad_command_lines_exit_2(tmp_path):
    assert run_python(ENTRY, "--no-healthcheck").returncode == 2
    missing = run_python(ENTRY, "--no-healthcheck", "--", tmp_path / "nope.py")
    assert missing.returncode == 2 and "can't open file" in missing.stderr


def test_rank_exit_line_carries_the_rank(tmp_path):
    job = script(tmp_path, "import sys\nsys.exit(5)\n")
    entry = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "7"})
    assert rank_exits(entry.stdout) == [{"rank": 7, "code": 5}]


def test_health_check_then_the_jobs_own_process_group_under_torchrun():
    run = run_torchrun(ENTRY, "--sizes", "4K", "--iters", "1", "--collectives", "all_reduce,all_gather",
                       "--", JOBS / "toy_ddp.py", timeout=120)
    assert run.returncode == 0, run.stdout
    assert "HEALTHCHECK OK world=2 backend=gloo" in run.stdout
    assert run.stdout.count("mean_grad=4.0 updated_weight=0.6") == 2, run.stdout
    assert sorted(e["rank"] for e in rank_exits(run.stdout)) == [0, 1]
    assert all(e["code"] == 0 for e in rank_exits(run.stdout))
    # rank 0's verdict before rank 0's job line (ranks' streams interleave freely under torchrun)
    assert run.stdout.index("HEALTHCHECK OK") < run.stdout.index("rank=0 mean_grad=")


def test_health_check_then_the_jobs_own_group_without_an_agent_store(tmp_path):
    """Started directly (no torchrun agent): rank 0 hosts the health check's store and must
    release the port, as the job's own init_process_group() hosts its store there next."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, str(ENTRY), "--sizes", "4K", "--iters", "1", "--",
                                       str(JOBS / "toy_ddp.py")], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "HEALTHCHECK OK world=2 backend=gloo" in outs[0]
    assert all("updated_weight=0.6" in out for out in outs), "\n".join(outs)


def test_failed_health_check_runs_no_job_code(tmp_path):
    job = script(tmp_path, "print('USER CODE RAN', flush=True)\n")
    run = run_torchrun(ENTRY, "--sizes", "4K", "--", job, env={"DDPLAUNCH_HC_FAULT_RANK": "1"},
                       timeout=120)
    assert run.returncode != 0, run.stdout
    assert "HEALTHCHECK FAIL: rank 1 (host " in run.stdout
    assert "USER CODE RAN" not in run.stdout
    assert {e["code"] for e in rank_exits(run.stdout)} == {1}


def test_reproducer_never_aborts_through_entry():
    """jobs/teardown_repro.py can abort at exit under bare torchrun (bench/teardown.py; rare on
    this machine: 0 of about 40 bare runs, so repeating the run here would not make it fail);
    through entry.py a finished rank leaves by os._exit and never reaches that teardown: every
    rank reports its exit line and the run succeeds. That no rank reaches the interpreter's
    finalization is test_leaves_without_finalization_unless_finalize's to show, every time."""
    run = run_torchrun(ENTRY, "--no-healthcheck", "--", JOBS / "teardown_repro.py", nproc=3, timeout=120)
    assert "terminate called" not in run.stdout, run.stdout
    assert run.returncode == 0, run.stdout
    assert sorted(e["rank"] for e in rank_exits(run.stdout)) == [0, 1, 2]


def test_rank_0_reports_its_optimizer_steps_and_checkpoint_loads_without_any_print(tmp_path):
    """No `step=N` convention: entry.py's hooks see torch.optim's steps (one optimizer counted,
    not two), torch.load and torch.distributed.checkpoint.load, and say them as machine lines."""
    job = script(tmp_path, f"""\
        import torch
        import torch.distributed.checkpoint as dcp
        m = torch.nn.Linear(2, 2)
        a, b = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
        torch.save(m.state_dict(), {str(tmp_path / 'ck.pt')!r})
        m.load_state_dict(torch.load({str(tmp_path / 'ck.pt')!r}))
        with open({str(tmp_path / 'ck.pt')!r}, "rb") as f:  # a file object (Lightning passes fsspec's)
            torch.load(f)
        dcp.save({{"m": m.state_dict()}}, checkpoint_id={str(tmp_path / 'dcp')!r})
        dcp.load({{"m": m.state_dict()}}, checkpoint_id={str(tmp_path / 'dcp')!r})
        dcp.load({{"m": m.state_dict()}}, storage_reader=dcp.FileSystemReader({str(tmp_path / 'dcp')!r}))
        for _ in range(3):
            a.zero_grad(); m(torch.ones(1, 2)).sum().backward(); a.step(); b.step()
        """)
    out = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [(m[0], json.loads(m[1])) for m in re.findall(r"^DDPLAUNCH_(PROGRESS|LOADED)_JSON (\{.*\})$", out.stdout, re.M)]
    loads = [d for kind, d in said if kind == "LOADED"]
    # each named by its path, whether given as a path, an open file or a storage reader
    assert [(d["path"], d["via"]) for d in loads] == [
        (str(tmp_path / "ck.pt"), "torch.load"), (str(tmp_path / "ck.pt"), "torch.load"),
        (str(tmp_path / "dcp"), "torch.distributed.checkpoint.load"),
        (str(tmp_path / "dcp"), "torch.distributed.checkpoint.load")]
    steps = [d["steps"] for kind, d in said if kind == "PROGRESS"]
    assert steps[0] == 1 and steps[-1] == 3, said  # the first step at once, the last at exit
    other = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "1"}, timeout=120)
    assert other.returncode == 0 and "DDPLAUNCH_PROGRESS" not in other.stdout  # rank 0 speaks for the job


def test_a_loaded_checkpoint_s_step_is_said_where_it_names_one(tmp_path):
    """The run's ledger counts the work redone from the step a relaunched job loaded: read from
    the dict torch.load returns (Lightning's global_step, nanoGPT's iter_num) and from the HF
    Trainer's state, with no print convention."""
    from transformers import TrainerState

    TrainerState(global_step=40).save_to_json(str(tmp_path / "trainer_state.json"))
    job = script(tmp_path, f"""\
        import torch
        from transformers.trainer_callback import TrainerState
        torch.save({{"global_step": 30, "state_dict": {{}}}}, {str(tmp_path / 'l.ckpt')!r})
        torch.save({{"iter_num": 250}}, {str(tmp_path / 'n.pt')!r})
        torch.save({{"w": torch.ones(1)}}, {str(tmp_path / 'w.pt')!r})
        for name in ("l.ckpt", "n.pt", "w.pt"):
            torch.load({str(tmp_path)!r} + "/" + name, weights_only=False)
        TrainerState.load_from_json({str(tmp_path / 'trainer_state.json')!r})
        """)
    out = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    loads = [json.loads(m) for m in re.findall(r"^DDPLAUNCH_LOADED_JSON (\{.*\})$", out.stdout, re.M)]
    assert [(os.path.basename(d["path"]), d["via"], d["step"]) for d in loads] == [
        ("l.ckpt", "torch.load", 30), ("n.pt", "torch.load", 250), ("w.pt", "torch.load", None),
        ("trainer_state.json", "transformers.TrainerState", 40)]


def test_rank_0_says_the_time_inside_its_checkpoint_saves_between_its_steps(tmp_path):
    """The goodput ledger's `checkpoint`: rank 0's time inside torch.save up to its newest step; a
    save after the last step (the run's end) is not a stall of its training."""
    job = script(tmp_path, f"""\
        import time, torch

        class Slow:  # pickling it takes `s` seconds: a save to a slow disk
            def __init__(self, s):
                self.s = s

            def __reduce__(self):
                time.sleep(self.s)
                return (int, (0,))

        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step():
            opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()
        step()
        t = time.monotonic()
        torch.save(Slow(0.5), {str(tmp_path / 'a.pt')!r})
        print("FIRST", time.monotonic() - t)
        step()
        torch.save(Slow(1.0), {str(tmp_path / 'b.pt')!r})
        """)
    out = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [json.loads(m) for m in re.findall(r"^DDPLAUNCH_PROGRESS_JSON (\{.*\})$", out.stdout, re.M)]
    first = float(re.search(r"^FIRST (\S+)$", out.stdout, re.M).group(1))
    assert said[0] == {"rank": 0, "steps": 1, "saving_s": 0.0, "saves": 0}, said
    assert said[-1]["steps"] == 2 and 0.5 <= said[-1]["saving_s"] <= first + 0.25, (said, first)
    assert said[-1]["saves"] == 1  # the save after the last step is the run's end


def test_the_stall_of_a_ddplaunch_checkpoint_save_is_counted_like_torch_saves(tmp_path):
    """`ddplaunch.checkpoint.save` (the memory tier) is one of rank 0's saves: its blocking time and
    count reach the ledger, however the job imported it."""
    job = script(tmp_path, f"""\
        import torch
        from ddplaunch import checkpoint
        from ddplaunch.checkpoint import save

        checkpoint.configure({str(tmp_path / 'durable')!r}, run_id="entry-test", host="h", ram_root={str(tmp_path)!r})
        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(3):
            opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()
            (save if i else checkpoint.save)({{"m": m.state_dict()}}, i + 1)
        opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()
        """)
    out = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [json.loads(m) for m in re.findall(r"^DDPLAUNCH_PROGRESS_JSON (\{.*\})$", out.stdout, re.M)]
    assert said[-1]["steps"] == 4 and said[-1]["saves"] == 3 and said[-1]["saving_s"] > 0, said


def test_a_script_that_ends_with_os_exit_still_says_its_last_steps_and_timing(tmp_path):
    """jobs/train.py ends with os._exit (to skip the interpreter's teardown): rank 0's last
    progress line and every step's timing are said before it exits."""
    job = script(tmp_path, """\
        import os
        import torch
        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()
        os._exit(7)
        """)
    out = run_python(ENTRY, "--no-healthcheck", "--", job, env={"RANK": "0"}, timeout=120)
    assert out.returncode == 7, out.stderr
    steps = [json.loads(m)["steps"] for m in re.findall(r"^DDPLAUNCH_PROGRESS_JSON (\{.*\})$", out.stdout, re.M)]
    assert steps[-1] == 5, out.stdout
    timed = [s[0] for m in re.findall(r"^DDPLAUNCH_TIMING_JSON (\{.*\})$", out.stdout, re.M)
             for s in json.loads(m)["steps"]]
    assert timed == [2, 3, 4, 5], out.stdout  # the first step has no start: it is not timed


def test_checkpoint_watch_names_the_dir_puts_back_and_persists_even_past_os_exit(tmp_path):
    """`checkpoint.watch` in one process: `{checkpoint_dir}` is the node's dir in RAM; the first
    run's last checkpoint is made durable although the script leaves with os._exit; the second run
    finds it put back in a new RAM dir (its host's RAM lost) before its first line."""
    job = script(tmp_path, """\
        import os, sys, torch
        where = sys.argv[1]
        found = os.path.exists(os.path.join(where, "last.ckpt"))
        print("found", found, torch.load(os.path.join(where, "last.ckpt"))["global_step"] if found else None)
        torch.save({"global_step": 7 + 7 * found}, os.path.join(where, "last.ckpt"))
        sys.stdout.flush()
        os._exit(0)
        """)
    env = {"DDPLAUNCH_CHECKPOINT_WATCH": "1", "DDPLAUNCH_RUN_ID": "w-1", "DDPLAUNCH_HOST": "h1",
           "DDPLAUNCH_CHECKPOINT_RAM": str(tmp_path / "shm"), "DDPLAUNCH_CHECKPOINT_DURABLE": str(tmp_path / "durable"),
           "RANK": "0"}
    first = run_python(ENTRY, "--no-healthcheck", "--", job, "{checkpoint_dir}", env=env, timeout=120)
    assert first.returncode == 0 and "found False None" in first.stdout, first.stderr
    import torch
    assert torch.load(tmp_path / "durable" / "last.ckpt")["global_step"] == 7  # durable, past os._exit
    shutil.rmtree(tmp_path / "shm")  # the host's RAM lost
    again = run_python(ENTRY, "--no-healthcheck", "--", job, "{checkpoint_dir}", env=env, timeout=120)
    assert again.returncode == 0 and "found True 7" in again.stdout, again.stdout + again.stderr
    assert "step 7 put back into the job's dir from the durable dir (written by h1)" in again.stderr
    assert torch.load(tmp_path / "durable" / "last.ckpt")["global_step"] == 14
