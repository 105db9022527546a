"""No self-inflicted loss: on a healthy link (loopback, nothing injected) large
allreduces deliver exactly 100%, every time. Flow control is the engine's job."""
import pytest

import tasks
from ud_transport.lab.local_cluster import LocalCluster

MIB = 1 << 20


@pytest.mark.slow
def test_fifty_64mib_allreduces_on_four_ranks_deliver_everything():
    with LocalCluster(4) as cluster:
        outcomes = cluster.run(tasks.many_large, 64 * MIB // 4, 50, timeout_s=1200)
    for rank, (fractions, lost, exact) in enumerate(outcomes):
        assert len(fractions) == 50
        assert all(f == 1.0 for f in fractions), f"rank {rank}: {fractions}"
        assert lost == 0 and exact


@pytest.mark.slow
def test_sixteen_ranks_with_default_options_deliver_everything():
    """Direct's incast, at its worst here: in every round 15 senders converge on owners that
    are all receiving at once (16 ranks on 2 cores), with default options (the largest
    datagram loopback carries, the credit window shared by all senders to a rank). Staggered
    send order and per-sender credits keep every byte: nothing lost, every result exact."""
    with LocalCluster(16) as cluster:
        outcomes = cluster.run(tasks.many_large, 16 * MIB // 4, 5, timeout_s=1200)
        algorithms = cluster.run(tasks.default_algorithm)
    assert algorithms == ["direct"] * 16  # what auto picks at 16 ranks
    for rank, (fractions, lost, exact) in enumerate(outcomes):
        assert fractions == [1.0] * 5, f"rank {rank}: {fractions}"
        assert lost == 0 and exact
