"""The example jobs shipped with ddplaunch, referenced from a spec as `job.script: example:NAME`.

The scripts live in the source tree's `jobs/` and, in the wheel, in the package
`ddplaunch.jobs`. A spec that names `example:toy_ddp.py` works from an empty directory:
the launcher uploads the shipped file to each host (like the health check) instead of
expecting it in the workdir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

EXAMPLE_PREFIX = "example:"

# Installed wheel: ddplaunch/jobs/ beside this file. Source tree (also an editable install,
# whose finder maps only the packages it was installed with): <repo>/jobs/.
_PACKAGE = Path(__file__).resolve().parents[1]
_CANDIDATE_DIRS = (_PACKAGE / "jobs", _PACKAGE.parent / "jobs")


def examples_dir() -> Path:
    """The directory that holds the shipped example jobs.

    Raises:
        FileNotFoundError: neither the installed package nor the source tree has them
            (a broken installation).
    """
    for candidate in _CANDIDATE_DIRS:
        if (candidate / "toy_ddp.py").is_file():
            return candidate
    raise FileNotFoundError("the example jobs are missing from this ddplaunch installation "
                            f"(looked in {', '.join(str(c) for c in _CANDIDATE_DIRS)}); reinstall ddplaunch")


def list_examples() -> list[str]:
    """The file names of the shipped example jobs, sorted (e.g. `['mismatch_demo.py', ...]`)."""
    try:
        folder = examples_dir()
    except FileNotFoundError:
        return []
    return sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("_"))


def is_example(script: str) -> bool:
    """Whether `script` (a `job.script` value) refers to a shipped example."""
    return script.startswith(EXAMPLE_PREFIX)


def example_path(script: str) -> Optional[Path]:
    """The shipped file behind `job.script: example:NAME`; None for any other script.

    Args:
        script: the `job.script` value, e.g. `example:toy_ddp.py` or `jobs/train.py`.

    Returns:
        The absolute path of the example in this installation, or None when `script` does
        not start with `example:` (a path relative to the workdir).

    Raises:
        ValueError: `script` names no shipped example; the message lists the known ones.
    """
    if not is_example(script):
        return None
    name = script[len(EXAMPLE_PREFIX):].strip()
    known = list_examples()
    # Names only: `example:../../etc/passwd` or a subdirectory must not reach outside jobs/.
    if name in known:
        return examples_dir() / name
    hint = f" (did you mean 'example:{name}.py'?)" if f"{name}.py" in known else ""
    raise ValueError(f"unknown example {name!r}{hint}; the shipped examples are: "
                     + (", ".join(f"example:{k}" for k in known) or "none (broken installation)"))
