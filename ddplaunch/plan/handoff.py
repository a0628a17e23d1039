"""A run handed to a supervisor in another process: the validated spec (secrets included), the
spec's path and the command line's options (`UpOptions`: `dataclasses.asdict` there,
`UpOptions(**...)` back), as one environment variable
(`DDPLAUNCH_SUPERVISE`, base64 of JSON). An environment, never a command line or a script: Slurm
shows a job's script to whoever may read the job, its environment to no one but its owner and the
administrators. `restored_spec` is the one way a spec written down (here, or in a run's record)
becomes a `ClusterSpec` again."""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ddplaunch.errors import SpecError
from ddplaunch.plan.stages import UpOptions
from ddplaunch.spec.model import ClusterSpec

SUPERVISE_ENV = "DDPLAUNCH_SUPERVISE"


@dataclass(frozen=True)
class HandedOver:
    """A run as its supervisor receives it."""

    spec: ClusterSpec
    spec_path: str
    #: the command line's options, as the supervisor runs with them (`supervisor_opts`)
    opts: UpOptions
    #: the launcher's `from_env` variables, for a supervisor whose environment is not the launcher's
    environ: dict[str, str]


def restored_spec(data: Mapping[str, Any], base_dir: str) -> ClusterSpec:
    """A spec from what `model_dump` (or `ClusterSpec.redacted`) wrote of one, its relative paths
    taken from `base_dir` again (the spec file's directory, which a dump leaves out).

    Raises:
        pydantic.ValidationError (a ValueError): `data` is not a valid spec.
    """
    return ClusterSpec.model_validate(data).model_copy(update={"base_dir": base_dir})


def encode_run(spec: ClusterSpec, spec_path: str, opts: UpOptions,
               environ: Optional[Mapping[str, str]] = None) -> str:
    """The run as SUPERVISE_ENV's value (only what the spec set: defaults stay defaults);
    `environ`: variables the supervisor sets in its own environment before it runs."""
    run = {"spec": spec.model_dump(mode="json", exclude_unset=True), "base_dir": spec.base_dir,
           "spec_path": str(spec_path), "opts": dataclasses.asdict(opts), "environ": dict(environ or {})}
    return base64.b64encode(json.dumps(run, sort_keys=True).encode()).decode()


def supervisor_opts(opts: UpOptions, run_id: str) -> UpOptions:
    """The command line's options as the supervisor runs with them: this run id, in its own
    foreground, and no --exclude (the spec handed over has those hosts taken out already)."""
    return dataclasses.replace(opts, run_id=run_id, detach=False, exclude=[])


def decode_run(environ: Mapping[str, str]) -> HandedOver:
    """The run in `environ`'s SUPERVISE_ENV.

    Raises:
        SpecError: the variable is missing or not what `encode_run` wrote.
    """
    if SUPERVISE_ENV not in environ:
        raise SpecError(f"`ddplaunch supervise` runs inside the batch job of `up --detach` on Slurm, which sets "
                        f"{SUPERVISE_ENV}; it is not set here")
    try:
        run: dict[str, Any] = json.loads(base64.b64decode(environ[SUPERVISE_ENV], validate=True))
        spec = restored_spec(run["spec"], run["base_dir"])
        extra = run.get("environ", {})
        if not isinstance(run["opts"], dict) or not isinstance(extra, dict) or \
                not all(isinstance(v, str) for v in extra.values()):
            raise TypeError("its options or environment are not mappings of the right kind")
        return HandedOver(spec, str(run["spec_path"]), UpOptions(**run["opts"]), extra)
    except (KeyError, ValueError, TypeError) as err:
        raise SpecError(f"{SUPERVISE_ENV} is not a run `up --detach` wrote ({type(err).__name__}: {err})") from None
