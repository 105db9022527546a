"""How many copies a step's END marker takes (native/recent_loss.c, udt_end_copies): all of
end_repeats where this rank knows little yet or its call skipped a chunk, fewer as the datagrams it
expected keep coming, one once a step that lost a chunk and every copy of its END (it then waits
idle_close_us and asks its sender) would be rarer than END_WAIT_RISK a call. A receiver needs the
END only where a chunk of the step was lost, so on a clean network the other copies are datagrams
through the whole packet path for nothing: at 16 ranks a 4 KiB allreduce sends 30 steps a rank,
each one chunk and three ENDs.

The simulator runs the real engines on a virtual clock, so the counts are exact."""
from ud_transport import _native

CHUNK_BYTES = 1024


def _allreduces(world, count, calls, loss=0.0, seed=3):
    rows = _native.simulate(world, _native.COLLECTIVE_ALLREDUCE, _native.ALGORITHM_DIRECT, count, CHUNK_BYTES, calls,
                            deadline_s=5.0, loss_budget=1.0, loss_kind=1 if loss else 0, loss=loss, seed=seed)
    assert all(status == 0 for call in rows for status, _, _, _ in call)
    return [[stats for _, stats, _, _ in call] for call in rows]


def test_ends_go_once_where_nothing_was_lost():
    """4 ranks, direct, 1 MiB: each rank sends 6 steps (3 of the reduce-scatter, 3 of the
    all-gather). The first call, knowing one call's chunks, sends some ENDs more than once; from the
    second, with thousands of chunks seen and none lost, each END goes once, and nothing else the
    calls send changes."""
    calls = _allreduces(4, 1 << 20, 6)
    assert all(stats["ends_sent"] > 6 for stats in calls[0]), [stats["ends_sent"] for stats in calls[0]]
    for call in calls[1:]:
        for rank, stats in enumerate(call):
            assert stats["ends_sent"] == 6, (rank, stats["ends_sent"])
            others = stats["datagrams_sent"] - stats["ends_sent"] - stats["credits_sent"]
            assert others == calls[1][rank]["datagrams_sent"] - 6 - calls[1][rank]["credits_sent"], rank


def test_small_calls_at_sixteen_ranks_earn_one_copy():
    """16 ranks, 4 KiB: 30 steps a rank of one chunk each. A call's few chunks (and its verdicts)
    earn the estimate over calls: three copies of each END at first, then two, then one, never
    back up while nothing is lost."""
    counts = [call[0]["ends_sent"] for call in _allreduces(16, 1024, 30)]
    assert counts[0] == 90 and counts[-1] == 30, counts
    assert all(later <= earlier for earlier, later in zip(counts, counts[1:])), counts


def test_ends_keep_every_copy_under_loss():
    """At 1% loss each END keeps its three copies, as before (whatever a call has seen, the rate
    keeps the risk above what one or two copies allow), and every call ends OK."""
    for seed in (1, 2):
        for call in _allreduces(4, 1 << 20, 6, loss=0.01, seed=seed):
            assert all(stats["ends_sent"] == 18 for stats in call), [stats["ends_sent"] for stats in call]


def test_bursts_after_a_clean_stretch_keep_one_outcome():
    """Bursts (Gilbert-Elliott: long clean stretches, then 80% loss) hit calls whose ENDs already go
    in fewer copies, as a real network's first burst after a quiet hour would: a step that lost a
    chunk may have lost its only END too. In every call every rank still returns the same status
    and the same agreed fractions."""
    hit = 0
    for seed in (1, 3):
        rows = _native.simulate(16, _native.COLLECTIVE_ALLREDUCE, _native.ALGORITHM_DIRECT, 1024, CHUNK_BYTES, 80,
                                deadline_s=5.0, loss_budget=1.0, loss_kind=_native.LOSS_GILBERT_ELLIOTT,
                                good_to_bad=0.002, bad_to_good=0.3, loss_in_good=0.0, loss_in_bad=0.8, seed=seed)
        for call in rows:
            assert len({status for status, _, _, _ in call}) == 1
            assert len({(stats["reduce_fraction"], stats["gather_fraction"]) for _, stats, _, _ in call}) == 1
            lossy = any(stats["chunks_lost"] for _, stats, _, _ in call)
            hit += lossy and any(stats["ends_sent"] < 45 for _, stats, _, _ in call)
    assert hit > 0  # some bursts did meet ENDs in fewer than three copies
