"""Checkpoints at memory speed, one host's part: `save(state, step)` copies the tensors into this
host's shared memory and returns; background threads checksum the copy and persist it to the
durable directory (temp, fsync, rename, directory fsync; the manifest last); `load()` returns the
newest complete checkpoint, from this host's RAM when it holds it (nothing is read from the durable
dir then), else from the durable dir; `wait()` blocks until the newest save is durable.

    from ddplaunch import checkpoint
    checkpoint.configure(durable="ckpt")          # or DDPLAUNCH_CHECKPOINT_DIR set by the launcher
    got = checkpoint.load()                        # None, or (state, step) with .source
    for step in ...:
        checkpoint.save({"model": m.state_dict(), "optim": o.state_dict(), "step": step}, step)
    checkpoint.wait()

It runs inside the job's process (standard library and torch only) and needs nothing from the
launcher: in one process, under a plain torchrun, or under ddplaunch, which sets the environment
(`config.py`). In DDP rank 0 saves, like torch.save; `all_ranks=True` saves each rank's own part
(sharded states), and `load(all_ranks=True)` gives each rank its part of the same step.

Where it lives: `injob.py` (the functions, in the job's process, `ddplaunch.checkpoint` re-exports), `layout.py` (paths, 0600/0700, manifests, the careful durable write), `statecodec.py`
(a state as one flat buffer plus a small record), `tier.py` (save, the sealer and persister
threads, keep/memory_limit/ENOSPC), `reader.py` (load). RAM paths hold the uid, run id and host:
/dev/shm/ddplaunch-ckpt-<uid>/<run>/<host>/part-<R>/v-<step>/, so two runs, or two sim hosts on
one machine, never share one. `free(run_id)` removes a run's RAM; at interpreter exit the newest
complete RAM version is made durable first.

The launcher: the spec's `checkpoint:` section (spec/ckptsection.py) is planned into every rank's
environment (`config.py`'s variables; plan/launch.py `checkpoint_env`); the pre-flight fails a host
where `durable` is missing or not writable; the reaper (hostside/reaper.py `--free-checkpoints`,
the same path spelled there) removes a run's RAM at its end (the backend's close) and at `down`,
never between stages; `sim fault HOST --crash` empties that host's part (sim/faults.py).

Buddy copies (`replicas.py`, in the node agent): each sealed RAM version (its MANIFEST is the
hand-off point: a version without one is never copied, persisted or loaded) is copied to the node's
buddies, planned as a ring over the hosts (plan/ckptplan.py), and lands in their RAM under
`<host>/replicas/<origin>/`. `reader.py` counts a replica among a host's RAM copies; under a
process group (one part, as DDP saves) the newest step complete anywhere wins: the lowest rank
whose host holds it reads it and sends it to the others, so a relaunch after the saver's host is
lost resumes from its buddy's RAM, and nothing is read from the durable dir.

DCP (`dcp.py` over `dcpfiles.py`; `dcp_save`, `dcp_load`, `dcp_wait`, `dcp_close`): for sharded
(FSDP2) state dicts, each rank writes its own DCP files with torch's FileSystemWriter
(`use_collectives=False`) into `<host>/dcp/rank-<R>/v-<step>/`, sealed by a MANIFEST in the
background; each rank persists them to `<durable>/dcp/step-<step>/` with its manifest last, and rank
0, once every rank's manifest of the same save is there, merges the ranks' metadata into the step's
`.metadata`, written last: a plain DCP checkpoint, loadable at any world size. `dcp_load` reads
every rank's own RAM copy when all are intact, from one save, at the same world size; else the
newest step with `.metadata`, resharded by DCP. Past `memory_limit` or on a full /dev/shm a rank
writes its files straight into the durable step (`dcpbypass.py`); rank 0 says what it loaded and,
at close, that its newest save is durable (as the API does); the ranks' metadata is read by a
restricted unpickler (`dcpmeta.py`). Not replicated to buddies yet.

Unmodified scripts (`checkpoint.watch`: `jobfiles.py`, `jobwatch.py`, `restore.py`): the job's own
checkpoint dir is each node's dir in RAM (`<run>/nodes/<node rank>/`); the node agent's watch seals
each checkpoint the job completes there (its marker, a whole zip, unchanged between two looks) as a
version of part FILES_PART (so the buddy copies take it like a save) and persists it to the durable
dir as the job's own files; before the job starts, entry.py puts the newest complete one back on
every node (`restore.py`: a group of the nodes' local ranks 0, on its own store prefix).

What a killed process left sealed in RAM is made durable by the reaper (hostside/reaper.py) when the
run's RAM is freed. Not built yet: a sharded (`all_ranks`) step that one rank holds only on another
host is read from the durable dir.
"""
