"""How many copies a credit takes (native/recent_loss.c, udt_credit_copies): two where this rank has
seen loss lately or knows little yet, one once the datagrams it expected have come for long (its
upper estimate of the loss rate below 1e-4). A lost credit only stalls its sender until the refresh,
so on a clean network the second copy is a datagram through the whole packet path for nothing
(a 4-rank 16 MiB allreduce on a bridge: about 200 of each rank's 18,100 datagrams a call).

The simulator runs the real engines on a virtual clock, so the counts are exact."""
from ud_transport import _native

WORLD, COUNT, CHUNK_BYTES, CALLS = 4, 1 << 20, 1024, 6


def _allreduces(loss=0.0, seed=3):
    return _native.simulate(WORLD, _native.COLLECTIVE_ALLREDUCE, _native.ALGORITHM_DIRECT, COUNT, CHUNK_BYTES, CALLS,
                            deadline_s=5.0, loss_budget=1.0, loss_kind=1 if loss else 0, loss=loss, seed=seed)


def test_credits_go_once_where_nothing_was_lost_for_long():
    """The first call knows nothing of the network and sends every credit twice; from the next
    calls, with thousands of chunks seen and none lost, each credit goes once: half the credit
    datagrams, and the same data."""
    rows = _allreduces()
    assert all(status == 0 for call in rows for status, _, _, _ in call)
    first = [stats for _, stats, _, _ in rows[0]]
    assert all(stats["credits_sent"] > 0 and stats["credits_sent"] % 2 == 0 for stats in first), first
    for call in rows[2:]:
        for rank, (_, stats, _, _) in enumerate(call):
            assert 0 < stats["credits_sent"] <= first[rank]["credits_sent"] // 2, (rank, stats["credits_sent"])
            others = stats["datagrams_sent"] - stats["credits_sent"] - stats["ends_sent"]  # END markers: test_end_copies.py
            assert others == first[rank]["datagrams_sent"] - first[rank]["credits_sent"] - first[rank]["ends_sent"], rank


def test_credits_keep_both_copies_under_loss():
    """At 1% loss every call keeps two copies of each credit, as before: the counts stay even and
    at least twice what the same calls send in one copy on a clean network."""
    once = [min(call[rank][1]["credits_sent"] for call in _allreduces()[2:]) for rank in range(WORLD)]
    for seed in (1, 2):
        rows = _allreduces(loss=0.01, seed=seed)
        for call in rows:
            for rank, (status, stats, _, _) in enumerate(call):
                assert status == 0
                assert stats["credits_sent"] % 2 == 0 and stats["credits_sent"] >= 2 * once[rank], (rank, stats["credits_sent"])
