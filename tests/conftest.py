"""Shared fixtures: the simulated cluster (real namespaces + sshd) for integration tests."""

from tests.simfixture import sim_cluster, slurm_cluster  # noqa: F401  (re-exported fixtures)
