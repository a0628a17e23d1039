"""1,000 SSH connections held by one process, side by side in one run: paramiko's threads (as
ddplaunch holds them) vs asyncssh's one event loop vs OpenSSH clients (a process each, as pdsh).

A run holds a session to every host for its whole length, each carrying the host's heartbeat and
its agent's few lines. This bench holds N such sessions to one throwaway sshd on 127.0.0.1 (its
own host key, verified by every client; `SetEnv HOME` keeps root's rc files out of its shells),
each running a loop that prints a line a second, and measures each client in a process of its own:

  paramiko        ddplaunch's way: a paramiko transport thread and a reader thread per host, the
                  transport's socket waking each second (connect.TRANSPORT_WAKE_S)
  paramiko-0.1s   the same with paramiko's own wake (0.1 s)
  asyncssh        one asyncio event loop, a task per session (asyncssh, `pip install asyncssh`)
  openssh         an `ssh` process per host, their output read by one thread with selectors

Figures per client: seconds to open all N (64 at a time, as ddplaunch's fan-out), threads (or
processes), memory (PSS of the client and its `ssh` children), CPU cores while the N sessions
carry their lines for `--idle` seconds, and the lines that arrived of those sent (nothing lost).
Needs root (sshd); ends only the processes it started, by PID.
Usage: .venv/bin/python bench/connections.py [--n 1000] [--idle 30] [--clients paramiko,paramiko-0.1s,asyncssh,openssh]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.sim.sshd import loopback_sshd  # noqa: E402

#: What each session runs: a line a second (the host's heartbeat), bash builtins only.
LOOP = "while :; do echo hb; read -t 1; done"
PARALLEL = 64  # sessions opened at once (ddplaunch's MAX_PARALLEL)
CLIENTS = ("paramiko", "paramiko-0.1s", "asyncssh", "openssh")


def pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:")), 0)


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))


class Count:
    def __init__(self) -> None:
        self.lines, self.lock = 0, threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.lines += n


def hold_paramiko(args: argparse.Namespace, d: Path, wake: float | None) -> dict[str, Any]:
    import paramiko
    count, held = Count(), []

    def one(_: int) -> Any:
        client = paramiko.SSHClient()
        client.load_host_keys(str(d / "known_hosts"))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect("127.0.0.1", port=args.port, username="root", key_filename=str(d / "client_key"),
                       look_for_keys=False, allow_agent=False, timeout=30, banner_timeout=30, auth_timeout=30)
        transport = client.get_transport()
        assert transport is not None
        if wake is not None:
            transport.sock.settimeout(wake)
        channel = transport.open_session()
        channel.exec_command(LOOP)
        channel.recv(64)  # its first line: the session runs

        def read() -> None:  # a reader thread per host, as ddplaunch's stage pump
            while True:
                data = channel.recv(4096)
                if not data:
                    return
                count.add(data.count(b"\n"))
        threading.Thread(target=read, daemon=True).start()
        return client

    t0 = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        held = list(pool.map(one, range(args.n)))
    opened = time.monotonic() - t0
    out = idle(args, count, [os.getpid()])
    for client in held:
        client.close()
    return {"open_s": opened, **out}


def hold_asyncssh(args: argparse.Namespace, d: Path) -> dict[str, Any]:
    import asyncssh
    count = Count()
    result: dict[str, Any] = {}

    async def main() -> None:
        gate = asyncio.Semaphore(PARALLEL)

        async def one() -> Any:
            async with gate:
                conn = await asyncssh.connect("127.0.0.1", port=args.port, username="root",
                                              client_keys=[str(d / "client_key")], known_hosts=str(d / "known_hosts"),
                                              connect_timeout=30)
                proc = await conn.create_process(LOOP)
                await proc.stdout.readline()

            async def read() -> None:
                async for _ in proc.stdout:
                    count.lines += 1
            asyncio.ensure_future(read())
            return conn

        t0 = time.monotonic()
        conns = await asyncio.gather(*(one() for _ in range(args.n)))
        result["open_s"] = time.monotonic() - t0
        result.update(await asyncio.get_running_loop().run_in_executor(None, idle, args, count, [os.getpid()]))
        for conn in conns:
            conn.close()

    asyncio.run(main())
    return result


def hold_openssh(args: argparse.Namespace, d: Path) -> dict[str, Any]:
    count, procs = Count(), []
    cmd = ["ssh", "-T", "-p", str(args.port), "-i", str(d / "client_key"), "-o", f"UserKnownHostsFile={d}/known_hosts",
           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "root@127.0.0.1", LOOP]

    def one(_: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()
        return proc

    t0 = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        procs = list(pool.map(one, range(args.n)))
    opened = time.monotonic() - t0
    sel = selectors.DefaultSelector()
    for proc in procs:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        sel.register(proc.stdout, selectors.EVENT_READ)
    stop = threading.Event()

    def pump() -> None:  # one thread reads every client's output
        while not stop.is_set():
            for key, _ in sel.select(0.5):
                data = os.read(key.fd, 65536)
                count.add(data.count(b"\n"))
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    out = idle(args, count, [os.getpid(), *(p.pid for p in procs)])
    stop.set()
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)
    return {"open_s": opened, **out}


def idle(args: argparse.Namespace, count: Count, pids: list[int]) -> dict[str, Any]:
    """The sessions carry their lines for args.idle seconds: CPU, threads, memory, lines."""
    time.sleep(2)  # the first lines drained
    c0, n0, t0 = sum(cpu_s(p) for p in pids), count.lines, time.monotonic()
    time.sleep(args.idle)
    took = time.monotonic() - t0
    return {"cores": (sum(cpu_s(p) for p in pids) - c0) / took, "threads": threads(), "processes": len(pids),
            "pss_mib": sum(pss_kib(p) for p in pids) / 1024, "lines": count.lines - n0, "sent": int(args.n * took)}


def child(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    d = Path(args.dir)
    if args.child == "paramiko":
        from ddplaunch.backends.ssh.connect import TRANSPORT_WAKE_S
        out = hold_paramiko(args, d, TRANSPORT_WAKE_S)
    elif args.child == "paramiko-0.1s":
        out = hold_paramiko(args, d, None)
    elif args.child == "asyncssh":
        out = hold_asyncssh(args, d)
    else:
        out = hold_openssh(args, d)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--idle", type=float, default=30)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if os.geteuid() != 0:
        sys.exit("needs root (a throwaway sshd)")
    d = Path(tempfile.mkdtemp(prefix="ddpl-bench-conn-"))
    (d / "home").mkdir()
    rows = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, d, ignore_errors=True)
        port, host_pub = cleanup.enter_context(loopback_sshd(d, extra=["MaxStartups 200:30:400",
                                                                       f"SetEnv HOME={d}/home"]))
        key = host_pub.read_text().split()
        (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {key[0]} {key[1]}\n")
        for name in args.clients.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", name, "--n", str(args.n), "--idle",
                                   str(args.idle), "--port", str(port), "--dir", str(d)],
                                  capture_output=True, text=True, timeout=1800)
            got = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if not got:
                print(f"{name}: failed (exit {proc.returncode}): {proc.stderr[-1500:]}", flush=True)
                continue
            rows.append({"client": name, **json.loads(got[0][7:])})
            print(f"{name}: {rows[-1]}", flush=True)
    print(f"\n{args.n} sessions to one sshd on 127.0.0.1, a line a second each, held {args.idle:.0f} s\n")
    print("| client | open all (s) | threads / processes | memory (PSS, MiB) | CPU while held (cores) | lines arrived / sent |")
    print("|---|---:|---|---:|---:|---|")
    for r in rows:
        procs = f"{r['threads']} threads" + (f", {r['processes']} processes" if r["processes"] > 1 else "")
        print(f"| {r['client']} | {r['open_s']:.1f} | {procs} | {r['pss_mib']:.0f} | {r['cores']:.3f} | "
              f"{r['lines']} / {r['sent']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
