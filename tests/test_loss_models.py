"""The closed-form delivered-fraction models agree with a Monte Carlo of the
same model, datagram by datagram (the tests against real runs use the closed
forms)."""
import pytest

from support import DELIVERED_FRACTION, simulate_delivered_fraction


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world,loss", [(2, 0.1), (4, 0.1), (4, 0.3), (8, 0.1)])
def test_closed_form_matches_monte_carlo(algorithm, world, loss):
    mean, standard_error = simulate_delivered_fraction(algorithm, world, loss, trials=3000, seed=world)
    closed = DELIVERED_FRACTION[algorithm](world, loss)
    assert abs(mean - closed) < 4 * standard_error, (mean, standard_error, closed)
