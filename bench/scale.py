"""Launch latency at 8 / 16 / 32 hosts and pre-flight fan-out at 128 hosts, side by side in one run.

Builds one `ddplaunch sim` cluster (prefix dsc, 10.213.50.0/24, 1 process per host) and, for every
size, runs the three launchers interleaved (A B C A B C ...) on the first N hosts, each time with
jobs/toy_ddp.py, timing from the launcher's start until every rank's `updated_weight=` line arrived:

  ddplaunch  `ddplaunch up SPEC`: pre-flight, then one torchrun per host whose worker runs the
             health check and then the job (the sim's spec, nproc_per_node 1)
  hand       `pdsh -R ssh -f N -w HOSTS 'cd W && exec env GLOO_SOCKET_IFNAME=.. python -m
             torch.distributed.run --nnodes N --node-rank %n ... jobs/toy_ddp.py'`, the sim's client
             key and known_hosts in PDSH_SSH_ARGS: what a user types by hand
  deepspeed  `deepspeed --hostfile H --launcher pdsh --no_ssh_check --master_addr A ...` (DeepSpeed's
             pdsh multinode runner; `pip install -e .[bench]`)

Then, at 128 hosts, the pre-flight probe (ddplaunch's run_preflight over its SSH backend, the
function `up` and `check` call) beside `pdsh -f 128` running the same probe program on every host.
For every run: wall time, the launcher's CPU seconds (launcher process and every local child it
waited for: pdsh's ssh clients, DeepSpeed's pdsh) per host, peak RSS of the launcher's process tree,
and peak machine-wide memory in use (MemTotal - MemAvailable, i.e. what `free` calls used, with
whatever else the machine runs). Prints markdown tables; `--plot PNG` draws time vs hosts.

Needs root (network namespaces). Tears its sim down at the end. 32 hosts are skipped when the
memory left would not hold them (every host runs a torchrun agent and a worker, each importing torch).
Usage: .venv/bin/python bench/scale.py [--sizes 8,16,32] [--repeats 2] [--repeats-large 1]
       [--launchers ddplaunch,hand,deepspeed] [--with-skip] [--rdzv-hosts 32] [--probe-hosts 128]
       [--probe-repeats 3] [--merge-json earlier.json] [--plot docs/scale.png] [--json out.json]
(docs/scaling.md has the two command lines behind its figures.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX, SUBNET = "dsc", "10.213.50.0/24"
LAUNCHERS = ["ddplaunch", "hand", "deepspeed"]   # the three compared; the default of --launchers
#: optional rows: `ddplaunch up --skip-healthcheck`, `ddplaunch up` with `preflight.enabled: false`,
#: and `ddplaunch up` of an earlier commit (`--baseline REV`, run from a git worktree of it)
EXTRA = ["ddplaunch-skiphc", "ddplaunch-nopf", "ddplaunch-base"]
ALL_NAMES = LAUNCHERS + EXTRA
RDZV_TIMEOUT = 120     # every launcher's rendezvous limit; it bounds a failure, it does not pace a run
RUN_TIMEOUT = 420


# ----------------------------------------------------------------------------- measuring one launch

def mem_used_mib() -> float:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat: all but idle and
    iowait): the sim's hosts share this machine, so a launch's delta is what it cost them all."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_rss_mib(pid: int) -> float:
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def own_leftovers(marker: str) -> list[int]:
    """PIDs (not ours) whose command line holds `marker` (a run's unique port), or whose environment
    has MASTER_PORT=<that port> (the workers torchrun and DeepSpeed's launch.py start)."""
    port = marker.rsplit(" ", 1)[-1].rsplit("=", 1)[-1]
    env_mark = f"MASTER_PORT={port}".encode() if port.isdigit() else None
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and "bench/scale.py" not in cmd:
            pids.append(int(d.name))
        elif env_mark and "python" in cmd:
            try:
                if env_mark + b"\0" in (d / "environ").read_bytes() + b"\0" and "bench/scale.py" not in cmd:
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def launch(argv: list[str], env: dict, want: int, marker: str, timeout: float = RUN_TIMEOUT,
           result_line: str = "updated_weight=", cwd: Path = ROOT) -> dict:
    """Run a launcher; time until `want` lines holding `result_line` arrived, and until it exits."""
    mem0, load0, cpu0 = mem_used_mib(), os.getloadavg()[0], machine_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
    out: list[str] = []
    stamps: list[tuple[float, str]] = []
    state = {"results": 0, "t_results": None, "peak_rss": 0.0, "peak_used": mem0}
    done = threading.Event()

    def reader():
        for line in proc.stdout:
            out.append(line)
            stamps.append((time.perf_counter() - t0, line))
            if result_line in line:
                state["results"] += 1
                if state["results"] == want:
                    state["t_results"] = time.perf_counter() - t0

    def sampler():
        while not done.is_set():
            state["peak_rss"] = max(state["peak_rss"], tree_rss_mib(proc.pid))
            state["peak_used"] = max(state["peak_used"], mem_used_mib())
            done.wait(0.25)

    threads = [threading.Thread(target=reader, daemon=True), threading.Thread(target=sampler, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    status, usage, timed_out = None, None, False
    while status is None:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, usage = os.waitstatus_to_exitcode(st), ru
            break
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(proc.pid, 9)   # SIGKILL: DeepSpeed's SIGTERM handler would `pkill -f` on every host
            _, st, ru = os.wait4(proc.pid, 0)
            status, usage = os.waitstatus_to_exitcode(st), ru
            break
        time.sleep(0.05)
    proc.returncode = status
    t_exit = time.perf_counter() - t0
    done.set()
    threads[0].join(timeout=10)
    # pdsh and DeepSpeed leave nothing behind on success; after a failure their remote torchruns
    # can outlive the launcher (no pty): end those of this run, found by its unique port
    time.sleep(0.5)
    left = own_leftovers(marker)
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    ok = status == 0 and state["results"] >= want and not timed_out
    return {"ok": ok, "rc": status, "timed_out": timed_out, "t_results": state["t_results"], "t_exit": t_exit,
            "results": state["results"], "cpu_s": usage.ru_utime + usage.ru_stime,
            "machine_cpu_s": machine_cpu_s() - cpu0,
            "peak_rss_mib": state["peak_rss"], "peak_used_mib": state["peak_used"], "used_before_mib": mem0, "load1": load0,
            "leftovers_killed": len(left), "tail": ("".join([ln for ln in out if "Error" in ln or "error:" in ln][:8]) + "".join(out[-25:])) if not ok else "",
            "last_line": out[-1].strip() if out else "", "stamps": stamps}


# ----------------------------------------------------------------------------- the three launchers

def subset_spec(full: Path, n: int, dest: Path) -> Path:
    """The sim's spec with its first n hosts (and a rendezvous limit that a loaded machine meets)."""
    lines, k = [], 0
    for line in full.read_text().splitlines():
        if line.startswith("  - {addr:"):
            k += 1
            if k > n:
                continue
        if line.startswith("rdzv_timeout:"):
            line = f"rdzv_timeout: {RDZV_TIMEOUT}"
        lines.append(line)
    dest.write_text("\n".join(lines) + "\n")
    return dest


def fits(results: dict, n: int, name: str, skipped: list[str]) -> bool:
    """Will `name` at n hosts fit in memory? Scales its peak use at the largest smaller size measured
    (every host runs a torchrun agent or DeepSpeed's launch.py and a worker, each importing torch)."""
    smaller = [m for m in results if m < n and results[m].get(name)]
    if not smaller:
        return True
    m = max(smaller)
    per_host = max((r["peak_used_mib"] - r["used_before_mib"]) / m for r in results[m][name])
    need = per_host * n * 1.2
    avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20 - mem_used_mib()
    if need > avail:
        skipped.append(f"{name} at {n} hosts: needs ~{need / 1024:.1f} GiB (x1.2 of {per_host:.0f} MiB/host "
                       f"measured at {m}), {avail / 1024:.1f} GiB available")
        print(f"skip: {skipped[-1]}", flush=True)
        return False
    return True


def spec_hosts(spec: Path) -> list[str]:
    return [line for line in spec.read_text().splitlines() if line.startswith("  - {addr:")]


def free_port() -> int:
    return random.randint(20000, 39999)


def pdsh_env(cluster, base_env: dict) -> dict:
    ssh_args = (f"-i {cluster.key} -o UserKnownHostsFile={cluster.known_hosts} -o StrictHostKeyChecking=yes "
                "-o BatchMode=yes -o LogLevel=ERROR -l root %h")
    return dict(base_env, PDSH_SSH_ARGS=ssh_args, PDSH_RCMD_TYPE="ssh")


def argv_ddplaunch(spec: Path, port: int, skip_hc: bool = False) -> list[str]:
    # ddplaunch picks its own fresh master port; `port` only names leftovers (none expected: pty)
    return [sys.executable, "-m", "ddplaunch", "up", str(spec)] + (["--skip-healthcheck"] if skip_hc else [])


def argv_hand(cluster, n: int, port: int, python: str) -> list[str]:
    addrs = [h.addr for h in cluster.hosts[:n]]
    remote = (f"cd {shlex.quote(str(ROOT))} && exec env GLOO_SOCKET_IFNAME={cluster.ifname} {python} -m "
              f"torch.distributed.run --nnodes {n} --node-rank %n --nproc-per-node 1 --master-addr {addrs[0]} "
              f"--master-port {port} --rdzv-conf timeout={RDZV_TIMEOUT} jobs/toy_ddp.py")
    return ["pdsh", "-R", "ssh", "-f", str(n), "-w", ",".join(addrs), remote]


def argv_deepspeed(cluster, n: int, port: int, work: Path) -> list[str]:
    hostfile = work / f"hostfile{n}"
    hostfile.write_text("".join(f"{h.addr} slots=1\n" for h in cluster.hosts[:n]))
    ds = Path(sys.executable).with_name("deepspeed")
    return [sys.executable, str(ds), "--hostfile", str(hostfile), "--launcher", "pdsh", "--no_ssh_check",
            "--master_addr", cluster.hosts[0].addr, "--master_port", str(port), "jobs/toy_ddp.py"]


# ----------------------------------------------------------------------------- pre-flight fan-out

def preflight_only(spec_path: str, port: int) -> None:
    """Child mode: ddplaunch's pre-flight (the function `up` and `check` run) once; JSON on stdout."""
    from ddplaunch.backends.ssh import SshBackend
    from ddplaunch.diagnose.preflight import run_preflight
    from ddplaunch.spec.load import load_spec
    spec = load_spec(spec_path)
    backend = SshBackend(spec)
    try:
        report = run_preflight(spec, backend, f"scale-bench-{port}", port)
    finally:
        backend.close()
    print(json.dumps({"elapsed_s": report.elapsed_s, "ok": report.ok, "bad_hosts": report.bad_hosts}))


def pdsh_probe_argv(spec_path: Path, port: int, work: Path, cluster) -> tuple[list[str], str]:
    """pdsh running ddplaunch's probe program (from a file) on every host: master args on %n=0."""
    from ddplaunch.plan.hostprogram import program_source
    from ddplaunch.plan.launch import host_python
    from ddplaunch.diagnose.preflight import probe_command
    from ddplaunch.spec.load import load_spec
    spec = load_spec(spec_path)
    src = work / "probe_src.py"
    src.write_text(program_source("probe"))
    args = {}
    for i, host in ((0, spec.hosts[0]), (1, spec.hosts[1])):
        line, nonce = probe_command(spec, host, f"scale-bench-{port}", port, parallel=len(spec.hosts))
        words = shlex.split(line)
        (work / f"probe_args{i}.json").write_text(words[-1])
        args[i] = nonce
    py = host_python(spec, spec.hosts[0])
    remote = (f"if [ %n -eq 0 ]; then A=0; else A=1; fi; exec {py} {src} {args[0]} "
              f"\"$(cat {work}/probe_args$A.json)\"")
    addrs = ",".join(h.addr for h in spec.hosts)
    return ["pdsh", "-R", "ssh", "-f", str(len(spec.hosts)), "-w", addrs, remote], args[0]


# ----------------------------------------------------------------------------- rendezvous and TCPStore

def rdzv_probe(cluster, n: int, env_pdsh: dict, python: str) -> dict:
    """A hand launch (pdsh + torchrun, LOGLEVEL=INFO) on n hosts, every line time-stamped on arrival,
    while `ss` in the master host's namespace counts established connections to the master port
    (the TCPStore that rank 0's torchrun agent serves to every agent and worker)."""
    port = free_port()
    argv = argv_hand(cluster, n, port, python)
    argv[-1] = argv[-1].replace("exec env ", "exec env LOGLEVEL=INFO ")
    ns = cluster.hosts[0].ns
    peak = {"conns": 0, "peers": 0}
    stop = threading.Event()

    def count():
        while not stop.is_set():
            res = subprocess.run(["ss", "-N", ns, "-Htn", "state", "established", f"( sport = :{port} )"],
                                 capture_output=True, text=True)
            lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
            peers = {ln.split()[-1].rsplit(":", 1)[0] for ln in lines}
            peak["conns"], peak["peers"] = max(peak["conns"], len(lines)), max(peak["peers"], len(peers))
            stop.wait(0.1)

    th = threading.Thread(target=count, daemon=True)
    th.start()
    r = launch(argv, env_pdsh, n, marker=f"--master-port {port}", timeout=240)
    stop.set()
    th.join()

    def nth(phrase: str, k: int):
        hits = [t for t, line in r["stamps"] if phrase in line]
        return hits[k - 1] if len(hits) >= k else None
    return {"ok": r["ok"], "hosts": n, "t_agent_first": nth("Starting elastic_operator", 1),
            "t_agent_last": nth("Starting elastic_operator", n), "t_rdzv_last": nth("Rendezvous complete", n),
            "t_pg_first": nth("local_grad=", 1), "t_pg_last": nth("local_grad=", n), "t_results": r["t_results"],
            "peak_store_conns": peak["conns"], "peak_store_peers": peak["peers"], "cpu_s": r["cpu_s"]}


# ----------------------------------------------------------------------------- tables

def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    labels = {"ddplaunch": "ddplaunch up (pre-flight + health check + job)",
              "hand": "hand launch: pdsh + torchrun", "deepspeed": "deepspeed --launcher pdsh",
              "ddplaunch-skiphc": "ddplaunch up --skip-healthcheck",
              "ddplaunch-nopf": "ddplaunch up, pre-flight off"}
    for name, marker in zip(ALL_NAMES, "os^xd"):
        xs, ys, lo, hi = [], [], [], []
        for n in sorted(results):
            ts = [r["t_results"] for r in results[n].get(name, []) if r["ok"]]
            if ts:
                xs.append(n)
                ys.append(statistics.median(ts))
                lo.append(ys[-1] - min(ts))
                hi.append(max(ts) - ys[-1])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, capsize=3, label=labels[name])
    ax.set_xlabel("sim hosts (1 process each)")
    ax.set_ylabel("launch to every rank's result, s")
    ax.set_xticks(sorted(results))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"jobs/toy_ddp.py, {os.cpu_count()} shared cores (median, min-max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds per size below 32")
    ap.add_argument("--repeats-large", type=int, default=1, help="rounds at 32 hosts and more")
    ap.add_argument("--probe-hosts", type=int, default=128)
    ap.add_argument("--probe-repeats", type=int, default=3)
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help=f"comma list of {ALL_NAMES}")
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also `ddplaunch up` of git commit REV (a worktree of it, run with this python)")
    ap.add_argument("--with-skip", action="store_true",
                    help="also `ddplaunch up --skip-healthcheck` (splits ddplaunch's time: health check vs rest)")
    ap.add_argument("--rdzv-hosts", default="",
                    help="comma list: hand launches with torchrun's INFO log time-stamped and the master's "
                         "TCPStore connections counted (rendezvous timing)")
    ap.add_argument("--merge-json", type=Path, default=None,
                    help="an earlier run's --json: its launch rows join this run's tables and plot")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--preflight-only", nargs=2, metavar=("SPEC", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.preflight_only:
        preflight_only(args.preflight_only[0], int(args.preflight_only[1]))
        return

    from ddplaunch.sim import SimConfig, sim_down, sim_up
    for tool in ("pdsh",):
        if not shutil.which(tool):
            sys.exit(f"{tool} missing: apt-get install -y pdsh")
    if "deepspeed" in args.launchers.split(",") and not Path(sys.executable).with_name("deepspeed").exists():
        sys.exit("deepspeed missing: pip install -e .[bench] (see pyproject's bench extra), or leave it out of "
                 "--launchers")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rdzv_sizes = [int(s) for s in args.rdzv_hosts.split(",") if s]
    chosen = [x for x in args.launchers.split(",") if x]
    if args.with_skip:
        chosen.append("ddplaunch-skiphc")
    if args.baseline:
        chosen.append("ddplaunch-base")
    unknown = set(chosen) - set(ALL_NAMES)
    if unknown:
        sys.exit(f"unknown launcher(s) {sorted(unknown)}: choose from {ALL_NAMES}")
    n_sim = max(sizes + rdzv_sizes + [args.probe_hosts])
    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-scale-"))
    state = work / "sim"
    t_start = time.perf_counter()
    cluster = sim_up(SimConfig(n_hosts=n_sim, prefix=PREFIX, subnet=SUBNET, state_dir=state, nproc_per_node=1,
                               workdir=ROOT))
    base_env = dict(os.environ, DDPLAUNCH_HOME=str(work / "home"), PYTHONUNBUFFERED="1")
    baseline = work / "baseline"
    if args.baseline:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline],
                       check=True, capture_output=True)
    env_base = dict(base_env, PYTHONPATH=str(baseline), DDPLAUNCH_HOME=str(work / "home-base"))
    env_pdsh = pdsh_env(cluster, base_env)
    (work / "ds_env").write_text(f"GLOO_SOCKET_IFNAME={cluster.ifname}\n")
    env_ds = dict(env_pdsh, DS_ENV_FILE=str(work / "ds_env"))
    python = shlex.quote(sys.executable)
    results: dict[int, dict[str, list[dict]]] = {}
    rdzv: list[dict] = []
    if args.merge_json:
        results = {int(k): v for k, v in json.loads(args.merge_json.read_text())["launch"].items()}
    skipped: list[str] = []
    try:
        for n in sizes:
            reps = args.repeats if n < 32 else args.repeats_large
            spec = subset_spec(cluster.spec_path, n, work / f"spec{n}.yaml")
            spec_nopf = work / f"spec{n}-nopf.yaml"
            spec_nopf.write_text(spec.read_text() + "preflight:\n  enabled: false\n")
            results.setdefault(n, {})
            for name in chosen:
                results[n].setdefault(name, [])
            runnable = [name for name in chosen if fits(results, n, name, skipped)]
            for rep in range(reps):
                order = runnable if rep % 2 == 0 else list(reversed(runnable))
                for name in order:
                    port = free_port()
                    if name == "ddplaunch-base":
                        r = launch(argv_ddplaunch(spec, port), env_base, n, marker=str(spec), cwd=baseline)
                    elif name.startswith("ddplaunch"):
                        r = launch(argv_ddplaunch(spec_nopf if name == "ddplaunch-nopf" else spec, port,
                                                  name == "ddplaunch-skiphc"), base_env, n, marker=str(spec))
                    elif name == "hand":
                        r = launch(argv_hand(cluster, n, port, python), env_pdsh, n, marker=f"--master-port {port}")
                    else:
                        r = launch(argv_deepspeed(cluster, n, port, work), env_ds, n, marker=f"--master_port={port}")
                    results[n][name].append(r)
                    print(f"{n:>3} hosts {name:<9} rep {rep}: ok={r['ok']} results {r['results']}/{n} "
                          f"t_results={r['t_results'] or float('nan'):.1f}s exit={r['t_exit']:.1f}s "
                          f"cpu={r['cpu_s']:.2f}s rss={r['peak_rss_mib']:.0f}MiB used={r['peak_used_mib']:.0f}MiB "
                          f"load1={r['load1']:.1f}",
                          flush=True)
                    if not r["ok"]:
                        print(r["tail"], flush=True)
                    time.sleep(2)   # let the previous run's processes go before the next one starts

        for n in rdzv_sizes:
            rdzv.append(rdzv_probe(cluster, n, env_pdsh, python))
            print(f"rdzv {n} hosts: {rdzv[-1]}", flush=True)
            time.sleep(2)

        # -------- pre-flight fan-out at probe_hosts
        probe = {"ddplaunch": [], "pdsh": []}
        if args.probe_hosts:
            spec = subset_spec(cluster.spec_path, args.probe_hosts, work / f"spec{args.probe_hosts}.yaml")
            for rep in range(args.probe_repeats):
                for name in (("ddplaunch", "pdsh") if rep % 2 == 0 else ("pdsh", "ddplaunch")):
                    port = free_port()
                    if name == "ddplaunch":
                        r = launch([sys.executable, str(Path(__file__).resolve()), "--preflight-only", str(spec),
                                    str(port)], base_env, 0, marker=f"scale-bench-{port}", timeout=120)
                        try:
                            pf = json.loads(r["last_line"])
                            r["preflight_s"], r["answers"] = pf["elapsed_s"], len(spec_hosts(spec)) - len(pf["bad_hosts"])
                            r["ok"] = r["ok"] and pf["ok"]
                        except (ValueError, KeyError):
                            r["ok"] = False
                    else:
                        argv, nonce = pdsh_probe_argv(spec, port, work, cluster)
                        r = launch(argv, env_pdsh, args.probe_hosts, marker=f"scale-bench-{port}", timeout=120,
                                   result_line=f"DDPLAUNCH_ANSWER_{nonce}")
                        r["answers"] = r["results"]
                    probe[name].append(r)
                    print(f"probe {args.probe_hosts} hosts {name:<9} rep {rep}: ok={r['ok']} answers={r.get('answers')} "
                          f"preflight_s={r.get('preflight_s')} rc={r['rc']} wall={r['t_exit']:.2f}s "
                          f"cpu={r['cpu_s']:.2f}s rss={r['peak_rss_mib']:.0f}MiB", flush=True)
                    time.sleep(1)
    finally:
        sim_down(state, prefix=PREFIX, purge=True)
        if args.baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)],
                           capture_output=True)
    total = time.perf_counter() - t_start

    # -------- tables
    print()
    print("### Launch to every rank's `updated_weight=` line (median s; min-max)\n")
    names = [x for x in ALL_NAMES if any(by.get(x) for by in results.values())]
    for by in results.values():
        for name in names:
            by.setdefault(name, [])
    rows = []
    for n in sorted(results):
        r = results[n]
        cells = [str(n)]
        for name in names:
            ts = [x["t_results"] for x in r[name] if x["ok"]]
            bad = sum(not x["ok"] for x in r[name])
            cell = (f"{statistics.median(ts):.1f} ({min(ts):.1f}-{max(ts):.1f})" if ts
                    else f"failed ({len(r[name])}/{len(r[name])})" if r[name] else "-")
            cells.append(cell + (f", {bad} failed" if bad and ts else ""))
        d, h, s, nopf, base = (med([x for x in r[k] if x["ok"]], "t_results") if k in r else float("nan")
                               for k in ("ddplaunch", "hand", "deepspeed", "ddplaunch-nopf", "ddplaunch-base"))
        ratio = lambda a, b: "-" if a != a or b != b else f"**{a / b:.2f}**"  # noqa: E731 (nan: no run)
        cells += [ratio(d, h), ratio(d, s)] + ([ratio(nopf, h)] if "ddplaunch-nopf" in names else []) \
            + ([ratio(base, h), ratio(d, base)] if "ddplaunch-base" in names else [])
        rows.append(cells)
    heads = {"ddplaunch": "ddplaunch up", "hand": "hand (pdsh + torchrun)", "deepspeed": "deepspeed (pdsh)",
             "ddplaunch-skiphc": "ddplaunch up --skip-healthcheck", "ddplaunch-nopf": "ddplaunch up, pre-flight off",
             "ddplaunch-base": f"ddplaunch up at {args.baseline}"}
    print(fmt_table(["hosts"] + [heads[x] for x in names] + ["ddplaunch / hand", "ddplaunch / deepspeed"]
                    + (["pre-flight off / hand"] if "ddplaunch-nopf" in names else [])
                    + ([f"{args.baseline} / hand", f"ddplaunch / {args.baseline}"] if "ddplaunch-base" in names
                       else []), rows))
    print("\n### Launcher cost (median): CPU seconds of the launcher and its local children, per host; "
          "the whole machine's CPU seconds during the launch (every sim host's processes too); "
          "peak RSS of the launcher's process tree; peak machine memory in use (`free` used)\n")
    rows = []
    for n in sorted(results):
        for name in names:
            rs = results[n][name]
            if not rs:
                continue
            rows.append([str(n), name, f"{med(rs, 'cpu_s'):.2f}", f"{med(rs, 'cpu_s') / n * 1000:.0f}",
                         f"{med(rs, 'machine_cpu_s'):.1f}" if all("machine_cpu_s" in x for x in rs) else "-",
                         f"{med(rs, 'peak_rss_mib'):.0f}", f"{max(x['peak_used_mib'] for x in rs) / 1024:.1f}",
                         f"{max(x['peak_used_mib'] - x['used_before_mib'] for x in rs) / 1024:.1f}"])
    print(fmt_table(["hosts", "launcher", "CPU s", "CPU ms / host", "machine CPU s", "launcher tree RSS MiB",
                     "peak used GiB", "peak used - before GiB"], rows))
    if any(probe.values()):
        print(f"\n### Pre-flight probe on {args.probe_hosts} hosts (median of {args.probe_repeats}; min-max)\n")
        rows = []
        for name, label in (("ddplaunch", "ddplaunch pre-flight (SshBackend, 64 threads), process wall"),
                            ("pdsh", f"pdsh -f {args.probe_hosts}, same probe program")):
            rs = probe[name]
            ts = [x["t_exit"] for x in rs]
            rows.append([label, f"{statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})",
                         f"{med(rs, 'cpu_s'):.2f}", f"{med(rs, 'cpu_s') / args.probe_hosts * 1000:.1f}",
                         f"{med(rs, 'peak_rss_mib'):.0f}", ",".join(str(x["rc"]) for x in rs)])
        print(fmt_table(["launcher", "wall s", "CPU s", "CPU ms / host", "launcher tree RSS MiB", "exit codes"], rows))
        pf = [x["preflight_s"] for x in probe["ddplaunch"] if x.get("preflight_s") is not None]
        if pf:
            print(f"\nddplaunch's own preflight.elapsed_s (connect, probe, evaluate; no Python start-up): "
                  f"median {statistics.median(pf):.2f}s ({min(pf):.2f}-{max(pf):.2f}); all hosts answered: "
                  f"{all(x['ok'] for x in probe['ddplaunch'])} / pdsh: "
                  f"{all(x['answers'] == args.probe_hosts for x in probe['pdsh'])}")
    if rdzv:
        print("\n### Rendezvous (hand launch, torchrun LOGLEVEL=INFO lines time-stamped on arrival; s from launch)\n")
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(fmt_table(["hosts", "first agent up", "last agent up", "all agents rendezvoused",
                         "rendezvous (last up -> all done)", "first rank past init_process_group",
                         "all ranks past it", "all results", "peak TCPStore conns", "distinct peer IPs"],
                        [[str(x["hosts"]), f(x["t_agent_first"]), f(x["t_agent_last"]), f(x["t_rdzv_last"]),
                          f(x["t_rdzv_last"] - x["t_agent_last"]) if x["t_rdzv_last"] and x["t_agent_last"] else "-",
                          f(x["t_pg_first"]), f(x["t_pg_last"]), f(x["t_results"]), str(x["peak_store_conns"]),
                          str(x["peak_store_peers"])] for x in rdzv]))
    if skipped:
        print("\nskipped: " + "; ".join(skipped))
    print(f"\n({os.cpu_count()} cores shared by every sim host; total bench wall {total:.0f}s; "
          f"ddplaunch's time includes its pre-flight and the health check in the same torchrun)")
    if args.json:
        for rows in [*(r for by in results.values() for r in by.values()), *probe.values()]:
            for r in rows:
                r.pop("stamps", None)
        args.json.write_text(json.dumps({"launch": results, "probe": probe, "rdzv": rdzv, "skipped": skipped,
                                         "total_s": total}, indent=1, default=str))
    if args.plot and results:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
