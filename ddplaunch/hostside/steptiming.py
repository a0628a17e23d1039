"""Per-rank step timing from inside every rank's process, with no change to the job's code.

Loaded by entry.py (stdlib only here; torch is reached through what the job imports). Per
optimizer step each rank records the step's wall time and how long it waited at the gradient
collectives: in a synchronous job every rank's step takes as long as the slowest's, so the
straggler is the rank that waits least — its compute share (step time minus wait) is the
largest. Waits are measured

- for `DistributedDataParallel`: by a comm hook installed on every DDP the script builds
  (the default all-reduce, or the hook the script registers, called inside ours): from the
  moment the step's last gradient bucket is ready on this rank to the moment the last bucket's
  collective completes. On CUDA (NCCL) both moments are the GPU's, CUDA events on the streams
  (NCCL's collectives return to Python at once: the host sees no wait; the GPU waits for the
  peers); the events are read once they completed, so a step's line may leave a second later;
- for FSDP2 and every other `torch.distributed` collective (the functions are wrapped): the
  time a blocking call spends inside it, and for an async call the time spent blocked in its
  `Work.wait()` (FSDP2 all-gathers and reduce-scatters through these functions; on CPU/Gloo its
  default calls block).

A background thread sends what was recorded at most once a second, a batch of
``[step, step_s, wait_s]`` per message to the node's agent (agent.py, named by DDPLAUNCH_AGENT),
or, without an agent (torchrun started by hand), as a line ``DDPLAUNCH_TIMING_JSON {"rank": R,
"steps": [...]}`` (payloads.py's `Timing`) written to the process's stdout file descriptor whole
(the training thread never writes it). Nothing is sent
while no step completes, so a hung job stays silent for the hang watchdog.
`DDPLAUNCH_STEP_TIMING=0` in the job's environment turns it off (entry.py then does not load it).
"""

import functools
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

#: Seconds between two timing lines of one rank.
SEND_EVERY = 1.0
#: Steps per line (a line stays well under the 4 KiB a pipe writes atomically).
PER_LINE = 60
#: Collectives of torch.distributed whose time a rank spends waiting in them.
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
               "broadcast", "barrier", "all_to_all_single", "all_gather_single", "reduce_scatter_single")


def _payloads() -> Any:
    """payloads.py beside this file (the schema entry.py loaded already, or loaded here)."""
    import importlib.util

    known = sys.modules.get("ddplaunch_hostside_payloads")
    if known is not None:
        return known
    spec = importlib.util.spec_from_file_location("ddplaunch_hostside_payloads",
                                                  os.path.join(os.path.dirname(os.path.abspath(__file__)), "payloads.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class StepTiming:
    """One rank's step and wait times, batched to the launcher off the training thread."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        #: the payload schema (payloads.py): batches go to the node's agent, else to stdout
        self._payloads = _payloads()
        self._lock = threading.Lock()
        self._last_end: Optional[float] = None
        self._arrived: Optional[float] = None    # when this step's last gradient bucket was ready (DDP)
        self._completed: Optional[float] = None  # when the last bucket's collective completed
        self._waited = 0.0                       # seconds inside plain collectives this step
        # CUDA: (this step's last bucket ready, [its collectives done])
        self._events: Optional[tuple[Any, list[Any]]] = None
        self._pending: list[list[Any]] = []      # [step, step_s, wait_s] to send, or with CUDA events still to read
        self._sender: Optional[threading.Thread] = None
        self._patched: set[str] = set()
        self._inside = threading.local()  # in a timed collective (its own Work.wait is not counted twice)

    # ------------------------------------------------------------------ what the job does

    def stepped(self, step: int) -> None:
        """Optimizer step `step` ended (entry.py's optimizer hook counts them, on every rank)."""
        now = time.monotonic()
        with self._lock:
            if self._last_end is not None:
                wait = self._waited
                step_s = now - self._last_end
                if self._events is not None and self._events[1]:
                    self._pending.append([step, round(step_s, 6), wait, self._events])
                else:
                    if self._arrived is not None and self._completed is not None:
                        wait += max(0.0, self._completed - self._arrived)
                    self._pending.append([step, round(step_s, 6), round(min(wait, step_s), 6)])
            self._last_end = now
            self._arrived = self._completed = self._events = None
            self._waited = 0.0
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="ddplaunch-step-timing", daemon=True)
            self._sender.start()

    def _bucket_ready(self, event: Any = None) -> None:
        with self._lock:
            self._arrived = time.monotonic()
            self._events = (event, []) if event is not None else None

    def _bucket_done_on_gpu(self, event: Any) -> None:
        with self._lock:
            if self._events is not None:
                self._events[1].append(event)

    def _bucket_done(self) -> None:
        with self._lock:
            now = time.monotonic()
            self._completed = now if self._completed is None else max(self._completed, now)

    def _waited_for(self, seconds: float) -> None:
        with self._lock:
            self._waited += seconds

    # ------------------------------------------------------------------ to the launcher

    def _send_loop(self) -> None:
        while True:
            time.sleep(SEND_EVERY)
            self.flush()

    def flush(self) -> None:
        with self._lock:
            ready = 0
            for entry in self._pending:
                if len(entry) == 4 and not _read_events(entry):
                    break  # the GPU has not got this far yet: this and later steps wait (in order)
                ready += 1
            batch, self._pending = self._pending[:ready], self._pending[ready:]
        for i in range(0, len(batch), PER_LINE):
            steps = batch[i:i + PER_LINE]
            if self._payloads.to_agent({"rank": self.rank, "steps": steps}) != self._payloads.ABSENT:
                continue  # taken, or dropped by an agent that is behind: never a line per rank then
            try:  # no agent (torchrun started without ddplaunch, or its agent is gone): the line itself
                os.write(1, self._payloads.payload_line(self._payloads.Timing(self.rank, steps)).encode())
            except OSError:
                return

    # ------------------------------------------------------------------ hooks

    def patch(self) -> None:
        """Hook what of torch.distributed and DDP is imported by now (each once)."""
        ddp = sys.modules.get("torch.nn.parallel.distributed")
        if ddp is not None and "ddp" not in self._patched and hasattr(ddp, "DistributedDataParallel"):
            self._patched.add("ddp")
            self._patch_ddp(ddp.DistributedDataParallel)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and "dist" not in self._patched and hasattr(dist, "all_reduce"):
            self._patched.add("dist")
            for name in COLLECTIVES:
                if hasattr(dist, name):
                    setattr(dist, name, self._timed_collective(getattr(dist, name)))
            work = getattr(getattr(dist, "distributed_c10d", None), "Work", None)
            if work is not None and hasattr(work, "wait"):
                try:
                    work.wait = self._timed_collective(work.wait)
                except (AttributeError, TypeError):  # a build whose Work takes no attribute: untimed
                    pass

    def _timed_collective(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (a collective, or `Work.wait`) with the time a call blocks in it counted as wait:
        an async collective returns at once and its wait is timed where the script waits for it;
        a blocking one waits inside its own call (timed once, not again in its Work.wait)."""
        timing, inside = self, self._inside

        @functools.wraps(fn)
        def ddplaunch_timing_wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "on", False) or kwargs.get("async_op"):
                return fn(*args, **kwargs)
            inside.on = True
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                inside.on = False
                timing._waited_for(time.monotonic() - t0)
        return ddplaunch_timing_wrapper

    def _patch_ddp(self, cls: Any) -> None:
        """Every DDP built gets our comm hook; one the script registers runs inside it."""
        timing = self
        init, register, builtin = cls.__init__, cls.register_comm_hook, getattr(cls, "_register_builtin_comm_hook", None)

        @functools.wraps(init)
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            init(ddp, *args, **kwargs)
            try:
                inner = {"state": None, "hook": None}
                register(ddp, None, timing._comm_hook(ddp, inner))
                ddp._ddplaunch_inner = inner
            except Exception:  # noqa: BLE001 - timing is a help, never a failure of the job
                pass

        @functools.wraps(register)
        def register_comm_hook(ddp: Any, state: Any, hook: Any) -> Any:
            inner = getattr(ddp, "_ddplaunch_inner", None)
            if inner is None or inner["hook"] is not None:
                return register(ddp, state, hook)  # ours is not there, or a second call: DDP's own answer
            inner.update(state=state, hook=hook)
            return None

        cls.__init__, cls.register_comm_hook = __init__, register_comm_hook
        if builtin is not None:
            @functools.wraps(builtin)
            def _register_builtin_comm_hook(ddp: Any, comm_hook_type: Any) -> Any:
                hook = _builtin_hook(comm_hook_type)
                if hook is None or getattr(ddp, "_ddplaunch_inner", None) is None:
                    return builtin(ddp, comm_hook_type)
                return register_comm_hook(ddp, ddp.process_group, hook)
            cls._register_builtin_comm_hook = _register_builtin_comm_hook

    def _comm_hook(self, ddp: Any, inner: dict[str, Any]) -> Callable[[Any, Any], Any]:
        timing = self

        # typed by a comment: DDP refuses a comm hook annotated with other types than its own
        def ddplaunch_timed_hook(state, bucket):  # type: (Any, Any) -> Any
            ready = _gpu_event(bucket.buffer())
            timing._bucket_ready(ready)
            if inner["hook"] is not None:
                fut = inner["hook"](inner["state"], bucket)
            else:
                fut = _scaled_sum(getattr(ddp, "process_group", None), bucket)

            def done(_: Any) -> None:
                # on CUDA the callback runs on a stream that waits for the collective's kernels:
                # an event recorded there completes when the collective has on the GPU
                event = _gpu_event(bucket.buffer()) if ready is not None else None
                if event is not None:
                    timing._bucket_done_on_gpu(event)
                else:
                    timing._bucket_done()
            # a callback, not `then`: DDP gets the collective's own future (its errors unwrapped)
            fut.add_done_callback(done)
            return fut
        return ddplaunch_timed_hook


def _gpu_event(tensor: Any) -> Any:
    """A CUDA event recorded now on the current stream when `tensor` is on a GPU, else None
    (timing is a help: any failure means no event, never a failure of the job)."""
    try:
        if not tensor.is_cuda:
            return None
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    except Exception:  # noqa: BLE001
        return None


def _read_events(entry: list[Any]) -> bool:
    """Turn a pending [step, step_s, wait_s, (ready, [done...])] into [step, step_s, wait_s] once
    its events completed (False: not yet); the GPU's wait is from the bucket ready to its last
    collective done, within the step."""
    step, step_s, wait, (ready, done) = entry
    try:
        if not all(e.query() for e in (ready, *done)):
            return False
        wait += max(0.0, max(ready.elapsed_time(e) for e in done) / 1000.0)
    except Exception:  # noqa: BLE001 - unreadable events: the host's own view (no wait) stands
        pass
    entry[:] = [step, step_s, round(min(wait, step_s), 6)]
    return True


def _scaled_sum(group: Any, bucket: Any) -> Any:
    """DDP's built-in all-reduce, rounding for rounding: the bucket times 1/size (the reducer's
    own scaling when no hook is set), then summed (torch's Python allreduce_hook divides instead,
    which rounds differently on 3 ranks: the final weights would differ from an untimed run's)."""
    import torch.distributed as dist
    group = group if group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _builtin_hook(comm_hook_type: Any) -> Any:
    """The Python hook of one of DDP's built-in hooks (None: not known here)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    name = getattr(comm_hook_type, "name", str(comm_hook_type)).rsplit(".", 1)[-1]
    return {"ALLREDUCE": default_hooks.allreduce_hook, "FP16_COMPRESS": default_hooks.fp16_compress_hook}.get(name)
