"""No self-inflicted loss: on a healthy link (loopback, nothing injected) large
allreduces deliver exactly 100%, every time. Flow control is the engine's job."""
import pytest

import tasks
from ud_transport.local_cluster import LocalCluster

MIB = 1 << 20


@pytest.mark.slow
def test_fifty_64mib_allreduces_on_four_ranks_deliver_everything():
    with LocalCluster(4) as cluster:
        outcomes = cluster.run(tasks.many_large, 64 * MIB // 4, 50, timeout_s=1200)
    for rank, (fractions, lost, exact) in enumerate(outcomes):
        assert len(fractions) == 50
        assert all(f == 1.0 for f in fractions), f"rank {rank}: {fractions}"
        assert lost == 0 and exact
