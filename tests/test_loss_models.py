"""The closed-form delivered-fraction models (the tests against real runs use
them) agree with an exact enumeration of every loss pattern of the same model
for small worlds, and with a Monte Carlo of it, datagram by datagram."""
import pytest

from support import DELIVERED_FRACTION, ENUMERATED, ring_enumerated, simulate_delivered_fraction

LOSSES = [0.0, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_closed_form_equals_the_enumeration_of_every_loss_pattern_on_every_rank(algorithm, world):
    for loss in LOSSES:
        closed = DELIVERED_FRACTION[algorithm](world, loss)
        unbiased, zero_fill, lost = ENUMERATED[algorithm](world, loss)
        assert len(unbiased) == world
        for rank, fraction in enumerate(unbiased):
            assert fraction == pytest.approx(closed, rel=1e-12, abs=1e-12), (loss, rank, unbiased, closed)
        # zero fill never keeps more than the unbiased estimator, and nothing is missing without loss
        assert all(z <= u + 1e-12 for z, u in zip(zero_fill, unbiased)), (loss, zero_fill, unbiased)
        if loss == 0.0:
            assert unbiased == zero_fill == [1.0] * world and lost == [0.0] * world


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_direct_loses_each_chunk_a_rank_receives_with_the_datagram_loss(world):
    """Direct's chunks travel one hop each: a rank's expected lost share is the loss rate."""
    for loss in LOSSES:
        assert ENUMERATED["direct"](world, loss)[2] == pytest.approx([loss] * world, abs=1e-12)


def test_ring_with_only_the_crossing_hops_lossy():
    """The model test_verbs_allreduce.py holds two guests to: ranks 0,1 on one guest and 2,3 on
    the other, loss only on the hops 1->2 and 3->0 that cross between them."""
    crossing = {(1, 2), (3, 0)}
    unbiased, zero_fill, lost = ring_enumerated(4, 0.0, crossing)
    assert unbiased == zero_fill == [1.0] * 4 and lost == [0.0] * 4
    unbiased, zero_fill, lost = ring_enumerated(4, 0.1, crossing)
    assert unbiased[0] == pytest.approx(0.8861875) and unbiased[1] == pytest.approx(0.9105625)
    assert all(z < u for z, u in zip(zero_fill, unbiased)) and lost[0] > lost[1] > 0
    # every hop lossy is the closed form again
    assert ring_enumerated(4, 0.1, {(r, (r + 1) % 4) for r in range(4)})[0] == pytest.approx(
        [DELIVERED_FRACTION["ring"](4, 0.1)] * 4)


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world,loss", [(2, 0.1), (4, 0.1), (4, 0.3), (8, 0.1)])
def test_closed_form_matches_monte_carlo(algorithm, world, loss):
    mean, standard_error = simulate_delivered_fraction(algorithm, world, loss, trials=3000, seed=world)
    closed = DELIVERED_FRACTION[algorithm](world, loss)
    assert abs(mean - closed) < 4 * standard_error, (mean, standard_error, closed)
