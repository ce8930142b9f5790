"""The test cluster as a pytest fixture (tests/cluster/cluster_hosts.py has the handles)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster_hosts import Cluster, cannot_make_hosts

HOSTS = 3


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(reason)
    directory = Path(os.environ.get("HPCDL_CLUSTER_DIR", "/var/tmp/hpcdl-cluster"))
    handle = Cluster(directory)
    handle.script("up", str(HOSTS))
    handle.hosts = handle.script("hosts").split()
    try:
        yield handle
    finally:
        handle.script("down", check=False)
