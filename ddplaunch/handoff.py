"""A run handed to a supervisor in another process: the validated spec (secrets included), the
spec's path and the command line's options, as one environment variable (`DDPLAUNCH_SUPERVISE`,
base64 of JSON). An environment, never a command line or a script: Slurm shows a job's script to
whoever may read the job, its environment to no one but its owner and the administrators."""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

from ddplaunch.errors import SpecError
from ddplaunch.spec import ClusterSpec

SUPERVISE_ENV = "DDPLAUNCH_SUPERVISE"


def encode_run(spec: ClusterSpec, spec_path: str, opts: Mapping[str, Any]) -> str:
    """The run as SUPERVISE_ENV's value (only what the spec set: defaults stay defaults)."""
    run = {"spec": spec.model_dump(mode="json", exclude_unset=True), "base_dir": spec.base_dir,
           "spec_path": str(spec_path), "opts": dict(opts)}
    return base64.b64encode(json.dumps(run, sort_keys=True).encode()).decode()


def decode_run(environ: Mapping[str, str]) -> tuple[ClusterSpec, str, dict[str, Any]]:
    """(spec, spec path, options as a dict) of the run in `environ`'s SUPERVISE_ENV.

    Raises:
        SpecError: the variable is missing or not what `encode_run` wrote.
    """
    if SUPERVISE_ENV not in environ:
        raise SpecError(f"`ddplaunch supervise` runs inside the batch job of `up --detach` on Slurm, which sets "
                        f"{SUPERVISE_ENV}; it is not set here")
    try:
        run: dict[str, Any] = json.loads(base64.b64decode(environ[SUPERVISE_ENV], validate=True))
        spec = ClusterSpec.model_validate(run["spec"]).model_copy(update={"base_dir": run["base_dir"]})
        if not isinstance(run["opts"], dict):
            raise TypeError("its options are not a mapping")
        return spec, str(run["spec_path"]), run["opts"]
    except (KeyError, ValueError, TypeError) as err:
        raise SpecError(f"{SUPERVISE_ENV} is not a run `up --detach` wrote ({type(err).__name__}: {err})") from None
