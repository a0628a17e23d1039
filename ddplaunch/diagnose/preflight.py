"""Pre-flight host checks: every host probed at once, before any torchrun starts.

`run_preflight` sends hostside/probe.py to every host through the backend, then `evaluate` (pure)
turns the facts into one row per host and one column per check, each failure with a one-line
fix. Versions are compared across hosts; the master port is probed with a real listener.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Mapping, Optional, Union, cast

from ddplaunch.backends.contract import HostResult, Launcher
from ddplaunch.diagnose.hostprograms import ask_hosts
from ddplaunch.errors import BackendError
from ddplaunch.plan.container import ImageProblem, image_check, probe_words
from ddplaunch.plan.hostprogram import host_program
from ddplaunch.plan.launch import host_python, master_addr, rendezvous_addr
from ddplaunch.plan.shellword import IFNAME
from ddplaunch.record.diagnosis import CHECKS, Check, HostReport, PreflightReport
from ddplaunch.record.probefacts import HostFacts
from ddplaunch.spec.examples import is_example
from ddplaunch.spec.model import ClusterSpec, HostSpec
from ddplaunch.spec.values import RUNTIMES

#: The oldest torch (major, minor) the hosts may have: torchrun's --signals-to-handle came with 2.10.
MIN_TORCH = (2, 10)
#: A container's /dev/shm below this fails with NCCL (and is a warning with Gloo): Docker's
#: 64 MB default breaks NCCL's shared-memory transport.
MIN_SHM = 1 << 30
PROBE_SLACK = 20.0  # a probe's time beyond its port test (python start, facts)
#: Seconds the port test leaves of the launcher's wait, for the probe's answer to come back.
ANSWER_S = 5.0


#: What to do about a host the backend could not reach, unless the backend's error says better.
REACH_FIX = "check the host is up and reachable (ssh: sshd runs and ssh.* is right; slurm: the node's slurmd answers)"


def listen_seconds(spec: ClusterSpec, parallel: int, hosts: Optional[int] = None) -> float:
    """How long the pre-flight's port test may take: `preflight.timeout` for each wave of the
    launcher's fan-out (`hosts` probed `parallel` at a time), so the last wave's hosts still find
    the master; the launcher waits this long plus PROBE_SLACK for the answers."""
    return spec.preflight.timeout * -(-(hosts or len(spec.hosts)) // max(1, parallel))


def port_window(spec: ClusterSpec, parallel: int, hosts: Optional[int] = None) -> float:
    """How long the master's probe listens, and each host's probe tries to reach it, from its own
    start: as long as the launcher waits for the answers, less ANSWER_S. The probes of one round
    start seconds apart where hosts are loaded (srun's tasks on 128 busy nodes: over 15 s), and
    a window counted from one host's start would call a late or early host cut off. Each side
    stops as soon as the test passed (the master once every host got through)."""
    return listen_seconds(spec, parallel, hosts) + PROBE_SLACK - ANSWER_S


def probe_command(spec: ClusterSpec, host: HostSpec, run_id: str, port: Optional[int],
                  parallel: int, expect: Optional[int] = None, emulated: bool = False) -> tuple[str, str]:
    """(shell line that probes `host`, nonce of its answer line); the master waits for `expect`
    hosts (default: all) to reach its port; `emulated`: the ranks need no GPU."""
    master = master_addr(spec)
    expect = expect or len(spec.hosts)
    args = {"run_id": run_id, "master": master, "port": port, "label": host.label,
            "listen": rendezvous_addr(host) == master,
            "expect": expect, "workdir": spec.workdir_path,
            # None: a shipped `example:` job, or one `sync:` copies there at launch (after the probe)
            "script": None if is_example(spec.job.script) or spec.synced(spec.job.script) else spec.job.script,
            "need_gpus": not emulated and (spec.dist_backend == "nccl" or spec.nproc_of(host) == "auto"),
            "probe_s": port_window(spec, parallel, expect)}
    if spec.checkpoint is not None and spec.checkpoint.durable is not None:
        args["durable"] = spec.checkpoint_durable()  # the job's own dir (the default) it makes itself
    if not any(rendezvous_addr(h) == master for h in spec.hosts) and host is spec.hosts[0]:
        args["listen"] = True  # master.addr is an alias of the first host
    image = spec.container if spec.container is not None and not RUNTIMES[spec.container.runtime].in_step else None
    before = probe_words(image, run_id, host.label, spec.workdir_path) if image else []
    text, nonce = host_program("probe", host_python(spec, host), json.dumps(args, sort_keys=True), before=before)
    return (f"{image_check(image, nonce, spec.workdir_path)}; {text}" if image else text), nonce


def reach_hosts(spec: ClusterSpec, backend: Launcher[Any]) -> list[HostResult]:
    """Whether each host can be reached at all (connections kept for the probe and the stage)."""
    return backend.reach(list(spec.hosts), timeout=spec.preflight.timeout + PROBE_SLACK)


def run_preflight(spec: ClusterSpec, backend: Launcher[Any], run_id: str, port: Optional[int],
                  emulated: bool = False, reached: Optional[list[HostResult]] = None) -> PreflightReport:
    """Probe every host in parallel and evaluate the facts. The hosts that can be reached at all
    are found first (`reached`, where the caller asked already), so the master does not listen
    for a host that will never connect. `emulated` (`up --emulate`): the ranks need neither torch
    nor GPUs."""
    t0 = time.time()
    parallel = backend.max_parallel
    reached = reach_hosts(spec, backend) if reached is None else reached
    raw: dict[str, HostFacts] = {r.host.label: _unreached(r.error) for r in reached if r.error is not None}
    alive = [r.host for r in reached if r.error is None]

    def command(host: HostSpec) -> tuple[str, str]:
        return probe_command(spec, host, run_id, port, parallel, expect=len(alive), emulated=emulated)

    answers = ask_hosts(backend, command, alive, listen_seconds(spec, parallel, len(alive)) + PROBE_SLACK) \
        if alive else []
    t1 = time.time()
    for answer in answers:
        raw[answer.host.label] = host_facts(answer.data, answer.code, answer.output, answer.error)
    report = evaluate(spec, raw, launcher_time=(t0, t1), port=port, emulated=emulated)
    report.elapsed_s = time.time() - t0
    return report


def host_facts(data: Any, code: Optional[int], output: str, error: Optional[BackendError]) -> HostFacts:
    """One host's facts for `evaluate` from its probe: the probe's JSON answer (`data`: the probe's
    facts, or the image check's), else its exit status and output's tail, else the error that kept
    it from running."""
    if error is not None or code is None:
        return _unreached(error)
    return cast(HostFacts, data) if isinstance(data, dict) else \
        {"exit": code, "output": output.strip()[-300:], "python": None}


def _unreached(err: Optional[BackendError]) -> HostFacts:
    """The facts of a host the backend could not reach: its error and, where known, the fix."""
    return {"error": str(err), "fix": err.fix if err is not None else "", "jump": err.jump if err is not None else None}


def evaluate(spec: ClusterSpec, raw: Mapping[str, HostFacts], launcher_time: Union[float, tuple[float, float]],
             port: Optional[int], emulated: bool = False) -> PreflightReport:
    """Pure: per-host facts -> checks. `raw[label]` is the probe's JSON, or {"error"} / {"exit"}.
    `launcher_time` is when the launcher sent the probes and got the answers: a host clock within
    that window is not skewed, however long the probe took."""
    lo, hi = launcher_time if isinstance(launcher_time, tuple) else (launcher_time, launcher_time)
    hosts = []
    for h in spec.hosts:
        rep = HostReport(host=h.label, addr=h.reach or h.addr, facts=raw.get(h.label, HostFacts()))
        hosts.append(rep)
        f = rep.facts
        if not _probed(spec, rep, h):
            continue
        rep.checks["python"] = Check(True, f"{f['python']}")
        rep.checks["torch"] = _torch(f) if not emulated else Check(None, "not needed (emulated ranks)")
        _gpus(spec, rep, h)
        left = f.get("leftovers") or {}
        rep.checks["leftovers"] = (Check(True, "none") if not left else Check(
            False, "; ".join(f"run {r}: pids {' '.join(map(str, p[:5]))}" for r, p in sorted(left.items())),
            "end them: " + "; ".join(f"ddplaunch down {r}" for r in sorted(left))))
        _network(spec, rep, port)
        skew = f["time"] - lo if f["time"] < lo else max(0.0, f["time"] - hi)
        rep.checks["clock"] = (Check(True, f"{skew:+.2f}s") if abs(skew) <= spec.preflight.max_clock_skew
                               else Check(False, f"{skew:+.1f}s off the launcher",
                                          "run chrony/ntpd on the host (ranks' timeouts and logs rely on clocks)"))
        rep.checks["disk"] = (Check(True, f"{f['disk_free_gb']:.1f} GB")
                              if f["disk_free_gb"] >= spec.preflight.min_free_disk_gb else
                              Check(False, f"{f['disk_free_gb']:.2f} GB free in workdir",
                                    f"free space (need {spec.preflight.min_free_disk_gb} GB for logs and checkpoints)"))
        rep.checks["workdir"] = (Check(True, "ok") if f["script_ok"] else Check(
            False, f"{spec.workdir_path}/{spec.job.script} missing" if f["workdir_ok"]
            else f"workdir {spec.workdir_path} missing", "create it or list the files under `sync:`"))
        if "durable_problem" in f:
            rep.checks["checkpoint"] = durable_check(spec, f.get("durable_problem"))
        if spec.container is not None:
            _in_container(spec, rep)
    _versions(hosts)
    ifname = _agree_iface(spec, hosts)
    for rep in hosts:
        rep.checks = {name: rep.checks[name] for name in CHECKS if name in rep.checks}
    return PreflightReport(hosts=hosts, socket_ifname=ifname)


def durable_check(spec: ClusterSpec, problem: Optional[str]) -> Check:
    """The checkpoint's durable dir on one host: it must exist and take a file, or the first save
    (or the background persist) fails mid-run."""
    where = spec.checkpoint_durable()
    if problem is None:
        return Check(True, "durable dir writable")
    inside = " (mount it into the container: container.mounts)" if spec.container is not None else ""
    fix = (f"create it on every host (a shared file system){inside}, or fix checkpoint.durable"
           if problem == "missing" else
           f"make it writable for the run's user{inside}, or point checkpoint.durable elsewhere")
    return Check(False, f"durable dir {where} {problem}", fix)


def _probed(spec: ClusterSpec, rep: HostReport, h: HostSpec) -> bool:
    """Whether the probe ran on the host (in its image); else the check that says why it did not."""
    f = rep.facts
    if "error" in f:  # the backend's message starts with the host, which the row names already
        seen = f["error"]
        if seen.startswith(f"{h.label} (") and "): " in seen:
            seen = seen.split("): ", 1)[1]
        elif seen.startswith(f"{h.label}: "):
            seen = seen.removeprefix(f"{h.label}: ")
        rep.checks["reach"] = Check(False, seen, f.get("fix") or REACH_FIX)
        return False
    rep.checks["reach"] = Check(True, "ok")
    if "image_error" in f:
        # a check written before the answer carried its problem: the image's
        problem = ImageProblem(f.get("image_problem", ImageProblem.NO_IMAGE))
        rep.checks["image"] = Check(False, f["image_error"], _image_fix(spec, problem))
        return False
    if "workdir_error" in f:  # a container binds it: nothing else was probed
        rep.checks["workdir"] = Check(False, f["workdir_error"], "create it or list the files under `sync:`")
        return False
    if spec.container is not None:
        rep.checks["image"] = Check(True, spec.container.image)
    if "exit" in f:
        py = host_python(spec, h)
        missing = f["exit"] == 127 or "No such file" in f.get("output", "")
        where = "the image has no such interpreter: set `python:` to the image's" if spec.container else \
            "install Python 3 there or set `python:` (or hosts[].python)"
        rep.checks["python"] = Check(False, f"{py}: " + ("not found" if missing else f["output"][-120:]), where)
        return False
    return True


def _image_fix(spec: ClusterSpec, problem: ImageProblem) -> str:
    """What to do about an image the probe could not run."""
    c = spec.container
    assert c is not None
    if problem is ImageProblem.NO_RUNTIME:
        return f"install {c.runtime} on the host"
    if RUNTIMES[c.runtime].named:
        return (f"{c.runtime} pull {c.image} on the host (or load it), or set container.pull: missing"
                if c.pull == "never" else f"check the image name and that the host can pull it ({c.runtime} pull {c.image})")
    return f"put {c.image} on the host (a shared file system), or use a docker:// image"


def _in_container(spec: ClusterSpec, rep: HostReport) -> None:
    """What only a container can get wrong: its /dev/shm, and workdir writable as its user."""
    f = rep.facts
    if f.get("workdir_ok") and f.get("workdir_writable") is False:
        rep.checks["workdir"] = Check(False, f"workdir {spec.workdir_path} not writable as uid {f.get('uid')} "
                                      "inside the image", "mount it writable, or make it writable for that user")
    shm = f.get("shm_bytes")
    if shm is None or shm >= MIN_SHM:
        rep.checks["shm"] = Check(True, f"{(shm or 0) / 2**30:.1f} GB" if shm else "unknown")
        return
    seen = f"/dev/shm is {shm / 2**20:.0f} MB inside the container"
    fix = "drop --shm-size/--ipc from container.options (host IPC is the default) or give --shm-size=8g"
    if spec.dist_backend == "nccl":
        rep.checks["shm"] = Check(False, seen + " (NCCL needs more)", fix)
    else:
        rep.checks["shm"] = Check(True, seen + " (fine for Gloo; NCCL and DataLoader workers need more)", fix,
                                  warn=True)


def _torch(f: HostFacts) -> Check:
    """torch there, and not older than the oldest the launch line works with."""
    torch = f.get("torch")
    if not torch:
        return Check(False, f.get("torch_error", "torch missing"),
                     f"pip install torch into {f.get('executable')} or point `python:` at a venv that has it")
    found = re.match(r"(\d+)\.(\d+)", torch)
    if found and (int(found.group(1)), int(found.group(2))) < MIN_TORCH:
        oldest = ".".join(map(str, MIN_TORCH))
        return Check(False, f"{torch} is older than {oldest}, the oldest ddplaunch launches with "
                            "(torchrun --signals-to-handle)",
                     f"pip install 'torch>={oldest}' into {f.get('executable')}")
    return Check(True, torch)


def _gpus(spec: ClusterSpec, rep: HostReport, host: HostSpec) -> None:
    f = rep.facts
    gpus = f.get("gpus")
    if gpus is None:
        rep.checks["gpus"] = Check(None, "not needed (gloo)")
        return
    nproc = spec.nproc_of(host)
    want = nproc if isinstance(nproc, int) else 1
    if gpus < want:
        key = "hosts[].nproc" if host.nproc is not None else "nproc_per_node"
        rep.checks["gpus"] = Check(False, f"{gpus} GPU(s) {f.get('gpu_error', '')}".strip(),
                                   f"{key} is {want}: lower it or fix the driver")
    elif f.get("gpu_procs"):
        rep.checks["gpus"] = Check(False, f"busy: {', '.join(f['gpu_procs'][:3])}",
                                   "end the processes holding the GPUs (nvidia-smi)")
    else:
        rep.checks["gpus"] = Check(True, f"{gpus} free")


def _network(spec: ClusterSpec, rep: HostReport, port: Optional[int]) -> None:
    f, master = rep.facts, master_addr(spec)
    ips = f.get("master_ips") or []
    if f.get("master_error") or not ips:
        rep.checks["master_dns"] = Check(False, f.get("master_error", "unresolved"),
                                         "use the master's IP in master.addr or fix /etc/hosts")
    elif any(ip.startswith("127.") for ip in ips) and len(spec.hosts) > 1:
        rep.checks["master_dns"] = Check(False, f"{master} -> {', '.join(ips)} (loopback: the 127.0.1.1 "
                                         "/etc/hosts trap)", "set master.addr to the cluster IP")
    else:
        rep.checks["master_dns"] = Check(True, ", ".join(ips))
    rep.checks["iface"] = (Check(True, f"{f['route_iface']} {f['route_ip']}") if f.get("route_iface")
                           else Check(False, f"no interface reaches {master}",
                                      "check routes; set socket_ifname"))
    if port is None:
        return
    busy, error = f.get("port_busy"), f.get("port_error")
    if busy:
        rep.checks["port"] = Check(False, f"{port} busy on the master: {busy}",
                                   "free it, or leave master.port unset so ddplaunch picks a free port")
    elif error:
        rep.checks["port"] = Check(False, error, "open the port range in the firewall between hosts")
    else:
        rep.checks["port"] = Check(True, f"reached {master}:{port}")


def _versions(hosts: list[HostReport]) -> None:
    """Python, torch, CUDA and NCCL must agree: the majority is right, the others are named."""
    probed = [h for h in hosts if h.facts.get("torch")]
    for rep in probed:
        rep.checks["versions"] = Check(True, "agree")
    for key in ("python", "torch", "cuda", "nccl"):
        values = [h.facts.get(key) for h in probed]
        if len(set(values)) <= 1:
            continue
        majority = max(sorted(set(values), key=str), key=values.count)  # a tie: the same pick every run
        table = ", ".join(f"{h.host}={h.facts.get(key)}" for h in probed)
        for rep in probed:
            if rep.facts.get(key) != majority:
                rep.checks["versions"] = Check(False, f"{key} {rep.facts.get(key)} vs {majority} ({table})",
                                               f"install {key} {majority} on {rep.host}")


def _agree_iface(spec: ClusterSpec, hosts: list[HostReport]) -> Optional[str]:
    """The one interface name every host reaches the master through (None if they differ)."""
    names = {h.facts.get("route_iface") for h in hosts if h.facts.get("route_iface")}
    if spec.socket_ifname or len(names) != 1 or len(spec.hosts) == 1:
        return None
    (name,) = names
    return None if name == "lo" or not IFNAME.fullmatch(str(name)) else name


def _behind_dead_jumps(bad: list[HostReport]) -> dict[str, list[str]]:
    """{a jump host's failure: the hosts that could not be reached through it}."""
    out: dict[str, list[str]] = {}
    for h in bad:
        reach = h.checks.get("reach")
        if reach is not None and reach.ok is False and h.facts.get("jump"):
            out.setdefault(reach.seen, []).append(h.host)
    return out


def render_table(report: PreflightReport) -> str:
    """One screen for any number of hosts: a verdict naming every check (within 80 columns), then
    only the hosts that failed, one line per failing check with its fix."""
    import textwrap

    names = [c for c in CHECKS if any(c in h.checks for h in report.hosts)]
    bad = [h for h in report.hosts if not h.ok]
    verdict = f"ok on {len(report.hosts)} host(s)" if report.ok else f"FAILED on {len(bad)} of {len(report.hosts)} host(s)"
    lines = textwrap.wrap(f"pre-flight: {verdict} in {report.elapsed_s:.1f}s; checks: " + " ".join(names), 80,
                          subsequent_indent="  ")
    behind = _behind_dead_jumps(bad)
    for seen, hosts in behind.items():  # a dead jump host: one line, not one per host behind it
        fix = next(c.fix for h in bad for n, c in h.failures() if n == "reach" and c.seen == seen)
        lines.append(f"{seen} (hosts behind it: {', '.join(hosts)}) -> fix: {fix}")
    for h in bad:  # one line each, whatever its length: it is the line people grep for
        for name, c in h.failures():
            if name == "reach" and c.seen in behind:
                continue
            where = h.host if h.addr == h.host else f"{h.host} ({h.addr})"
            lines.append(f"{where}: {name}: {c.seen} -> fix: {c.fix}")
    if bad and len(bad) < len(report.hosts):
        lines.append(f"  every check ok on the other {len(report.hosts) - len(bad)} host(s)")
    for h in report.hosts:
        for name, c in h.checks.items():
            if c.warn:
                lines.append(f"{h.host}: {name}: warning: {c.seen} -> fix: {c.fix}")
    if report.socket_ifname:
        lines.append(f"every host reaches the master through {report.socket_ifname}: using it for Gloo/NCCL")
    return "\n".join(lines)
