"""Worker entry: the health check in this process, then the job's script as ``__main__``.

torchrun runs it as each worker (a plain script that needs only torch)::

    python -m torch.distributed.run ... entry.py [HEALTH-CHECK OPTIONS | --no-healthcheck]
        [--finalize] -- SCRIPT [ARGS...]

Options before ``--`` other than ``--no-healthcheck`` and ``--finalize`` go to the health check
(``healthcheck.py`` beside this file). A failed health check exits 1 before any job code runs.
SCRIPT then runs exactly as ``python SCRIPT ARGS`` would run it, with the same exit status.
Once it has returned, non-daemon threads are joined and atexit handlers run (in Python's own
order), stdout and stderr are flushed, a ``RankExit`` payload is printed, and the process leaves
with ``os._exit(C)``: without interpreter finalization, where torch's C++ threads (Gloo, DDP)
sometimes abort a finished process. ``--finalize`` (``job.fast_exit: false``) finalizes normally.
What the rank says to ddplaunch is typed (the payloads below): its start (pid, restart), the
exception that ended its script, its exit; rank 0 the job's optimizer steps and checkpoint loads
(``ProgressHooks``: hooks, no print convention); every rank its step timing (``steptiming.py``).
"""

import atexit
import functools
import importlib.abc
import importlib.util
import os
import runpy
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn, Optional

USAGE = ("usage: entry.py [health-check options | --no-healthcheck] [--finalize] "
         "-- SCRIPT [ARGS...]")
HERE = os.path.dirname(os.path.abspath(__file__))
WATCH_ENV = "DDPLAUNCH_CHECKPOINT_WATCH"  # checkpoint.watch: the job's own dir in RAM (ckpt/restore.py)


def split_argv(argv: list[str]) -> tuple[list[str], bool, bool, list[str]]:
    """``[opts..., '--', script, args...]`` -> (health-check opts, healthcheck?, finalize?, script argv).

    Raises:
        ValueError: no ``--`` or no script after it.
    """
    if "--" not in argv:
        raise ValueError("missing '--' before the script")
    cut = argv.index("--")
    opts, script_argv = argv[:cut], argv[cut + 1:]
    if not script_argv:
        raise ValueError("missing SCRIPT after '--'")
    healthcheck = "--no-healthcheck" not in opts
    finalize = "--finalize" in opts
    opts = [o for o in opts if o not in ("--no-healthcheck", "--finalize")]
    return opts, healthcheck, finalize, script_argv


def load_sibling(name: str) -> Any:
    """Imports NAME.py from this file's directory under a name no job can shadow (once: its
    siblings find it in sys.modules)."""
    known = sys.modules.get(f"ddplaunch_hostside_{name}")
    if known is not None:
        return known
    path = os.path.join(HERE, f"{name}.py")  # staged flat in the run dir; in the package, ckpt/'s too
    path = path if os.path.exists(path) else os.path.join(HERE, "ckpt", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"ddplaunch_hostside_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ left in the run dir
    try:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


P = load_sibling("payloads")


def _exit_code(exc: SystemExit) -> int:
    """What ``python SCRIPT`` exits with for this SystemExit (None 0, int, else print and 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _script_traceback(tb: Any, script_path: str) -> Any:
    """Drops this file's and runpy's frames, as Python shows none of its own above the script."""
    while tb is not None and tb.tb_frame.f_code.co_filename != script_path:
        tb = tb.tb_next
    return tb


def run_script(script_argv: list[str]) -> int:
    """Runs SCRIPT as ``__main__`` like ``python SCRIPT ARGS``; returns its exit status."""
    script = script_argv[0]
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        sys.stderr.write(f"{sys.executable}: can't open file {path!r}: [Errno 2] No such file or directory\n")
        return 2
    sys.argv = list(script_argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(path, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:  # noqa: B902 - uncaught in the script: Python's behaviour
        tb = _script_traceback(exc.__traceback__, path)  # None: a SyntaxError, shown without frames
        exc.__traceback__ = tb  # Python's display reads the exception's own traceback
        try:
            sys.excepthook(type(exc), exc, tb)
        except Exception:
            traceback.print_exception(type(exc), exc, tb)
        if P.under_torchrun():
            P.say(_failed(exc, tb))
        return 130 if isinstance(exc, KeyboardInterrupt) else 1


def _failed(exc: BaseException, tb: Any) -> Any:
    """What the script raised, as data: its type, message and the innermost line it came from."""
    where = traceback.extract_tb(tb)[-1] if tb is not None else None
    if where is None and isinstance(exc, SyntaxError):
        file, line = exc.filename or "", exc.lineno or 0
    else:
        file, line = (where.filename, where.lineno or 0) if where is not None else ("", 0)
    return P.RankFailed(int(os.environ.get("RANK", "0")), type(exc).__qualname__, str(exc)[:1000], file, line)


def loaded_name(target: Any) -> str:
    """What a load read, as a path: the path given, else the path of the file object or reader
    (`name` of an open file; `path` of fsspec's LocalFileOpener, which Lightning passes, and of
    DCP's FileSystemReader), else the object's type."""
    for value in (target, getattr(target, "name", None), getattr(target, "path", None)):
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    return type(target).__name__


def shut_down_like_python() -> None:
    """What Py_FinalizeEx does first: join non-daemon threads, then run atexit handlers."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except BaseException:  # noqa: B902 - Python ignores it here too
            traceback.print_exc()
    atexit._run_exitfuncs()  # prints and ignores a failing handler, like Python


def _flush() -> bool:
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            ok = False
    return ok


def leave(code: int, finalize: bool) -> None:
    """Flushes, prints the rank-exit line and exits with ``code`` (os._exit unless ``finalize``)."""
    code &= 0xFF
    if not _flush() and code == 0:
        code = 120  # what Python exits with when flushing stdout fails at exit
    P.say(P.RankExit(int(os.environ.get("RANK", "0")), code))
    if finalize:
        sys.exit(code)
    os._exit(code)


def say_start() -> None:
    """Under torchrun, a worker says it started: its pid (the kernel's OOM killer names pids) and
    which restart it is (`job.max_restarts`: the launcher counts each node's restarts from these)."""
    if not P.under_torchrun():
        return
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = int(os.environ.get("RANK", "0"))
    P.say(P.RankStart(rank, os.getpid(), int(os.environ.get("LOCAL_RANK", "0")), int(restart) if restart.isdigit() else 0,
                      os.environ.get("DDPLAUNCH_HOST", "")))
    P.to_agent({"kind": "start", "rank": rank})


#: Seconds between two progress lines of rank 0 (the first step is said at once).
PROGRESS_EVERY = 1.0
#: A file of the host's run directory (beside this script) the launcher creates to ask rank 0 to
#: hold before its first optimizer step after a checkpoint: the job is stopped there, with no
#: completed step past that checkpoint (a straggler's eviction, recovery.evict_stragglers).
HOLD_FILE = "hold-at-checkpoint"


class ProgressHooks:
    """The job's real progress, seen from inside its process without any print convention: its
    optimizer steps (torch.optim's global step hook; the first optimizer that steps is counted,
    so a GAN's two do not count twice) and the checkpoints it loads (torch.load,
    torch.distributed.checkpoint.load). Rank 0 says them as machine lines the launcher reads:
    ``DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": N}`` (at most once a second, and at exit) and
    ``DDPLAUNCH_LOADED_JSON {"rank": 0, "path": P, "via": F}``. Nothing imports torch for it:
    the hooks go in when the job imports torch."""

    def __init__(self, timing: Any = None) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        #: every rank's step timing (steptiming.py), told of each step; None: not timed
        self.timing = timing
        self.steps, self.said, self.said_at = 0, -1, 0.0
        #: seconds rank 0 spent inside checkpoint saves: all of them, and up to its newest step
        #: (a save after the last step is the run's end, not a stall of its training)
        self.saving_s = self.saved_by_step = 0.0
        self.saves = self.saves_by_step = 0
        self._optimizer: Optional[int] = None
        self._patched: set[str] = set()
        self._saved: Optional[str] = None  # what rank 0 saved since its last optimizer step
        self._inside = threading.local()  # within a load said already, or a save timed already

    def say(self, payload: Any) -> None:
        if self.rank == 0:
            P.say(payload)

    def stepped(self, optimizer: Any, *_args: Any) -> None:
        if self._optimizer is None:
            self._optimizer = id(optimizer)
        if id(optimizer) != self._optimizer:
            return
        self.steps += 1
        self.saved_by_step, self.saves_by_step = self.saving_s, self.saves
        if self.timing is not None:
            self.timing.stepped(self.steps)
        now = time.monotonic()
        if self.said < 0 or now - self.said_at >= PROGRESS_EVERY:
            self.flush(now)

    def before_step(self, optimizer: Any, *_args: Any) -> None:
        """Rank 0, before an optimizer step that follows a save: hold there if asked (HOLD_FILE),
        saying so, until stopped. The checkpoint is complete (the job's code after its save ran)."""
        if self.rank != 0 or self._saved is None or id(optimizer) != self._optimizer:
            return
        saved, self._saved = self._saved, None
        hold = os.path.join(HERE, HOLD_FILE)
        try:
            os.unlink(hold)  # asked once: a relaunch on this host does not hold again
        except OSError:
            return
        import signal
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # held: a stop ends it at once
        self.say(P.Held(self.rank, self.steps, saved))
        while True:
            time.sleep(1)

    def saving(self, via: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (a save function) noting on rank 0 what it saved, and the time inside it (saves
        inside it, dcp's torch.save, are its own)."""
        def save(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "saving", False):
                return fn(*args, **kwargs)
            self._inside.saving, started = True, time.monotonic()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._inside.saving = False
                self.saving_s += time.monotonic() - started
                self.saves += 1
            if via == "ddplaunch.checkpoint.save":
                target: Any = f"step {args[1] if len(args) > 1 else kwargs.get('step')}"
            else:
                target = args[1] if via == "torch.save" and len(args) > 1 else kwargs.get("f", kwargs.get("checkpoint_id"))
            self._saved = str(target if isinstance(target, (str, os.PathLike)) else type(target).__name__)[:300]
            return result
        return functools.wraps(fn)(save)

    def flush(self, now: float = 0.0) -> None:
        if self.steps and self.steps != self.said:
            self.said, self.said_at = self.steps, now or time.monotonic()
            self.say(P.StepsDone(self.rank, self.steps, round(self.saved_by_step, 4), self.saves_by_step))

    def loaded(self, via: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (a load function) saying what it loads; loads inside it (dcp reads with torch.load)
        are its own, not said again."""
        def load(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0):
                return fn(*args, **kwargs)
            if via == "torch.load":
                target = args[0] if args else kwargs.get("f")
            else:
                target = kwargs.get("checkpoint_id", kwargs.get("storage_reader"))
            name = loaded_name(target)[:300]
            self._inside.depth = 1
            try:
                got = fn(*args, **kwargs)
            except BaseException:
                self.say(P.Loaded(self.rank, name, via))
                raise
            finally:
                self._inside.depth = 0
            # the step it holds, where it says one (Lightning's global_step, nanoGPT's iter_num, a
            # `step`): the run's ledger counts the work redone from it (dcp fills the state given)
            held = got if via == "torch.load" else (args[0] if args else kwargs.get("state_dict"))
            self.say(P.Loaded(self.rank, name, via, step=P.step_in(held)))
            return got
        return functools.wraps(fn)(load)

    def trainer_state(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The HF Trainer's `TrainerState.load_from_json`, saying the step it resumes from."""
        def load_from_json(*args: Any, **kwargs: Any) -> Any:
            state = fn(*args, **kwargs)
            path = str(args[-1] if args else kwargs.get("json_path", ""))
            step = getattr(state, "global_step", None)
            self.say(P.Loaded(self.rank, path[:300], "transformers.TrainerState",
                              step=step if isinstance(step, int) and step >= 0 else None))
            return state
        return functools.wraps(fn)(load_from_json)

    def patch(self) -> None:
        """Hook what of torch is imported by now (each once)."""
        if self.timing is not None:
            self.timing.patch()
        torch = sys.modules.get("torch")
        if torch is not None and "load" not in self._patched and hasattr(torch, "load"):
            self._patched.add("load")
            setattr(torch, "load", self.loaded("torch.load", getattr(torch, "load")))
            if self.rank == 0 and hasattr(torch, "save"):
                setattr(torch, "save", self.saving("torch.save", getattr(torch, "save")))
        opt = sys.modules.get("torch.optim.optimizer")
        if opt is not None and "step" not in self._patched and hasattr(opt, "register_optimizer_step_post_hook"):
            self._patched.add("step")
            opt.register_optimizer_step_post_hook(self.stepped)
            if self.rank == 0 and hasattr(opt, "register_optimizer_step_pre_hook"):
                opt.register_optimizer_step_pre_hook(self.before_step)
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is not None and "dcp" not in self._patched:
            self._patched.add("dcp")
            for name in ("load", "load_state_dict"):
                if hasattr(dcp, name):
                    setattr(dcp, name, self.loaded(f"torch.distributed.checkpoint.{name}", getattr(dcp, name)))
            for name in ("save", "save_state_dict"):
                if self.rank == 0 and hasattr(dcp, name):
                    setattr(dcp, name, self.saving(f"torch.distributed.checkpoint.{name}", getattr(dcp, name)))
        hf = sys.modules.get("transformers.trainer_callback")
        state = getattr(hf, "TrainerState", None)
        if state is not None and "hf" not in self._patched and hasattr(state, "load_from_json"):
            self._patched.add("hf")
            setattr(state, "load_from_json", classmethod(self.trainer_state(state.load_from_json.__func__)))
        for module in ("ddplaunch.checkpoint", "ddplaunch.hostside.ckpt.injob"):  # the tier's save: its stall
            api = sys.modules.get(module)
            if api is not None and module not in self._patched and self.rank == 0 and hasattr(api, "save"):
                self._patched.add(module)
                setattr(api, "save", self.saving("ddplaunch.checkpoint.save", getattr(api, "save")))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then()` after any module of torch has been imported (a post-import hook)."""

    NAMES = ("torch", "torch.optim.optimizer", "torch.distributed.checkpoint", "torch.distributed",
             "torch.nn.parallel.distributed", "ddplaunch.checkpoint", "transformers.trainer_callback")

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader, then = spec.loader, self.then

                class _Then(importlib.abc.Loader):
                    def create_module(self, spec: Any) -> Any:
                        return loader.create_module(spec)

                    def exec_module(self, module: Any) -> None:
                        loader.exec_module(module)
                        then()
                spec.loader = _Then()
                return spec
        return None


def watch_progress() -> ProgressHooks:
    """Install the progress hooks (now for what torch is imported already, the rest on import)."""
    progress = ProgressHooks()
    if os.environ.get("DDPLAUNCH_STEP_TIMING", "1") != "0":
        try:
            progress.timing = load_sibling("steptiming").StepTiming()
        except Exception:  # noqa: BLE001 - progress is seen without it
            pass
    try:
        progress.patch()
        sys.meta_path.insert(0, _AfterImport(progress.patch))
    except Exception:  # noqa: BLE001 - progress is a help, never a failure of the job
        pass
    os._exit = _said_first(progress, os._exit)
    return progress


def _said_first(progress: ProgressHooks, real_exit: Callable[[int], NoReturn]) -> Callable[..., NoReturn]:
    """`os._exit` that first says the last steps and timing (and, `checkpoint.watch`, makes the
    job's last checkpoint durable): a script that ends with it (to skip the interpreter's teardown,
    as jobs/train.py does) ends before entry.py's own last word."""
    def _exit(code: int) -> NoReturn:
        try:
            watch_finished()
            progress.flush()
            if progress.timing is not None:
                progress.timing.flush()
        except BaseException:  # noqa: B902 - the exit is what was asked for
            pass
        real_exit(code)
    return _exit


def whole_lines() -> None:
    """The script's stdout and stderr reach their files a line at a time, as on a terminal.

    Under ``PYTHONUNBUFFERED=1`` (set so that torchrun's --tee copies lines without delay),
    ``print(text)`` writes ``text`` and its newline in two system calls; torchrun's tailer reads
    the log file at any moment and can copy the line without its end: the next line's prefix was
    then glued to it on screen. Line buffering writes each line whole (a line is cut only beyond
    the buffer's 8 KiB, or where the script itself flushes half a line)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # None: replaced by something else
        try:
            if reconfigure is not None:
                reconfigure(line_buffering=True, write_through=False)
        except ValueError:  # closed
            pass


def ckpt_siblings() -> Any:
    """ckpt/restore.py, after the modules it imports (each finds the ones before it loaded)."""
    for name in ("layout", "jobfiles", "jobwatch"):
        load_sibling(name)
    return load_sibling("restore")


def watched(script_argv: list[str]) -> list[str]:
    """`checkpoint.watch`: the script's `{checkpoint_dir}` is this host's memory-backed dir, where
    the newest complete checkpoint is put back first (ckpt/restore.py); rank 0 says which step."""
    if os.environ.get(WATCH_ENV) != "1":
        return script_argv
    try:
        argv, got = ckpt_siblings().begin(os.environ, script_argv)
    except Exception as exc:  # the job would start over without its checkpoint: it does not start
        sys.stderr.write(f"entry.py: checkpoint.watch: the job's checkpoint dir could not be put back: {exc}\n")
        leave(1, finalize=False)
    if got is not None and int(os.environ.get("RANK", "0")) == 0:
        P.say(P.Loaded(0, got.path[:300], "checkpoint.watch", step=got.step, source=got.source, host=got.host,
                       origin=got.origin))
    return argv


def watch_finished() -> None:
    """`checkpoint.watch`, on the node's local rank 0 once the script returned: what the job wrote
    last made durable before the rank leaves; rank 0 says its step (the run's summary shows it)."""
    if os.environ.get(WATCH_ENV) != "1" or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    started = time.monotonic()
    done = ckpt_siblings().jobwatch.finish(os.environ, lambda text: sys.stderr.write(f"ddplaunch: {text}\n"))
    if done is not None and int(os.environ.get("RANK", "0")) == 0 and P.under_torchrun():
        step, failed = done
        P.say(P.Durable(0, step, round(time.monotonic() - started, 3), failed[:300]))


def main(argv: list[str]) -> None:
    whole_lines()
    say_start()
    try:
        opts, healthcheck, finalize, script_argv = split_argv(argv)
    except ValueError as exc:
        sys.stderr.write(f"entry.py: {exc}\n{USAGE}\n")
        sys.stderr.flush()
        os._exit(2)
    if healthcheck:
        status = load_sibling("healthcheck").run(opts)
        if status != 0:  # the health check printed the FAIL line; no job code runs
            leave(status, finalize=False)  # nothing to finalize for, maybe a broken group
    script_argv = watched(script_argv)
    progress = watch_progress()
    code = run_script(script_argv)
    shut_down_like_python()
    watch_finished()
    progress.flush()
    if progress.timing is not None:
        progress.timing.flush()
    leave(code, finalize)


if __name__ == "__main__":
    main(sys.argv[1:])
