"""Shared fixtures: local clusters of rank processes, kept for the session
because starting a rank (importing torch) costs seconds on a 2-core machine."""
import os

import pytest

from ud_transport.local_cluster import LocalCluster

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

_clusters = {}


def get_cluster(world_size, **options):
    """A running cluster with these options, started once per session."""
    key = (world_size, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    cluster = _clusters.get(key)
    if cluster is None or any(not p.is_alive() for p in cluster.processes):
        cluster = _clusters[key] = LocalCluster(world_size, **options)
    return cluster


def pytest_sessionfinish(session, exitstatus):
    for cluster in _clusters.values():
        cluster.close()


def skip_or_fail(reason):
    """Missing machinery skips on a developer's machine; in CI it is a failure."""
    if IN_CI:
        pytest.fail(f"CI must run this test but cannot: {reason}")
    pytest.skip(reason)
