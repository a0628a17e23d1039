"""`ddplaunch.checkpoint`: checkpoints at memory speed for a job's own code (`save`, `load`,
`wait`, `close`, `configure`, `free`); it lives in `hostside/ckpt/`, which runs in the job's process."""

from ddplaunch.hostside.ckpt.injob import (CheckpointError, CheckpointWarning, Config, Loaded, Source, TornCheckpoint,
                                         Where, close, configure, free, load, save, wait)

__all__ = ["CheckpointError", "CheckpointWarning", "Config", "Loaded", "Source", "TornCheckpoint", "Where",
           "close", "configure", "free", "load", "save", "wait"]
