"""`hpcdl plan --calibrate` across hosts learns the network's α and β (hpcdl/plan/calibrate.py,
``network_calibration``): launched with one rank per host, it measures point to point and
MPI_Allreduce between the hosts and writes the inter-node figures into the machine file,
keeping the node's own figures from the file already there. Proved on eth0: the bytes each
host sent while it ran (read from outside, on each host's own sysfs) are at least what the
measured allreduces must send. No timing assertions: the figures are checked for sign and
provenance only.
"""
from __future__ import annotations

import shutil

import pytest
import yaml
from cluster_hosts import REPO

from hpcdl.plan import calibrate

SEED = REPO / "hpcdl" / "plan" / "machines" / "local.yaml"
#: --quick: the timed calls per size, plus one untimed call first
QUICK_CALLS = 3 + 1


def test_the_network_fit_recovers_the_ring_cost_it_is_given():
    alpha, beta, gamma, hosts = 5e-5, 4e-9, 3e-10, 3
    points = [(n, 2 * (hosts - 1) * alpha + 2 * (hosts - 1) / hosts * n * beta
               + (hosts - 1) / hosts * n * gamma) for n in calibrate.NETWORK_SIZES]
    fit = calibrate.fit_network(points, hosts, gamma)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["max_relative_residual"] < 1e-6


def test_the_network_fit_refuses_one_host_and_flat_times():
    with pytest.raises(ValueError, match=">= 2 hosts"):
        calibrate.fit_network([(1, 1.0), (2, 2.0)], 1, 0.0)
    with pytest.raises(ValueError, match="no bandwidth"):
        calibrate.fit_network([(4e6, 1.0), (1.6e7, 1.0), (6.4e7, 0.5)], 2, 0.0)
    with pytest.raises(ValueError, match="sizes of >="):
        calibrate.fit_network([(1e3, 1.0), (1e6, 2.0), (1e7, 3.0)], 2, 0.0)


def test_hockney_figures_are_the_tiny_message_and_the_large_one_less_it():
    figures = calibrate.hockney_figures(2e-5, 64e6, 2e-5 + 64e6 / 1.2e8)
    assert figures["alpha_s"] == 2e-5
    assert 1 / figures["beta_s_per_byte"] == pytest.approx(1.2e8)
    with pytest.raises(ValueError, match="do not fit"):
        calibrate.hockney_figures(1e-3, 64e6, 1e-4)


def test_calibrate_across_two_hosts_writes_network_figures_measured_on_eth0(cluster):
    hosts = cluster.hosts[:2]
    machines = cluster.workdir("plan-network")
    shutil.copy(SEED, machines / "local.yaml")
    seed = yaml.safe_load(SEED.read_text())
    before = {h: cluster.eth0_bytes(h) for h in hosts}
    done = cluster.mpirun("mpich", hosts, 1, f"{cluster.python('mpich')} -m hpcdl.cli.main "
                          f"plan --calibrate --quick --machines-dir {machines}")
    after = {h: cluster.eth0_bytes(h) for h in hosts}
    assert f"wrote {machines / 'local.yaml'}" in done.stdout

    doc = yaml.safe_load((machines / "local.yaml").read_text())
    network = doc["network"]
    assert network["latency_s"]["value"] > 0 and network["bandwidth_Bps"]["value"] > 0
    assert "across 2 hosts (h1, h2)" in network["bandwidth_Bps"]["source"]
    # The node's own figures are the seed's: only the network was measured.
    for section in ("node", "compute", "intra_node", "data"):
        assert doc[section] == seed[section], section

    measured = doc["measured"]["network"]
    assert measured["hosts"] == hosts
    assert network["bandwidth_Bps"]["value"] == pytest.approx(
        1 / measured["point_to_point"]["beta_s_per_byte"])
    assert measured["allreduce_fit"]["beta_s_per_byte"] > 0
    # MPI_Allreduce of n bytes between 2 hosts sends at least n out of each (reduce-scatter
    # + allgather halves, or recursive doubling's whole buffer).
    must_send = QUICK_CALLS * sum(calibrate.NETWORK_SIZES)
    for host in hosts:
        sent = after[host][0] - before[host][0]
        assert sent >= must_send, f"{host}: eth0 sent {sent} B, the allreduces alone {must_send}"
        assert measured["interface_bytes"][host]["eth0"][0] >= must_send


def test_calibrate_under_mpiexec_on_one_host_says_to_run_it_across_hosts(cluster):
    done = cluster.mpirun("mpich", cluster.hosts[:1], 2, f"{cluster.python('mpich')} -m "
                          f"hpcdl.cli.main plan --calibrate --quick --machines-dir "
                          f"{cluster.workdir('plan-network-one-host')}", check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "share one host" in done.stderr
