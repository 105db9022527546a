"""Shared fixtures: local clusters of rank processes, kept for the session
because starting a rank (importing torch) costs seconds on a 2-core machine."""
import collections
import os

import pytest

from ud_transport.lab.local_cluster import LocalCluster

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The default stripes="auto" runs as many stripes as each rank has cores of its own: 1 for two or
# more ranks on the 2-core CI machine, up to 4 on a larger one. Tests that count datagrams, windows
# or calls expect one socket per rank wherever they run, so the suite runs one stripe unless a test
# asks otherwise; tests/test_stripes.py and tests/test_stripe_choice.py set stripes themselves.
os.environ.setdefault("UD_STRIPES", "1")

_clusters = collections.OrderedDict()  # least recently used first

# Rank processes kept alive at once: each holds torch (~250 MB), and a whole suite's worth of
# clusters (150 ranks) ran a 24 GiB machine out of memory
MAX_CACHED_RANKS = 48


def get_cluster(world_size, **options):
    """A running cluster with these options, started once and kept while it is among the most
    recently used (at most MAX_CACHED_RANKS ranks alive in all)."""
    key = (world_size, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    cluster = _clusters.get(key)
    if cluster is None or any(not p.is_alive() for p in cluster.processes):
        if cluster is not None:
            cluster.close()
        while _clusters and sum(len(c.processes) for c in _clusters.values()) + world_size > MAX_CACHED_RANKS:
            _clusters.popitem(last=False)[1].close()
        cluster = _clusters[key] = LocalCluster(world_size, **options)
    _clusters.move_to_end(key)
    return cluster


def pytest_sessionfinish(session, exitstatus):
    for cluster in _clusters.values():
        cluster.close()


@pytest.fixture
def store_port():
    """A TCPStore in this process, outliving every rank (as torchrun's agent hosts it: a store
    that lives in a rank dies with it)."""
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    yield server.port
    del server


def run_with_victims(world, victims, task, *arguments, timeout_s=240):
    """Run task(comm, *arguments) on `world` fresh ranks, of which the processes of `victims`
    (first ranks) are expected to die; returns {first rank: result} of the others, and checks
    that the victims are dead."""
    survivors = [rank for rank in range(world) if rank not in victims]
    with LocalCluster(world) as cluster:
        for rank in victims:
            cluster.connections[rank].send((task, arguments))
        results = cluster.run(task, *arguments, ranks=survivors, timeout_s=timeout_s)
        for rank in victims:
            cluster.processes[rank].join(10)
            assert not cluster.processes[rank].is_alive(), f"rank {rank} outlived its call: it was never killed"
    return dict(zip(survivors, results))


def skip_or_fail(reason):
    """Missing machinery skips on a developer's machine; in CI it is a failure."""
    if IN_CI:
        pytest.fail(f"CI must run this test but cannot: {reason}")
    pytest.skip(reason)
