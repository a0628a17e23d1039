"""karpathy/nanoGPT's own train.py through a host crash: resumed with `job.resume_args`, or not.

Prepares a work directory from a nanoGPT checkout (`--nanogpt PATH`, e.g. a `git clone` of
https://github.com/karpathy/nanoGPT): its train.py, model.py and configurator.py, with the three
CUDA lines of train.py's DDP set-up patched for CPU (the patch is printed), and a character-level
dataset made as its data/shakespeare_char/prepare.py makes one, from `--text` files (default: this
machine's license texts; nothing is downloaded). Builds a 4-host `ddplaunch sim` (prefix dng) and
runs nanoGPT with DDP on hosts 1-3 (1 rank each, Gloo), host 4 the spare, a checkpoint every
`--eval-interval` iterations (nanoGPT's own eval-and-save):

  undisturbed      no fault
  resume_args      `job.resume_args: [--init_from=resume]`; host 3 crashes (`sim fault --crash`)
                   once rank 0 printed iteration `--crash-at`
  no resume_args   the same crash; the relaunched nanoGPT starts again from iteration 0

and prints one table: the iteration at the crash, the checkpoint iteration before it, where the
relaunched job started, the iterations trained again, crash -> the first iteration after the
relaunch, what ddplaunch's summary said, and the final val loss nanoGPT printed.

Needs root. Usage: .venv/bin/python bench/nanogpt.py --nanogpt PATH [--text FILE ...] [--crash-at 120]
"""

from __future__ import annotations

import argparse
import glob
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recovery import Lines, kill_tagged  # noqa: E402  (bench/recovery.py)

PREFIX, SUBNET = "dng", "10.213.62.0/24"
#: nanoGPT's train.py, DDP branch: the device is the rank's GPU and DDP is given its id; on CPU
#: hosts the device is the CPU and DDP takes no device ids.
CUDA_LINES = {"    device = f'cuda:{ddp_local_rank}'\n": "    device = 'cpu'  # ddplaunch bench: CPU hosts\n",
              "    torch.cuda.set_device(device)\n": "",
              "    model = DDP(model, device_ids=[ddp_local_rank])\n": "    model = DDP(model)  # ddplaunch bench: CPU\n"}
ITER_RE = re.compile(r"\] iter (\d+): loss")
VAL_RE = re.compile(r"\] step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def workdir(nanogpt: Path, texts: list[str], work: Path) -> Path:
    """nanoGPT's three files (train.py patched) and the dataset, under `work`/nanogpt."""
    dst = work / "nanogpt"
    (dst / "data" / "shakespeare_char").mkdir(parents=True)
    for name in ("model.py", "configurator.py"):
        shutil.copy(nanogpt / name, dst / name)
    train = (nanogpt / "train.py").read_text()
    for old, new in CUDA_LINES.items():
        if old not in train:
            sys.exit(f"{nanogpt / 'train.py'}: no line {old.strip()!r} to patch (a newer nanoGPT?)")
        train = train.replace(old, new)
        print(f"patched train.py: -{old.rstrip()}" + (f"\n                  +{new.rstrip()}" if new else ""))
    (dst / "train.py").write_text(train)
    data = "".join(Path(p).read_text(errors="replace") for p in texts)
    chars = sorted(set(data))  # as data/shakespeare_char/prepare.py: characters, 90/10 split, uint16
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in data], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(dst / "data" / "shakespeare_char" / "train.bin")
    ids[cut:].tofile(dst / "data" / "shakespeare_char" / "val.bin")
    with open(dst / "data" / "shakespeare_char" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    print(f"dataset: {len(data):,} characters, vocab {len(chars)}")
    return dst


def spec_for(cluster, code: Path, name: str, args: argparse.Namespace, resume: bool, spare: bool) -> Path:
    data = yaml.safe_load(cluster.spec_path.read_text())
    hosts = data["hosts"]
    out_dir = code.parent / name / "out"
    train_args = ["--device=cpu", "--compile=False", "--backend=gloo", "--dtype=float32",
                  "--dataset=shakespeare_char", f"--out_dir={out_dir}", "--n_layer=2", "--n_head=2", "--n_embd=64",
                  "--block_size=64", "--batch_size=8", "--gradient_accumulation_steps=3", "--dropout=0.0",
                  f"--max_iters={args.iters}", f"--lr_decay_iters={args.iters}", "--warmup_iters=5",
                  f"--eval_interval={args.eval_interval}", "--eval_iters=5", "--log_interval=1",
                  "--always_save_checkpoint=True"]
    data.update(hosts=hosts[:3], nproc_per_node=1, workdir=str(code), healthcheck={"enabled": False},
                job={"script": "train.py", "args": train_args})
    if spare:
        data["recovery"] = {"max_host_failures": 1, "spares": [hosts[3]]}
        if resume:
            data["job"]["resume_args"] = ["--init_from=resume"]
    (code.parent / name).mkdir(parents=True, exist_ok=True)
    path = code.parent / name / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(case: str, cluster, code: Path, args: argparse.Namespace, env: dict) -> dict:
    from ddplaunch.sim.faults import sim_fault

    tag = f"bench-ng-{case.replace(' ', '-').replace('_', '-')}"
    spec = spec_for(cluster, code, tag, args, resume=case == "resume_args", spare=case != "undisturbed")
    proc = subprocess.Popen([sys.executable, "-m", "ddplaunch", "up", str(spec), "--run-id", tag],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    lines, victim = Lines(proc), cluster.hosts[2].name
    row: dict = {"case": case}
    try:
        if case != "undisturbed":
            hit = lines.wait(lambda line: (m := ITER_RE.search(line)) is not None and int(m.group(1)) >= args.crash_at,
                             600)
            if hit is None:
                row["error"] = "never reached the crash iteration:\n" + lines.text()[-2000:]
                return row
            t_crash = time.time()
            sim_fault(cluster, victim, crash=True)
            relaunch = lines.wait(lambda line: "recovery 1 of" in line, 120, after=t_crash)
            if relaunch is not None:
                first = lines.wait(lambda line: ITER_RE.search(line) is not None, 300, after=relaunch[0])
                before = [int(m.group(1)) for t, line in list(lines.lines) if t < relaunch[0]
                          and (m := ITER_RE.search(line))]
                saved = [int(m.group(1)) for t, line in list(lines.lines) if t < relaunch[0]
                         and (m := VAL_RE.search(line)) and int(m.group(1)) > 0]
                row.update(crash_iter=max(before), ckpt_iter=max(saved) if saved else None)
                if first is not None:
                    row["restart_iter"] = int(ITER_RE.search(first[1]).group(1))
                    row["redone"] = row["crash_iter"] - row["restart_iter"]
                    row["first_iter_s"] = round(first[0] - t_crash, 1)
        proc.wait(timeout=900)
        text = lines.text()
        row["exit"] = proc.returncode
        row["said"] = next((line.strip() for line in text.splitlines() if "training restarted from scratch" in line
                            or "the relaunched job loaded" in line), "")
        vals = VAL_RE.findall(text)
        row["final_val"] = float(vals[-1][1]) if vals else None
        row["final_iter"] = int(vals[-1][0]) if vals else None
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_tagged(tag)
        sim_fault(cluster, victim, clear=True)
    return row


def table(rows: list[dict]) -> str:
    out = ["| case | exit | crash at iter | checkpoint iter before it | relaunched job's first iter | iters redone | "
           "crash → first iter after relaunch (s) | final val loss (iter) | ddplaunch's summary says |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r["case"], r.get("exit", "-"), r.get("crash_iter", "-"), r.get("ckpt_iter", "-"),
                 r.get("restart_iter", "-"), r.get("redone", "-"), r.get("first_iter_s", "-"),
                 f"{r['final_val']:.4f} ({r['final_iter']})" if r.get("final_val") is not None else "-",
                 _said(r.get("said", "")) or r.get("error", "-")[:80]]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out)


def _said(line: str) -> str:
    if "restarted from scratch" in line:
        return "training restarted from scratch: the job did not resume"
    m = re.search(r"(at least \d+ optimizer steps done before); the relaunched job loaded (\S+)", line)
    return f"{m.group(1)}; loaded {Path(m.group(2)).name}" if m else line[:80]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--text", nargs="*", default=sorted(glob.glob("/usr/share/common-licenses/*")),
                    help="the corpus (default: this machine's license texts)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--eval-interval", type=int, default=50, help="nanoGPT evaluates and saves its checkpoint")
    ap.add_argument("--crash-at", type=int, default=120)
    args = ap.parse_args()
    if not (args.nanogpt / "train.py").is_file():
        sys.exit(f"{args.nanogpt}: no nanoGPT train.py there (git clone https://github.com/karpathy/nanoGPT)")
    from ddplaunch.sim import SimConfig, sim_down, sim_up

    work = Path(tempfile.mkdtemp(prefix="ddplaunch-bench-nanogpt-"))
    code = workdir(args.nanogpt, [p for p in args.text if Path(p).is_file()], work)
    cluster = sim_up(SimConfig(n_hosts=4, prefix=PREFIX, subnet=SUBNET, nproc_per_node=1, workdir=code))
    env = {**os.environ, "DDPLAUNCH_HOME": str(work / "state"), "PYTHONUNBUFFERED": "1"}
    rows = []
    try:
        for case in ("undisturbed", "resume_args", "no resume_args"):
            rows.append(run(case, cluster, code, args, env))
            print(rows[-1], flush=True)
    finally:
        sim_down(cluster.state_dir)
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()
