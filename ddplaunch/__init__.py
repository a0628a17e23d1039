"""ddplaunch: launch PyTorch DDP training on every host of a cluster, safely.

The flow: `load_spec` -> `make_plan` -> backend (local, ssh, slurm) -> report.
"""

__version__ = "0.1.0"
