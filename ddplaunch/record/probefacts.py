"""What the pre-flight learned of one host, as the checks read it (`HostFacts`): the answer of
hostside/probe.py, the image check's answer in front of it (plan/container.py `image_check`), or
what kept the probe from running. Every key is optional: which ones are there says which of these
it is. Data only; diagnose/preflight.py fills and judges it, the event log keeps it as JSON.
"""

from __future__ import annotations

from typing import Optional, TypedDict


class HostFacts(TypedDict, total=False):
    """One host's facts (keys absent where the probe did not get that far)."""

    # the backend could not reach the host (or run anything there): its error, its fix
    error: str
    fix: str
    #: the jump host the connection went through, when it is the jump host that failed
    jump: Optional[str]
    # the image check's answer (a container): what is missing, and why as data
    image_error: str
    #: an `ImageProblem` value (plan/container.py): what the fix is decided from
    image_problem: str
    workdir_error: str
    # the probe ran but gave no answer: its exit status and output's tail
    exit: int
    output: str
    # the probe's answer (hostside/probe.py)
    hostname: str
    python: Optional[str]
    executable: str
    time: float
    torch: Optional[str]
    torch_error: str
    cuda: Optional[str]
    nccl: Optional[str]
    gpus: Optional[int]
    gpu_procs: list[str]
    gpu_error: str
    #: {run id: pids} of other runs' processes still on the host
    leftovers: dict[str, list[int]]
    master_ips: list[str]
    master_error: str
    route_ip: Optional[str]
    route_iface: Optional[str]
    port_busy: Optional[str]
    port_error: Optional[str]
    peers_seen: list[str]
    workdir_ok: bool
    script_ok: bool
    disk_free_gb: float
    workdir_writable: bool
    uid: int
    #: why checkpoint.durable cannot take a save (None: it can); absent without one in the spec
    durable_problem: Optional[str]
    shm_bytes: Optional[int]
