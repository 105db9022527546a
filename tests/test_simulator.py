"""The simulator runs the engine itself (many engines in one process on a
virtual clock, over an in-memory network): exact without loss, and at N=4 and
8 its delivered fractions agree with real multi-process runs within sampling
error; 1024 ranks run on this machine."""
import numpy as np
import pytest

import tasks
import ud_transport
from conftest import get_cluster
from support import DELIVERED_FRACTION
from ud_transport import _native

ALGORITHMS = {"ring": _native.ALGORITHM_RING, "direct": _native.ALGORITHM_DIRECT}


def simulate(world, algorithm, calls, loss=0.0, count=None, **keywords):
    count = count if count is not None else world * 40 + 3
    parameters = dict(loss_kind=1, loss=loss) if loss else {}
    return _native.simulate(world, _native.COLLECTIVE_ALLREDUCE, ALGORITHMS[algorithm], count, 64, calls, **parameters,
                            **keywords)


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_exact_without_loss(world, algorithm):
    for call in simulate(world, algorithm, calls=3, count=world * 40 + 3):
        for status, stats, error_sum, error_squares in call:
            assert status == 0 and stats["delivered_fraction"] == 1.0 and stats["chunks_lost"] == 0
            assert error_squares < 1e-20  # the sum of float64 inputs, exact up to summation order


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world", [4, 8])
def test_agrees_with_real_runs(world, algorithm):
    loss, calls, count = 0.1, 30, 240 * world // 4
    simulated = np.array([[rank[1]["delivered_fraction"] for rank in call]
                          for call in simulate(world, algorithm, calls, loss=loss, count=count, loss_budget=1.0, seed=world)])
    cluster = get_cluster(world, chunk_bytes=64, inject=ud_transport.Bernoulli(loss, seed=3 * world))
    runs = cluster.run(tasks.repeated_trials, count, calls, 1.0, "unbiased", 9, algorithm)
    real = np.array([r[2] for r in runs])
    # standard errors from the per-call means over ranks (ranks of one call are correlated)
    sim_calls, real_calls = simulated.mean(axis=1), real.mean(axis=0)
    difference = sim_calls.mean() - real_calls.mean()
    standard_error = np.sqrt(sim_calls.var(ddof=1) / len(sim_calls) + real_calls.var(ddof=1) / len(real_calls))
    assert abs(difference) < 4 * standard_error + 0.005, (sim_calls.mean(), real_calls.mean(), standard_error)
    # and both sit on the closed-form model
    assert abs(sim_calls.mean() - DELIVERED_FRACTION[algorithm](world, loss)) < 4 * sim_calls.std(ddof=1) / np.sqrt(calls) + 0.01


def test_a_thousand_ranks():
    rows = simulate(1024, "direct", calls=1, loss=0.01, count=1024 * 16, loss_budget=0.1)  # about a minute on 2 cores
    statuses = {rank[0] for rank in rows[0]}
    stats = rows[0][0][1]
    assert statuses == {0}, statuses  # one verdict: all succeed
    assert stats["reduce_fraction"] > 0.985 and stats["gather_fraction"] > 0.9, stats
