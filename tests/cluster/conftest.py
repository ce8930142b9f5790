"""The test cluster as a pytest fixture (tests/cluster/cluster_hosts.py has the handles)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cluster_hosts import Cluster, cannot_make_hosts

HOSTS = 3


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """Hosts h1..h3, up for the session. Each pytest session makes its own cluster (its own
    namespaces and directory) unless HPCDL_CLUSTER_DIR names one, so two sessions on one
    machine never tear down each other's hosts. Each pytest-xdist worker is a session of its
    own and ignores HPCDL_CLUSTER_DIR: workers sharing hosts would cut each other's links."""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(reason)
    given = None if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("HPCDL_CLUSTER_DIR")
    directory = Path(given or f"/var/tmp/hpcdl-test-cluster-{os.getpid()}")
    handle = Cluster(directory)
    handle.script("up", str(HOSTS))
    handle.hosts = handle.script("hosts").split()
    try:
        yield handle
    finally:
        handle.script("down", check=False)
        if not given:
            shutil.rmtree(directory, ignore_errors=True)
