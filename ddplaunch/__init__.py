"""ddplaunch: launch PyTorch DDP training on every host of a cluster, safely.

The flow: `load_spec` -> `make_plan` -> backend (local, ssh, slurm) -> events -> readers
(docs/architecture.md). From Python: `ddplaunch.up(spec, ...)`, `ddplaunch.check(spec, ...)` and
`ddplaunch.load_spec(spec)` return a RunReport (the fold of the run's events) or a ClusterSpec,
`ddplaunch.submit(spec, ...)` a Run handle (ddplaunch/api.py); errors are DdplaunchError subclasses.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["BackendError", "DdplaunchError", "PlanError", "Run", "RunReport", "SpecError", "__version__", "check",
           "load_spec", "submit", "up"]

_API = {"up": "ddplaunch.api", "check": "ddplaunch.api", "load_spec": "ddplaunch.api", "submit": "ddplaunch.api",
        "Run": "ddplaunch.api",
        "RunReport": "ddplaunch.api", "DdplaunchError": "ddplaunch.errors", "SpecError": "ddplaunch.errors",
        "PlanError": "ddplaunch.errors", "BackendError": "ddplaunch.errors"}


def __getattr__(name: str) -> Any:
    """The API, imported on first use: the command line's start-up stays light."""
    if name not in _API:
        raise AttributeError(f"module 'ddplaunch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_API[name]), name)
