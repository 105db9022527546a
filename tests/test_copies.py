"""copies=k sends every data datagram k times, the later copies after the step's
first pass: exact without loss, a chunk lost only if every copy is (i.i.d. loss p
becomes about p**k), the copies counted apart from drops, and no stall when the
copies outgrow the credit window."""
import numpy as np
import pytest

import tasks
import ud_transport
from conftest import get_cluster

COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather", "broadcast"]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_copies_are_exact_and_counted_apart_without_loss(collective, algorithm):
    world = 4
    per_rank = get_cluster(world, chunk_bytes=32).run(tasks.calls_with_copies, collective, 1001, 3, 2, algorithm)
    for rank, rows in enumerate(per_rank):
        for output, want, stats in rows:
            np.testing.assert_array_equal(output, want)
            assert stats.delivered_fraction == 1.0 and stats.chunks_lost == 0
            # every chunk came twice: the first is used, the second is a redundant copy, not a drop
            if stats.chunks_total:
                assert 0 < stats.redundant_copies <= stats.chunks_total, stats
            assert stats.datagrams_received == stats.chunks_total
            assert stats.dropped_duplicate == stats.dropped_stale == 0, stats


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_a_chunk_is_lost_only_when_every_copy_is(copies):
    """30% i.i.d. loss on every datagram: the share of chunks lost is about 0.3**copies
    (direct schedule, where each chunk travels one hop)."""
    world, loss, calls = 4, 0.3, 30
    cluster = get_cluster(world, chunk_bytes=32, inject=ud_transport.Bernoulli(loss, seed=29))
    per_rank = cluster.run(tasks.calls_with_copies, "allreduce", 960, calls, copies, "direct")
    lost = sum(stats.chunks_lost for rows in per_rank for _, _, stats in rows)
    total = sum(stats.chunks_total for rows in per_rank for _, _, stats in rows)
    expected = loss ** copies
    spread = 5 * np.sqrt(expected * (1 - expected) / total) + 0.01
    assert abs(lost / total - expected) < spread, (lost / total, expected, total)


def test_the_ring_loses_less_with_copies():
    world, calls = 4, 20
    cluster = get_cluster(world, chunk_bytes=32, inject=ud_transport.Bernoulli(0.2, seed=31))
    share = {}
    for copies in (1, 2):
        per_rank = cluster.run(tasks.calls_with_copies, "allreduce", 960, calls, copies, "ring")
        share[copies] = (sum(s.chunks_lost for rows in per_rank for _, _, s in rows)
                         / sum(s.chunks_total for rows in per_rank for _, _, s in rows))
    assert share[2] < share[1] / 3, share


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_copies_beyond_the_credit_window_do_not_stall(algorithm):
    """A window of 16 chunks and steps of ~100: the copies take window the first pass already
    credited, so the receiver credits the same position again; and an owner's gather data
    arriving while this rank still sends copies of its reduce step ends those copies instead of
    being dropped (dropped, the whole window it was credited for would be lost and the step
    would wait out its share of the deadline)."""
    world = 4
    cluster = get_cluster(world, chunk_bytes=1024, window_bytes=16 * 1024)
    per_rank = cluster.run(tasks.calls_with_copies, "allreduce", 100_000, 3, 2, algorithm, 20.0)
    for rows in per_rank:
        for output, want, stats in rows:
            np.testing.assert_array_equal(output, want)
            assert stats.steps_timed_out == 0 and not stats.deadline_expired, stats
            assert stats.chunks_lost == 0 and stats.redundant_copies > 0, stats


def test_copies_option_and_its_bounds():
    assert ud_transport.options.build(copies=3).copies == 3
    for bad in (0, ud_transport._native.MAX_COPIES + 1):
        with pytest.raises(ValueError, match="copies"):
            ud_transport.options.build(copies=bad)
