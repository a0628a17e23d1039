"""Worker entry: the health check in this process, then the job's script as ``__main__``.

torchrun runs it as each worker (a plain script that needs only torch)::

    python -m torch.distributed.run ... entry.py [HEALTH-CHECK OPTIONS | --no-healthcheck]
        [--finalize] -- SCRIPT [ARGS...]

Options before ``--`` other than ``--no-healthcheck`` and ``--finalize`` go to the health check
(``healthcheck.py`` beside this file). A failed health check exits 1 before any job code runs.
SCRIPT then runs exactly as ``python SCRIPT ARGS`` would run it, with the same exit status.

Once the script has returned, non-daemon threads are joined and atexit handlers run (in
Python's own order), stdout and stderr are flushed, one ``DDPLAUNCH_RANKEXIT_JSON {"rank": R,
"code": C}`` line is printed, and the process leaves with ``os._exit(C)``: without interpreter
finalization, where torch's C++ threads (Gloo, DDP) sometimes abort a finished process
("terminate called without an active exception"). ``--finalize`` (``job.fast_exit: false``)
finalizes normally instead. A rank that dies after that line had finished its script. A
worker that torchrun restarted (``job.max_restarts``) first prints ``DDPLAUNCH_RANKSTART_JSON
{"rank": R, "restart": N}``.
"""

import atexit
import importlib.util
import json
import os
import runpy
import sys
import threading
import traceback

USAGE = ("usage: entry.py [health-check options | --no-healthcheck] [--finalize] "
         "-- SCRIPT [ARGS...]")
HERE = os.path.dirname(os.path.abspath(__file__))


def split_argv(argv: list) -> tuple:
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


def load_healthcheck():
    """Imports healthcheck.py from this file's directory under a name no job can shadow."""
    spec = importlib.util.spec_from_file_location("ddplaunch_hostside_healthcheck",
                                                  os.path.join(HERE, "healthcheck.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def _script_traceback(tb, script_path: str):
    """Drops this file's and runpy's frames, as Python shows none of its own above the script."""
    while tb is not None and tb.tb_frame.f_code.co_filename != script_path:
        tb = tb.tb_next
    return tb


def run_script(script_argv: list) -> int:
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
        return 130 if isinstance(exc, KeyboardInterrupt) else 1


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
    rank = int(os.environ.get("RANK", "0"))
    try:
        sys.stdout.write("DDPLAUNCH_RANKEXIT_JSON " + json.dumps({"rank": rank, "code": code}) + "\n")
        sys.stdout.flush()
    except Exception:
        pass
    if finalize:
        sys.exit(code)
    os._exit(code)


def say_restart() -> None:
    """Under torchrun, a restarted worker says which restart it is (`job.max_restarts`): the
    launcher counts each node's restarts from these lines. The first start says nothing."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart.isdigit() and int(restart) > 0:
        rank = int(os.environ.get("RANK", "0"))
        sys.stdout.write("DDPLAUNCH_RANKSTART_JSON " + json.dumps({"rank": rank, "restart": int(restart)}) + "\n")
        sys.stdout.flush()


def main(argv: list) -> None:
    say_restart()
    try:
        opts, healthcheck, finalize, script_argv = split_argv(argv)
    except ValueError as exc:
        sys.stderr.write(f"entry.py: {exc}\n{USAGE}\n")
        sys.stderr.flush()
        os._exit(2)
    if healthcheck:
        status = load_healthcheck().run(opts)
        if status != 0:  # the health check printed the FAIL line; no job code runs
            leave(status, finalize=False)  # nothing to finalize for, maybe a broken group
    code = run_script(script_argv)
    shut_down_like_python()
    leave(code, finalize)


if __name__ == "__main__":
    main(sys.argv[1:])
