"""A simulated cluster of real hosts on one machine: the product's `ddplaunch sim` and the
project's test bed. Hosts are network namespaces on a bridge, each with its own hostname,
/etc/hosts and a real sshd; faults (rate limit, link down, sshd stopped) can be injected.
With `SimConfig(slurm=True)` the hosts also form a real Slurm cluster (see slurm.py).

    cluster = sim_up(SimConfig(n_hosts=4))      # needs root
    cluster.run("dls2", ["hostname"])            # -> "dls2\n"
    sim_fault(cluster.state_dir, "dls2", rate="1gbit")
    sim_down(cluster.state_dir)
"""

from ddplaunch.sim.cluster import RC_NOISE_STDERR, RC_NOISE_STDOUT, DownResult, check_requirements, sim_down, sim_up
from ddplaunch.sim.faults import sim_fault
from ddplaunch.sim.netns import Naming
from ddplaunch.sim.proc import SimError
from ddplaunch.sim.slurm import SlurmState
from ddplaunch.sim.specs import render_slurm_spec, render_spec
from ddplaunch.sim.state import (DEFAULT_PREFIX, DEFAULT_SUBNET, Fault, SimCluster, SimConfig, SimHost,
                                 default_state_dir, host_exec_argv, load_cluster)
from ddplaunch.sim.statedir import check_state_dir, secure_state_dir
from ddplaunch.sim.survey import DaemonStatus, HostStatus, sim_status, slurm_status

__all__ = ["DEFAULT_PREFIX", "DEFAULT_SUBNET", "RC_NOISE_STDERR", "RC_NOISE_STDOUT", "DaemonStatus",
           "DownResult", "Fault", "HostStatus", "Naming", "SimCluster", "SimConfig", "SimError", "SimHost",
           "SlurmState", "check_requirements", "check_state_dir", "default_state_dir", "host_exec_argv",
           "load_cluster", "secure_state_dir",
           "render_slurm_spec", "render_spec", "sim_down", "sim_fault", "sim_status",
           "slurm_status", "sim_up"]
