"""Bounded time and bounded loss: loss beyond the budget gives
LossBudgetExceeded and the caller's tensor keeps its values; bursts do not
hold a call past its deadline; a late rank is waited for (ranks that die,
pause or never come: test_faults.py)."""
import numpy as np
import pytest

import tasks
import ud_transport
from conftest import get_cluster
from support import rescaled_marks

DEADLINE = 2.0
LOSSY_WORLD = 3
LOSSY = {"chunk_bytes": 64, "inject": ud_transport.Bernoulli(0.3, seed=3)}  # 30% of the datagrams lost


def test_loss_beyond_budget_raises_and_keeps_the_input():
    cluster = get_cluster(LOSSY_WORLD, **LOSSY)
    outcomes = cluster.run(tasks.allreduce_catching, 2000, 0.05, 5.0)
    for unchanged, error, _ in outcomes:
        assert isinstance(error, ud_transport.LossBudgetExceeded), repr(error)
        assert error.stats.delivered_fraction < 0.95 and error.stats.chunks_lost > 0
        assert unchanged


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("in_place_min_bytes, in_place, chunk_bytes, count",
                         [(0, True, 64, 3000), (0, True, 8192, 30000), (1 << 40, False, 64, 3000)])
def test_a_failed_allreduce_puts_back_the_very_bytes(dtype, in_place_min_bytes, in_place, chunk_bytes, count):
    """In place, an allreduce works in the caller's tensor and saves each chunk's original before
    its first write (with stores that bypass the cache, as are final values of 4 KiB and more:
    the 8 KiB chunks); otherwise it sums in the scratch. When it fails after data arrived and was
    summed in (loss beyond a zero budget), every byte comes back either way: NaN payloads, -0.0
    and subnormals included."""
    options = dict(LOSSY, chunk_bytes=chunk_bytes)
    cluster = get_cluster(LOSSY_WORLD, in_place_min_bytes=in_place_min_bytes, **options)
    for same, error in cluster.run(tasks.allreduce_restoring_bytes, count, dtype, 0.0, 5.0):
        assert isinstance(error, ud_transport.LossBudgetExceeded), repr(error)
        assert error.stats.datagrams_received > 0, error.stats  # summed in before the verdict
        assert error.stats.in_place is in_place, error.stats
        assert same


def test_within_budget_succeeds_under_the_same_loss():
    """Budget 0.9 under the loss at which a budget of 0.05 fails (above): every
    rank succeeds with the same agreed fractions, both within the budget and
    below 1 (the loss was real); every element is the rescaled sum of the
    contributions that reached it, and those contributions, counted over the
    elements, are the delivered fraction the rank reports. Rank r's input is
    index + 2**r, so element i holds N*i + N/|S| * (sum of 2**r over S), a
    value of its own for every set S of ranks whose contributions it holds."""
    world, count, budget = LOSSY_WORLD, 2000, 0.9
    marks = rescaled_marks(world)  # {what N/|S| * sum(2**r) comes to: S}
    possible = np.array(sorted(marks))
    cluster = get_cluster(world, **LOSSY)
    outcomes = cluster.run(tasks.allreduce_within_budget, count, budget, 5.0)
    for rank, (result, stats) in enumerate(outcomes):
        assert result is not None, f"rank {rank}: {stats!r}"
    agreed = (outcomes[0][1].reduce_fraction, outcomes[0][1].gather_fraction)
    for rank, (result, stats) in enumerate(outcomes):
        assert (stats.reduce_fraction, stats.gather_fraction) == agreed, f"rank {rank}: {stats}"
        assert 1 - budget <= stats.reduce_fraction < 1 and 1 - budget <= stats.gather_fraction < 1, stats
        assert stats.chunks_lost > 0 and stats.delivered_fraction < 1, stats
        offset = result.astype(np.float64) - world * np.arange(count)
        nearest = possible[np.abs(offset[:, None] - possible[None, :]).argmin(axis=1)]
        np.testing.assert_allclose(offset, nearest, atol=1e-3, err_msg=f"rank {rank}: not a rescaled sum of whole inputs")
        present = np.array([len(marks[value]) for value in nearest])  # contributions each element holds
        assert present.min() < world, f"rank {rank}: nothing was missing anywhere"
        assert present.mean() / world == pytest.approx(stats.delivered_fraction, abs=1e-9), \
            f"rank {rank}: its elements hold {present.mean() / world:.6f} of the contributions, it reports {stats}"


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("how", ["budget", "layout"])
@pytest.mark.parametrize("in_place_min_bytes", [0, -1])
def test_every_collective_keeps_its_tensors_on_error(how, algorithm, in_place_min_bytes):
    """allreduce, reduce_scatter, all_gather, broadcast and all_to_all that fail
    (loss over a zero budget at 30% loss; ranks calling with different sizes or
    roots) raise the same error on every rank and leave the tensor, and for
    reduce_scatter, all_gather and all_to_all the input and the output,
    untouched; the allreduce summing in place and in the scratch."""
    if how == "budget":
        cluster = get_cluster(LOSSY_WORLD, in_place_min_bytes=in_place_min_bytes, **LOSSY)
        want = "LossBudgetExceeded"
    else:
        cluster = get_cluster(3, chunk_bytes=256, in_place_min_bytes=in_place_min_bytes)
        want = "LayoutMismatch"
    per_rank = cluster.run(tasks.every_collective_failing, 2000, algorithm, how)
    for collective in per_rank[0]:
        outcomes = [outcome[collective] for outcome in per_rank]
        assert {name for name, _, _ in outcomes} == {want}, (collective, outcomes)
        assert len({rank for _, rank, _ in outcomes}) == 1, (collective, outcomes)  # one culprit named everywhere
        assert all(unchanged for _, _, unchanged in outcomes), (collective, outcomes)


def test_bursts_finish_within_deadline():
    """Gilbert-Elliott microbursts (90% loss in the bad state): every call still
    returns by its deadline, and lost end markers do not make every step wait
    out its share of it."""
    bursts = ud_transport.GilbertElliott(good_to_bad=0.02, bad_to_good=0.1, loss_in_good=0.0, loss_in_bad=0.9, seed=5)
    cluster = get_cluster(4, chunk_bytes=128, inject=bursts)
    runs = cluster.run(tasks.repeated_trials, 4000, 20, 1.0, "unbiased", 9)
    for results, inputs, fractions in runs:
        assert np.all(np.isfinite(results))
        assert 0.0 < fractions.min() and fractions.mean() < 1.0
    timings = cluster.run(tasks.allreduce_catching, 4000, 1.0, DEADLINE)
    for _, error, elapsed in timings:
        assert error is None and elapsed <= DEADLINE + 1.0


def test_a_late_rank_is_not_a_silent_rank():
    """A rank that joins a call late, but well within the deadline, is waited
    for: no PeerTimeout, nothing lost."""
    cluster = get_cluster(3, chunk_bytes=256)
    for exact, delivered in cluster.run(tasks.late_allreduce, 2, 0.8, 4.0):
        assert exact and delivered == 1.0


def test_ranks_calling_with_different_sizes_get_layout_mismatch():
    """Every rank calls with another size: all of them raise LayoutMismatch
    naming the same rank (one verdict), and keep their tensors."""
    cluster = get_cluster(3, chunk_bytes=256)
    outcomes = cluster.run(tasks.mismatched_allreduce, 1.0)
    for error, unchanged in outcomes:
        assert isinstance(error, ud_transport.LayoutMismatch), repr(error)
        assert unchanged
    assert len({error.rank for error, _ in outcomes}) == 1 and 0 <= outcomes[0][0].rank < 3
    # the communicator is still usable afterwards
    for exact, delivered in cluster.run(tasks.late_allreduce, 0, 0.0, 5.0):
        assert exact and delivered == 1.0


def test_on_miss_return_writes_the_estimate_and_says_it_missed():
    """The budget's one rule, with the choice of what a miss does (issue 40): on_miss="raise"
    fails the call and keeps the tensor; on_miss="return" writes the estimate and returns with
    stats.budget_missed set, on every rank alike; a call within budget says it did not miss."""
    cluster = get_cluster(LOSSY_WORLD, **LOSSY)
    for name, changed in (("LossBudgetExceeded", False), ("OK", True)):
        on_miss = "raise" if name != "OK" else "return"
        for outcome, missed, unchanged in cluster.run(tasks.allreduce_on_miss, 2000, 0.05, on_miss, 5.0):
            assert (outcome, missed, unchanged) == (name, True, not changed), (on_miss, outcome, missed, unchanged)
    for outcome, missed, unchanged in cluster.run(tasks.allreduce_on_miss, 2000, 1.0, "return", 5.0):
        assert (outcome, missed, unchanged) == ("OK", False, False)


def test_ranks_that_disagree_on_what_a_miss_does_fail_alike():
    """on_miss is part of the layout: ranks that would judge a miss differently (one raising, one
    returning) would return different statuses, so the call is a LayoutMismatch everywhere."""
    cluster = get_cluster(LOSSY_WORLD, **LOSSY)
    outcomes = cluster.run(tasks.allreduce_on_miss, 2000, 0.05, ["raise", "return", "raise"], 5.0)
    assert {outcome for outcome, _, _ in outcomes} == {"LayoutMismatch"}, outcomes
    assert all(unchanged for _, _, unchanged in outcomes)


def test_the_budget_rule_is_the_engines():
    from ud_transport import _native

    assert not _native.budget_missed(0.9, 1.0, 0.1)
    assert _native.budget_missed(0.89, 1.0, 0.1) and _native.budget_missed(1.0, 0.89, 0.1)
    assert not _native.budget_missed(1.0, 1.0, 0.0) and _native.budget_missed(0.999, 1.0, 0.0)
    # a budget of 0 has no tolerance: one contribution of 4 * 2^40 missing is a miss
    one_missing = 1.0 - 1.0 / (4 * 2**40)
    assert one_missing < 1.0 and _native.budget_missed(one_missing, 1.0, 0.0) and _native.budget_missed(1.0, one_missing, 0.0)
    assert not _native.budget_missed(one_missing, 1.0, 1e-9)
