"""Pre-flight probe: facts about one host, printed as one JSON line.

A plain script (standard library only, torch is looked up, not imported) that backends run on
every host at once with `python -c SOURCE NONCE ARGS_JSON` (procs.py's source first); the answer
is the line `DDPLAUNCH_ANSWER_<nonce> {...}`, whatever the host's shell start-up prints around it. The master host's probe listens on the
master port while every host's probe connects to it, so one parallel round shows both that the
port is free and that every host reaches it over TCP.
"""

import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

try:
    from ddplaunch.hostside.procs import run_processes
except ImportError:  # sent to a host as one program: procs.py's source comes first
    pass

SIOCGIFADDR = 0x8915


def torch_facts() -> dict[str, Any]:
    """torch version, CUDA and NCCL versions without importing torch (that takes seconds). NCCL's
    package is looked up only for a CUDA build: importing importlib.metadata alone costs a CPU
    torch's host ~35 ms of the probe's ~100."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"torch": None, "torch_error": f"No module named 'torch' for {sys.executable}"}
    facts: dict[str, Any] = {"torch": None, "cuda": None, "nccl": None}
    version_file = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        scope: dict[str, Any] = {}
        with open(version_file) as f:
            exec(compile(f.read(), version_file, "exec"), scope)  # noqa: S102 - torch's own constants
        facts["torch"], facts["cuda"] = scope.get("__version__"), scope.get("cuda")
    except (OSError, SyntaxError, ImportError) as err:
        facts["torch_error"] = f"torch is broken: {err}"
    if facts["cuda"]:
        facts["nccl"] = nccl_version()
    return facts


def nccl_version() -> Any:
    """The version of the NCCL package pip installed beside a CUDA torch, or None."""
    import importlib.metadata

    for dist in ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_facts(need: bool) -> dict[str, Any]:
    if not need:
        return {"gpus": None, "gpu_procs": []}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"gpus": 0, "gpu_procs": [], "gpu_error": "nvidia-smi not found"}
    def query(args: list[str]) -> list[str]:
        out = subprocess.run([smi, *args, "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    try:
        return {"gpus": len(query(["--query-gpu=index"])),
                "gpu_procs": query(["--query-compute-apps=pid,process_name"])}
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"gpus": 0, "gpu_procs": [], "gpu_error": f"nvidia-smi failed: {err}"}


def leftovers(current_run: str) -> dict[str, list[int]]:
    """Other ddplaunch runs of this user still alive here: {run_id: [pids]} (see procs.py)."""
    found: dict[str, list[int]] = {}
    for pid, env in run_processes(None).items():
        rid = env[b"DDPLAUNCH_RUN_ID"].decode(errors="replace")
        if rid != current_run:
            found.setdefault(rid, []).append(pid)
    return found


def iface_of(ip: str) -> str | None:
    """The interface that holds `ip`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def network_facts(master: str, port: int | None) -> dict[str, Any]:
    facts: dict[str, Any] = {"master_ips": [], "route_ip": None, "route_iface": None}
    try:
        facts["master_ips"] = sorted({a[4][0] for a in socket.getaddrinfo(master, None, socket.AF_INET)})
    except OSError as err:
        facts["master_error"] = f"cannot resolve {master}: {err}"
        return facts
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((facts["master_ips"][0], port or 9))  # UDP: picks the route, sends nothing
            facts["route_ip"] = s.getsockname()[0]
        except OSError as err:
            facts["master_error"] = f"no route to {master}: {err}"
            return facts
    facts["route_iface"] = iface_of(facts["route_ip"])
    return facts


def listen(port: int, expect: int, deadline: float, out: dict[str, Any]) -> None:
    """Master side: bind the port, then accept until every host said hello or the deadline."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("", port))
    except OSError as err:
        out["port_busy"] = f"{err.strerror or err}"
        return
    srv.listen(64)
    out["port_busy"], out["peers_seen"] = None, []
    srv.settimeout(0.2)
    while time.time() < deadline and len(out["peers_seen"]) < expect:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        with conn:
            conn.settimeout(1)
            try:
                out["peers_seen"].append(conn.recv(256).decode(errors="replace"))
            except OSError:
                pass
    srv.close()


def connect(master: str, port: int, deadline: float, me: str) -> str | None:
    """Every host: reach master:port over TCP (retrying while the listener starts)."""
    last = None
    while time.time() < deadline:
        try:
            with socket.create_connection((master, port), timeout=1) as c:
                c.sendall(me.encode())
                return None
        except OSError as err:
            last = err
            time.sleep(0.1)
    return f"cannot reach {master}:{port} over TCP: {getattr(last, 'strerror', None) or last}"


def durable_problem(path: str) -> str | None:
    """Why the checkpoint's durable dir cannot take a save here (None: it can): missing, not a
    directory, or a file cannot be created in it (tried: permissions, a read-only or full mount)."""
    if not os.path.exists(path):
        return "missing"
    if not os.path.isdir(path):
        return "not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ddplaunch-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"not writable ({err.strerror or err})"
    return None


def main() -> None:
    nonce, args = sys.argv[1], json.loads(sys.argv[2])
    out: dict[str, Any] = {"hostname": socket.gethostname(), "python": sys.version.split()[0],
                           "executable": sys.executable}
    out["time"] = time.time()  # first: what the launcher compares its own clock with
    threads = []
    if args.get("port"):
        # the port test first, beside the other facts: a loaded master must not miss the others
        deadline = time.time() + args.get("probe_s", 4)
        if args.get("listen"):
            threads.append(threading.Thread(target=listen, args=(args["port"], args["expect"], deadline, out)))

        def reach() -> None:
            out["port_error"] = connect(args["master"], args["port"], deadline, args["label"])
        threads.append(threading.Thread(target=reach))
        for t in threads:
            t.start()
    out.update(torch_facts())
    out.update(gpu_facts(args.get("need_gpus")))
    out["leftovers"] = leftovers(args["run_id"])
    out.update(network_facts(args["master"], args.get("port")))
    workdir = args["workdir"]
    out["workdir_ok"] = os.path.isdir(workdir)
    # script None: a shipped example, staged with the run (not looked for in workdir)
    out["script_ok"] = out["workdir_ok"] and (args["script"] is None
                                              or os.path.isfile(os.path.join(workdir, args["script"])))
    out["disk_free_gb"] = shutil.disk_usage(workdir if out["workdir_ok"] else "/").free / 1e9
    out["workdir_writable"] = out["workdir_ok"] and os.access(workdir, os.W_OK)
    out["uid"] = os.getuid()
    if args.get("durable"):
        out["durable_problem"] = durable_problem(args["durable"])
    try:  # what NCCL and DataLoader workers share memory through (a container's may be tiny)
        shm = os.statvfs("/dev/shm")
        out["shm_bytes"] = shm.f_blocks * shm.f_frsize
    except OSError:
        out["shm_bytes"] = None
    for t in threads:
        t.join()
    print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps(out, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
