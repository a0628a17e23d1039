"""Slurm's client commands (sbatch, srun, squeue, scontrol, scancel), each with a timeout, and
the job a run uses (`SlurmJob`), read from the run's memory: a detached run's from its record, an
attached run's allocation from its event log (`Allocated`). `SLURM_CONF` comes from `slurm.conf`
in the spec."""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ddplaunch.errors import BackendError
from ddplaunch.record.runs import InJob, read_record
from ddplaunch.record.snapshot import read_view
from ddplaunch.spec.model import ClusterSpec

#: Timeout of each Slurm client command.
COMMAND_TIMEOUT = 30.0
#: Seconds between `squeue` polls (`sbatch --wait` polls far too slowly for interactive use).
POLL_INTERVAL = 0.3

#: sbatch's complaint -> the spec key that causes it (first match wins).
SBATCH_ERRORS = (
    (re.compile(r"account", re.I), "slurm.account"),  # before partition: "account/partition combination"
    (re.compile(r"partition", re.I), "slurm.partition"),
    (re.compile(r"\bqos\b", re.I), "slurm.qos"),
    (re.compile(r"time limit|--time\b|invalid time", re.I), "slurm.time"),
    (re.compile(r"gres|generic resource|gpu", re.I), "slurm.gpus_per_node"),
    (re.compile(r"cpus-per-task|cpu count|more processors", re.I), "slurm.cpus_per_task"),
    (re.compile(r"node count|nodes|node configuration|nodelist", re.I), "slurm.nodes (or hosts)"),
    (re.compile(r"configuration source|slurm\.conf|contact slurm controller|controller", re.I), "slurm.conf"),
)


def job_output(spec: ClusterSpec, run_id: str) -> str:
    """Where a run's job writes its output (`%j`: the job's id)."""
    return str(Path(spec.workdir_path) / spec.slurm.output_dir / f"{run_id}-%j.out")


def spec_conf(spec: ClusterSpec) -> Optional[str]:
    """The spec's `slurm.conf` (its relative path taken from the spec file's directory), if set."""
    return str(spec.resolve(spec.slurm.conf)) if spec.slurm.conf else None


@dataclass
class SlurmJob:
    """The Slurm job a run uses: a detached run's is its record's (`InJob` in `record.json`: the
    job its supervisor runs in, submitted by ddplaunch); an attached run's allocation — the one
    it submitted, or the one it runs inside — is the backend's `Allocated` event in its log."""

    job_id: str
    #: ddplaunch submitted it (and cancels it when the run ends), rather than running inside it.
    owned: bool
    slurm_conf: Optional[str] = None
    output_path: Optional[str] = None

    @classmethod
    def load(cls, run_dir: Path) -> Optional["SlurmJob"]:
        """The run's job: the one its record names when it was detached (None before it was
        submitted), else the allocation its event log names (None: none yet)."""
        record = read_record(run_dir)
        if record is not None and isinstance(record.placement, InJob):
            job_id = record.placement.job_id
            spec = record.spec.validated
            return cls(job_id, owned=True, slurm_conf=spec_conf(spec),
                       output_path=job_output(spec, record.run_id).replace("%j", job_id)) if job_id else None
        held = read_view(run_dir).allocation
        if held is None:
            return None
        return cls(held.job_id, held.owned, spec_conf(record.spec.validated) if record is not None else None,
                   held.output_path)


class SlurmClient:
    """Runs Slurm client commands against one cluster (its `SLURM_CONF`)."""

    def __init__(self, conf: Optional[str]):
        self.conf = conf

    def env(self, extra: Optional[Mapping[str, str]] = None, inherit: bool = True) -> dict[str, str]:
        """The command's environment: this process's (unless not `inherit`), SLURM_CONF, `extra`."""
        env = dict(os.environ) if inherit else {}
        if self.conf:
            env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    def run(self, argv: list[str], timeout: float = COMMAND_TIMEOUT,
            env: Optional[Mapping[str, str]] = None, stdin: Optional[str] = None,
            inherit: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env(env, inherit),
                                  input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise BackendError(f"{argv[0]} not found on PATH: the Slurm client commands (sbatch, srun, squeue, "
                               "scontrol, scancel) are needed for backend: slurm; run ddplaunch on a "
                               "login node or install slurm-client") from None
        except subprocess.TimeoutExpired:
            raise BackendError(f"{argv[0]} gave no answer within {timeout:.0f}s "
                               "(slurmctld down or unreachable? check slurm.conf)") from None

    def job_state(self, job_id: str) -> Optional[str]:
        """The job's state while it is in the queue (PENDING, RUNNING, ...), None once gone.

        Raises:
            BackendError: squeue fails (controller unreachable).
        """
        proc = self.run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise BackendError(f"squeue failed: {first_error(proc.stderr)}")
        return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else None

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, NodeList, Restarts...); empty once forgotten."""
        proc = self.run(["scontrol", "show", "job", "-o", job_id])
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def node_addr(self, name: str) -> str:
        """Where slurmctld reaches node `name` (its NodeAddr; the name itself when unknown)."""
        proc = self.run(["scontrol", "show", "node", "-o", name])
        found = re.search(r"\bNodeAddr=(\S+)", proc.stdout) if proc.returncode == 0 else None
        return found.group(1) if found else name

    def slurmd_port(self) -> int:
        """The port every slurmd listens on (SlurmdPort; Slurm's default 6818)."""
        proc = self.run(["scontrol", "show", "config"])
        found = re.search(r"^SlurmdPort\s*=\s*(\d+)", proc.stdout, re.M) if proc.returncode == 0 else None
        return int(found.group(1)) if found else 6818

    def hostnames(self, nodelist: str) -> list[str]:
        """`gpu[01-02,07]` -> [gpu01, gpu02, gpu07], the way Slurm expands it."""
        proc = self.run(["scontrol", "show", "hostnames", nodelist])
        if proc.returncode != 0:
            raise BackendError(f"scontrol show hostnames {nodelist}: {first_error(proc.stderr)}")
        return proc.stdout.split()

    def cancel(self, job_id: str, wait: float = 120.0) -> bool:
        """`scancel` the job and wait until it has left the queue (no step process left)."""
        self.run(["scancel", job_id])
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if self.job_state(job_id) in (None, "COMPLETED", "CANCELLED", "FAILED"):
                    return True
            except BackendError:
                pass
            time.sleep(POLL_INTERVAL)
        return False

    def step_id(self, job_id: str, name: str) -> Optional[str]:
        """The id (`JOB.STEP`) of the job's step named `name`, while it runs."""
        proc = self.run(["squeue", "-s", "-h", "-j", job_id, "-o", "%i %j"])
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == name:
                return parts[0]
        return None


def describe_sbatch_error(stderr: str) -> str:
    """One line naming the spec key behind sbatch's refusal, e.g.
    `slurm.partition: sbatch: error: invalid partition specified: foo`."""
    first = first_error(stderr)
    for pattern, key in SBATCH_ERRORS:
        if pattern.search(stderr):
            return f"{key}: {first}"
    return f"slurm: sbatch refused the job: {first}"


def first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()]
    return (errors or lines or ["(no message)"])[0]
