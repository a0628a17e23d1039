"""`sim up --slurm`: pure parts (slurm.conf, Slurm spec, state) without root, then a real
Slurm cluster on sim hosts as root.

Real-cluster tests share the session `slurm_cluster` (dlq1..dlq3 + controller dlqctl); jobs
are polled with `squeue` (not `sbatch --wait`). The lifecycle test builds its own small cluster.
"""

import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ddplaunch.sim import (Naming, SimCluster, SimConfig, SimError, SimHost, SlurmState, simcli as sim_cli, load_cluster,
                           render_slurm_spec, sim_down, sim_up, slurm as sim_slurm)
from ddplaunch.sim.netns import list_netns, netns_pids
from ddplaunch.sim.proc import pid_alive, pid_cmdline, wait_until
from ddplaunch.sim.state import save_state
from ddplaunch.sim.testing import sbatch, slurm_run, wait_job_gone, wait_job_state
from tests.simfixture import real_system, slurm_cluster, slurm_skip_reason  # noqa: F401  (fixture)
from tests.timing import no_hang

SCRATCH_PREFIX = os.environ.get("DDPLAUNCH_TEST_SLURM_PREFIX2", "dlqz")
SCRATCH_SUBNET = os.environ.get("DDPLAUNCH_TEST_SLURM_SUBNET2", "10.213.90.0/24")


def needs_slurm(fn):
    """A real-system test of Slurm daemons: marked `slurm` too (.ci/run runs those beside the others)."""
    return pytest.mark.slurm(real_system(slurm_skip_reason())(fn))


# ----------------------------------------------------------------------------- pure parts

def _fake_cluster(tmp_path: Path) -> SimCluster:
    hosts = [SimHost(i, f"dls{i}", f"10.213.0.{10 + i}", f"dls{i}") for i in (1, 2, 3)]
    cluster = SimCluster("dls", "10.213.0.0/24", tmp_path, hosts, "dlsbr0", "dls0", tmp_path / "client_key",
                         tmp_path / "known_hosts", tmp_path / "cluster.yaml", tmp_path / "etc/hosts",
                         tmp_path / "etc/resolv.conf")
    cluster.slurm = SlurmState(conf=tmp_path / "etc/slurm.conf", spec_path=tmp_path / "cluster-slurm.yaml",
                               controller_ns="dls0", controller_name="dlsctl", controller_addr="10.213.0.10")
    return cluster


def test_controller_is_host_zero():
    n = Naming.parse("dls", "10.213.0.0/24")
    assert (n.controller_ns, n.controller_name, str(n.controller_addr)) == ("dls0", "dlsctl", "10.213.0.10")
    assert n.owns_netns(n.controller_ns)  # so `down` removes it with the hosts


def test_slurm_conf_has_the_agreed_settings(tmp_path):
    text = sim_slurm.slurm_conf_text(cluster_name="dls", controller=("dlsctl", "10.213.0.10"),
                                     nodes=[("dls1", "10.213.0.11"), ("dls2", "10.213.0.12")],
                                     base=tmp_path / "slurm", munge_socket=tmp_path / "munge/munge.socket.2")
    conf = dict(line.split("=", 1) for line in text.splitlines()
                if "=" in line and not line.startswith(("#", "NodeName", "PartitionName")))
    assert conf["ClusterName"] == "dls" and conf["SlurmctldHost"] == "dlsctl(10.213.0.10)"
    assert (conf["ProctrackType"], conf["TaskPlugin"], conf["MailProg"]) == \
        ("proctrack/linuxproc", "task/none", "/bin/true")
    assert conf["AccountingStorageType"] == "accounting_storage/none"
    assert (conf["SlurmctldTimeout"], conf["SlurmdTimeout"], conf["KillWait"], conf["MinJobAge"],
            conf["ReturnToService"]) == ("30", "30", "5", "300", "2")
    assert conf["AuthInfo"] == f"socket={tmp_path}/munge/munge.socket.2"
    assert "NodeName=dls2 NodeAddr=10.213.0.12 CPUs=2 RealMemory=2000 State=UNKNOWN" in text
    assert "PartitionName=debug Nodes=dls1,dls2 Default=YES MaxTime=INFINITE State=UP" in text
    assert "MessageTimeout" not in conf  # Slurm's own 10 s, unless a bench of 128 nodes asks for more
    longer = sim_slurm.slurm_conf_text(cluster_name="dls", controller=("dlsctl", "10.213.0.10"), nodes=[],
                                       base=tmp_path, munge_socket=tmp_path / "m", message_timeout=60)
    assert "MessageTimeout=60" in longer.splitlines()


def test_render_slurm_spec_has_the_agreed_keys(tmp_path):
    text = render_slurm_spec(_fake_cluster(tmp_path), python="/venv/bin/python", workdir=Path("/w"))
    spec = yaml.safe_load(text)
    # no hosts: they would be the exact node list; Slurm picks slurm.nodes of the partition
    assert list(spec) == ["name", "backend", "nproc_per_node", "python", "workdir",
                          "dist_backend", "socket_ifname", "rdzv_timeout", "slurm", "job"]
    assert (spec["name"], spec["backend"], spec["socket_ifname"]) == ("sim-dls-slurm", "slurm", "dls0")
    assert spec["slurm"] == {"conf": str(tmp_path / "etc/slurm.conf"), "partition": "debug", "nodes": 2}
    assert spec["job"] == {"script": "jobs/toy_ddp.py"}


def test_state_file_round_trips_the_slurm_layer(tmp_path):
    cluster = _fake_cluster(tmp_path)
    cluster.slurm.slurmd_pids = {"dls1": 11, "dls2": 12}
    cluster.slurm.munged_pid = 7
    save_state(cluster)
    assert load_cluster(tmp_path).slurm == cluster.slurm


def test_missing_slurm_binaries_say_how_to_install(monkeypatch):
    monkeypatch.setattr(sim_slurm, "SLURMD", "/nonexistent/slurmd")
    with pytest.raises(SimError, match="apt-get install slurm-wlm munge"):
        sim_slurm.require_slurm()


# ----------------------------------------------------------------------------- a real Slurm cluster

@needs_slurm
def test_sinfo_shows_every_node_idle(slurm_cluster):
    out = slurm_run(slurm_cluster, ["sinfo", "-h", "-N", "-o", "%N %T %P"])
    assert sorted(out.split("\n")[:-1]) == [f"{h.name} idle debug*" for h in slurm_cluster.hosts]


@needs_slurm
def test_two_node_job_runs_on_distinct_sim_hosts(slurm_cluster, tmp_path):
    st = slurm_cluster.slurm
    script = tmp_path / "hello.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -J hello2n\n#SBATCH -N 2\n#SBATCH --ntasks-per-node=1\n"
                      f"#SBATCH -o {st.base}/jobs/%j.out\n"
                      f"srun -l bash -c 'echo host=$(hostname) $(ip -4 -br addr show dev {slurm_cluster.ifname})'\n")
    job = sbatch(slurm_cluster, script)
    wait_job_gone(slurm_cluster, job, timeout=30)
    assert wait_job_state(slurm_cluster, job, ["COMPLETED", "FAILED", "CANCELLED"], timeout=5) == "COMPLETED"
    out = (st.base / "jobs" / f"{job}.out").read_text()
    seen = sorted(re.findall(r"host=(\S+) \S+\s+UP\s+([\d.]+)/", out))
    assert len(seen) == 2 and len({h for h, _ in seen}) == 2, out
    assert set(seen) <= {(h.name, h.addr) for h in slurm_cluster.hosts}, out


@needs_slurm
def test_scancel_leaves_no_step_process(slurm_cluster, tmp_path):
    st = slurm_cluster.slurm
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -J sleep2n\n#SBATCH -N 2\n#SBATCH --ntasks-per-node=1\n"
                      f"#SBATCH -o {st.base}/jobs/%j.out\nsrun sleep 300\n")
    job = sbatch(slurm_cluster, script)
    wait_job_state(slurm_cluster, job, ["RUNNING"], timeout=20)

    def extras() -> dict[str, list[int]]:
        """Processes in each node namespace other than its slurmd and sshd (job steps)."""
        keep = {st.slurmd_pids[h.name] for h in slurm_cluster.hosts} | \
            {h.sshd_pid for h in slurm_cluster.hosts}
        return {h.name: [p for p in netns_pids(h.ns) if p not in keep and pid_alive(p)]
                for h in slurm_cluster.hosts}

    def sleeping() -> int:  # the two tasks themselves (`srun sleep 300` is not one)
        return sum(pid_cmdline(p).split()[:1] in (["sleep"], ["/usr/bin/sleep"], ["/bin/sleep"])
                   for pids in extras().values() for p in pids)

    assert wait_until(lambda: sleeping() == 2, 20, interval=0.1), \
        {n: [(p, pid_cmdline(p)) for p in pids] for n, pids in extras().items()}
    slurm_run(slurm_cluster, ["scancel", str(job)])
    wait_job_gone(slurm_cluster, job, timeout=30)
    assert wait_until(lambda: not any(extras().values()), 20, interval=0.1), \
        {n: [pid_cmdline(p) for p in pids] for n, pids in extras().items()}
    assert wait_job_state(slurm_cluster, job, ["CANCELLED"], timeout=5) == "CANCELLED"


@needs_slurm
@pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser")
def test_state_dir_is_traversal_only_yet_other_users_run_jobs(slurm_cluster):
    st = os.lstat(slurm_cluster.state_dir)
    # 0711: munged and job users reach munge/, etc/slurm.conf and slurm/jobs by name, but
    # nobody else can list the dir or plant a file in it
    assert stat.S_IMODE(st.st_mode) == 0o711 and st.st_uid == os.geteuid() == 0
    assert stat.S_IMODE(os.lstat(slurm_cluster.key).st_mode) == 0o600
    out = slurm_run(slurm_cluster, ["runuser", "-u", "nobody", "--", "env", f"SLURM_CONF={slurm_cluster.slurm.conf}",
                                    "srun", "-N1", "id", "-un"], timeout=30)
    assert out.strip() == "nobody"


@needs_slurm
def test_status_lists_the_slurm_daemons(slurm_cluster):
    res = CliRunner().invoke(sim_cli.sim_group, ["status", "--state-dir", str(slurm_cluster.state_dir)])
    assert res.exit_code == 0, res.output
    for label in ["munged", "slurmctld", *(f"slurmd@{h.name}" for h in slurm_cluster.hosts)]:
        assert label in res.output
    assert res.output.count("alive, node idle") == len(slurm_cluster.hosts)


@needs_slurm
def test_up_is_idempotent_and_down_removes_every_daemon_and_namespace():
    # not tmp_path: munged (user munge) must be able to traverse every parent of the state dir
    state_dir = Path(tempfile.mkdtemp(prefix=f"ddplaunch-sim-{SCRATCH_PREFIX}-"))
    cfg = SimConfig(n_hosts=1, prefix=SCRATCH_PREFIX, subnet=SCRATCH_SUBNET, state_dir=state_dir, slurm=True)
    naming = Naming.parse(SCRATCH_PREFIX, SCRATCH_SUBNET)

    def ours() -> list[str]:
        return sorted(ns for ns in list_netns() if naming.owns_netns(ns))

    try:
        first = sim_up(cfg)
        again = sim_up(cfg)                               # over a running cluster
        assert not any(pid_alive(p) for p in sim_slurm.daemon_pids(first.slurm).values())
        (state_dir / "state.json").unlink()        # a crash: the state is lost
        third = sim_up(cfg)                               # leftovers are found by naming/pid file
        assert not any(pid_alive(p) for p in sim_slurm.daemon_pids(again.slurm).values())
        pids = sim_slurm.daemon_pids(third.slurm)
        assert len(pids) == 3 and all(pid_alive(p) for p in pids.values())
        assert ours() == [f"{SCRATCH_PREFIX}0", f"{SCRATCH_PREFIX}1"]
        yaml.safe_load(third.slurm.spec_path.read_text())  # written, valid
        t0 = time.monotonic()
        res = sim_down(cfg.state_dir)
        assert sorted(res.slurm_stopped) == sorted(pids.values())
        no_hang(time.monotonic() - t0, 15, "sim down stops the Slurm daemons it started, waiting on none")
        assert not any(pid_alive(p) for p in pids.values()) and ours() == []
        assert sim_down(cfg.state_dir).slurm_stopped == []  # twice is fine
    finally:
        sim_down(cfg.state_dir, prefix=SCRATCH_PREFIX, purge=True)
