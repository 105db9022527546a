"""Senders converging on one rank lose nothing on the way: the default credit window is fewer
datagrams than a receive ring holds.

Between hosts, every datagram a rank is sent may wait in a receive ring before the kernel's packet
work runs (a veth's holds 256 packets). With 16 MiB in flight to a rank, three senders converging on
it behind a bridge overflowed the ring in 11 of 300 calls (4 ranks, MTU 1500, 64 MiB); the default
window of 192 datagrams bounds what all senders together have in flight below that."""
import pytest

import tasks
from conftest import skip_or_fail
from ud_transport.options import WINDOW_DATAGRAMS, Options, credit_window_bytes

MIB = 1 << 20


def test_the_default_window_is_a_number_of_datagrams_on_udp():
    assert Options().validate().window_bytes == 0
    assert WINDOW_DATAGRAMS < 256  # a veth's receive ring, the smallest in front of a rank here
    assert credit_window_bytes(0, 1416, "verbs") == 16 * MIB  # verbs keeps its window (docs/semantics.md)
    assert credit_window_bytes(0, 1416) == WINDOW_DATAGRAMS * 1416
    assert credit_window_bytes(0, 65_464) == WINDOW_DATAGRAMS * 65_464  # loopback's largest: 12 MiB
    assert credit_window_bytes(3 * MIB, 1416) == 3 * MIB  # a window set by hand is kept
    with pytest.raises(ValueError, match="window_bytes"):
        Options(window_bytes=-1).validate()


@pytest.mark.slow
@pytest.mark.netns
def test_four_ranks_on_a_bridge_deliver_everything_with_the_default_window():
    from ud_transport.lab.hosts import Hosts, unavailable_reason
    from ud_transport.lab.local_cluster import LocalCluster

    reason = unavailable_reason()
    if reason:
        skip_or_fail(f"veth hosts: {reason}")
    calls = 60  # at loss budget 0 (support.many_large): one lost datagram fails its call and the test
    with Hosts(4, mtu=1500) as hosts, LocalCluster(4, hosts=hosts) as cluster:
        chunk_bytes = cluster.run(tasks.address_of)[0][1]
        for rank, (granted, window) in enumerate(cluster.run(tasks.receive_buffer_of)):
            assert window == WINDOW_DATAGRAMS * chunk_bytes < granted, (rank, window, granted)
        outcomes = cluster.run(tasks.many_large, 64 * MIB // 4, calls, timeout_s=1200)
    for rank, (fractions, lost, exact) in enumerate(outcomes):
        assert fractions == [1.0] * calls and lost == 0 and exact, f"rank {rank}: {lost} chunks lost"
