"""`ddplaunch.checkpoint`: checkpoints at memory speed for a job's own code (`save`, `load`,
`wait`, `close`, `configure`, `free`; for DCP/FSDP2 state dicts `dcp_save`, `dcp_load`, `dcp_wait`,
`dcp_close`); it lives in `hostside/ckpt/`, which runs in the job's process."""

from ddplaunch.hostside.ckpt.injob import (CheckpointError, CheckpointWarning, Config, Loaded, Source, TornCheckpoint,
                                         Where, close, configure, free, load, save, wait)
from ddplaunch.hostside.ckpt.dcp import dcp_close, dcp_load, dcp_save, dcp_wait

__all__ = ["CheckpointError", "CheckpointWarning", "Config", "Loaded", "Source", "TornCheckpoint", "Where",
           "close", "configure", "dcp_close", "dcp_load", "dcp_save", "dcp_wait", "free", "load", "save", "wait"]
