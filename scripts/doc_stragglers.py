"""The straggler pictures in the docs, from a real run: `ddplaunch top` in tmux, the run page in Chromium.

Builds a 4-host sim cluster (prefix ddd, 10.213.62.0/24), starts jobs/train.py on it detached (1
rank per host, 40 ms of CPU a step), slows host 3 to 25 % of a CPU after step 100, waits until it
is named, captures `ddplaunch top RUN_ID` in a tmux pane (docs/top.txt), lets the run end, writes
its page (`ddplaunch report RUN_ID --html docs/run-page.html`) and screenshots it with headless
Chromium (docs/run-page.png; skipped, and said, without Chromium). Needs root and tmux
(`apt-get install -y tmux chromium`).
Usage: .venv/bin/python scripts/doc_stragglers.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplaunch.record.events import StragglerNamed, read_events  # noqa: E402
from ddplaunch.sim import SimConfig, sim_down, sim_up  # noqa: E402
from ddplaunch.sim.faults import sim_fault  # noqa: E402

RUN_ID = "straggler-demo"
CHROMIUM = ["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ddpl-docshots-"))
    env = {**os.environ, "DDPLAUNCH_HOME": str(tmp / "state"), "PYTHONUNBUFFERED": "1"}
    cluster = sim_up(SimConfig(n_hosts=4, prefix="ddd", subnet="10.213.62.0/24", state_dir=tmp / "sim",
                               workdir=ROOT, nproc_per_node=1))
    run_dir = tmp / "state" / "runs" / RUN_ID
    try:
        data = yaml.safe_load(cluster.spec_path.read_text())
        data.update(workdir=str(ROOT), nproc_per_node=1, env={"DDPLAUNCH_CKPT_DIR": str(tmp / "ckpt")},
                    job={"script": "jobs/train.py", "args": ["--epochs", "1", "--samples", "9600", "--batch-size", "8",
                                                             "--ckpt-every", "0", "--log-every", "20",
                                                             "--burn-ms", "40", "--seed", "3"]})
        spec = tmp / "cluster.yaml"
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        ddp = [sys.executable, "-m", "ddplaunch"]
        subprocess.run([*ddp, "up", str(spec), "--run-id", RUN_ID, "--detach"], env=env, cwd=ROOT, check=True)
        log = run_dir / "output.log"
        wait(lambda: log.exists() and "step=100 " in log.read_text(), 300, "step 100")
        sim_fault(cluster, cluster.hosts[2].name, slow=25)
        wait(lambda: any(isinstance(e, StragglerNamed) for e in read_events(run_dir)), 180, "the straggler")
        time.sleep(3)
        session = "ddpl-top"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "20",
                        f"cd {ROOT} && DDPLAUNCH_HOME={tmp / 'state'} {sys.executable} -m ddplaunch top {RUN_ID}"],
                       check=True)
        time.sleep(4)
        shot = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                              check=True).stdout
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
        (ROOT / "docs" / "top.txt").write_text(shot.rstrip() + "\n")
        sim_fault(cluster, cluster.hosts[2].name, clear=True)
        subprocess.run([*ddp, "attach", RUN_ID], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=900)
        page = ROOT / "docs" / "run-page.html"
        subprocess.run([*ddp, "report", RUN_ID, "--html", str(page)], env=env, cwd=ROOT, check=True)
        if Path(CHROMIUM[0]).exists():
            subprocess.run([*CHROMIUM, f"--user-data-dir={tmp / 'chromium'}", "--window-size=860,1500",
                            f"--screenshot={ROOT / 'docs' / 'run-page.png'}", page.as_uri()], check=True, timeout=120)
        else:
            print(f"no {CHROMIUM[0]}: docs/run-page.png not rewritten (apt-get install -y chromium)")
    finally:
        sim_fault(cluster, cluster.hosts[2].name, clear=True)
        sim_down(tmp / "sim")
    print("wrote docs/top.txt, docs/run-page.html, docs/run-page.png")


if __name__ == "__main__":
    main()
