"""Stripes (Options.stripes): a large allreduce or broadcast split over several sockets and
threads per rank, run at once, with one outcome. Exact without loss in every dtype and with
uneven splits; small and sharded calls stay on one stripe; under loss every rank agrees on
each call's merged verdict; and when one stripe fails while another succeeds, the whole
tensor is put back (the successful stripe is vetoed)."""
import pytest

import stripe_tasks
import ud_transport
from conftest import get_cluster
from ud_transport.options import STRIPE_MIN_BYTES, Options, build, check_stripes

ELEMENT_BYTES = {"float32": 4, "float64": 8, "int32": 4, "bfloat16": 2}


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("world, stripes", [(2, 2), (3, 3)])
def test_striped_calls_are_exact(world, stripes, in_place):
    # in place: summed in the caller's tensor (originals saved); else in the scratch
    cluster = get_cluster(world, stripes=stripes, in_place_min_bytes=0 if in_place else 1 << 40)
    for dtype, element_bytes in ELEMENT_BYTES.items():
        count = stripes * STRIPE_MIN_BYTES // element_bytes + 7  # uneven: stripes differ by an element
        for rank, result in enumerate(cluster.run(stripe_tasks.striped_results, count, dtype, stripes * STRIPE_MIN_BYTES // 4 + 3)):
            used, chunks, delivered, error, broadcast_stripes, broadcast_error = result
            assert (used, broadcast_stripes) == (stripes, stripes), (dtype, rank, result)
            assert error == 0 and broadcast_error == 0 and delivered == 1.0, (dtype, rank, result)
            assert chunks > 0


def test_small_and_sharded_calls_run_on_one_stripe():
    cluster = get_cluster(2, stripes=2)
    for small, scattered, gathered, right in cluster.run(stripe_tasks.unstriped_collectives, 4 * STRIPE_MIN_BYTES // 4):
        assert (small, scattered, gathered) == (1, 1, 1) and right


def test_every_rank_agrees_on_merged_stats_under_loss():
    cluster = get_cluster(3, stripes=2, chunk_bytes=8192, inject=ud_transport.Bernoulli(0.02, seed=5))
    per_rank = cluster.run(stripe_tasks.lossy_agreed_stats, 8, 2 * STRIPE_MIN_BYTES // 4 + 3)
    for call in range(8):
        shared = {tuple(rank[call][:5]) for rank in per_rank}
        assert len(shared) == 1, (call, [rank[call] for rank in per_rank])
        stripes, reduce_fraction, gather_fraction, vetoed, finite = shared.pop()
        assert stripes == 2 and vetoed == 0 and finite
        assert 0.9 < reduce_fraction <= 1.0 and 0.8 < gather_fraction <= 1.0
    for rank in per_rank:  # loss was injected and merged: summed over the calls, so no call needs any
        assert sum(call[5] for call in rank) > 0 and sum(call[6] for call in rank) > 0


def test_a_failed_stripe_puts_the_whole_tensor_back():
    # About one datagram in 100 lost, budget 0: a stripe fails when any of its ~64 datagrams is
    # lost, so some calls have one stripe whole (vetoed) and the other failed.
    # In place, so the stripes that succeeded have changed the caller's tensor before the veto.
    cluster = get_cluster(2, stripes=2, chunk_bytes=32768, in_place_min_bytes=0, inject=ud_transport.Bernoulli(0.01, seed=3))
    per_rank = cluster.run(stripe_tasks.put_back_when_a_stripe_fails, 40, 2 * STRIPE_MIN_BYTES // 4 + 5)
    assert per_rank[0] == per_rank[1]  # one outcome per call on every rank
    outcomes = per_rank[0]
    assert all(kept for _, _, kept in outcomes), outcomes
    assert any(outcome == "loss" and vetoed == 1 for outcome, vetoed, _ in outcomes), outcomes
    assert any(outcome == "ok" for outcome, _, _ in outcomes), outcomes


def test_ranks_that_disagree_on_striping_fail_at_once_and_stay_in_step():
    # One rank's call is large enough to stripe, the other's is not: a layout mismatch that only
    # stripe 0 can see. The striped rank must not wait out the join timeout on its other stripes
    # (the run's timeout is shorter), and the next calls, alike on every rank, must be exact.
    cluster = get_cluster(2, stripes=2, join_timeout_s=120.0)
    for rank, outcomes in enumerate(cluster.run(stripe_tasks.mismatch_then_matching, 2 * STRIPE_MIN_BYTES // 4 + 9,
                                                timeout_s=60)):
        assert outcomes == ["mismatch", "exact", "mismatch", "exact"], (rank, outcomes)


def test_stripes_option_is_checked():
    assert Options(stripes=4).validate().stripes == 4
    for wrong in (0, -1, ud_transport._native.MAX_STRIPES + 1, True, 2.0):
        with pytest.raises(ValueError, match="stripes"):
            Options(stripes=wrong).validate()
    with pytest.raises(ValueError, match="UDP"):
        check_stripes(2, "verbs")
    assert check_stripes(1, "verbs") == 1


def test_stripes_from_the_environment(monkeypatch):
    monkeypatch.setenv("UD_STRIPES", "3")
    assert build().stripes == 3
    assert build(stripes=2).stripes == 2  # keywords win
