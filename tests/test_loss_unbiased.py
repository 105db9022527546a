"""Under injected random loss the result is an unbiased estimate of the exact
sum, and the same statistical test rejects the zero-fill estimator.

Two checks, both honest about what "unbiased" can mean:
- fixed inputs that differ per rank: the mean over trials of the ranks'
  average result sits within a few standard errors of the true sum. (A single
  rank cannot be unbiased for fixed inputs: a rank that receives nothing can
  only rescale its own input. The README explains.)
- inputs drawn afresh each trial, independently per rank, as gradients are:
  every rank's own result is unbiased.
"""
import numpy as np
import pytest

import tasks
from conftest import get_cluster

WORLD = 4
COUNT = 240
CHUNK_BYTES = 32  # 4 float64 per datagram: 60 datagrams per segment hop
Z_LIMIT = 4.0


def z_score(samples):
    samples = np.asarray(samples)
    standard_error = samples.std(ddof=1) / np.sqrt(len(samples))
    return samples.mean() / standard_error if standard_error > 0 else np.inf * np.sign(samples.mean())


def lossy_cluster(loss):
    import ud_transport

    return get_cluster(WORLD, chunk_bytes=CHUNK_BYTES, inject=ud_transport.Bernoulli(loss, seed=11))


def fixed_inputs():
    element = np.arange(COUNT)
    return [((rank + 1) * (1.0 + element % 5) + 3 * rank).astype(np.float64) for rank in range(WORLD)]


@pytest.mark.parametrize("loss,trials", [(0.1, 160), (0.3, 160)])
def test_fixed_inputs_unbiased_and_zero_fill_rejected(loss, trials):
    cluster = lossy_cluster(loss)
    inputs = fixed_inputs()
    truth = sum(inputs)
    per_estimator = {}
    for estimator in ("unbiased", "zero_fill"):
        runs = cluster.run(tasks.repeated_trials, inputs, trials, 1.0, estimator)
        results = np.array([r[0] for r in runs])  # rank, trial, element
        fractions = np.array([r[2] for r in runs])
        relative_error = ((results.mean(axis=0) - truth) / truth).mean(axis=1)  # per trial
        per_estimator[estimator] = (z_score(relative_error), relative_error.mean(), fractions.mean())
    z, bias, delivered = per_estimator["unbiased"]
    assert abs(z) < Z_LIMIT, f"unbiased estimator rejected: mean relative error {bias:.4f}, z = {z:.2f}"
    assert delivered < 1.0 - loss / 2, "loss was injected, so contributions must be missing"
    z0, bias0, _ = per_estimator["zero_fill"]
    assert abs(z0) > 10 * Z_LIMIT and bias0 < -loss / 2, f"zero fill not rejected: bias {bias0:.4f}, z = {z0:.2f}"


def test_each_rank_unbiased_for_exchangeable_inputs():
    cluster = lossy_cluster(0.3)
    trials = 160
    outcome = {}
    for estimator in ("unbiased", "zero_fill"):
        runs = cluster.run(tasks.repeated_trials, COUNT, trials, 1.0, estimator, 5)
        inputs = np.array([r[1] for r in runs])  # rank, trial, element
        truth = inputs.sum(axis=0)
        outcome[estimator] = [z_score((runs[rank][0] - truth).mean(axis=1)) for rank in range(WORLD)]
    assert all(abs(z) < Z_LIMIT for z in outcome["unbiased"]), outcome["unbiased"]
    assert all(z < -Z_LIMIT for z in outcome["zero_fill"]), outcome["zero_fill"]


def expected_delivered_fraction(world, loss):
    """Contributions present per element under i.i.d. datagram loss, averaged
    over ranks: reduce-scatter keeps the run of hops since the last loss; a
    rank that misses the all-gather keeps its own partial."""
    q = 1.0 - loss
    total = 0.0
    for distance in range(world):  # all-gather hops from the owner to this rank
        owner_count = sum(q ** k for k in range(world))  # E[contributions at the owner]
        reached = q ** distance
        # the chain of a segment starts at the rank just after its owner (distance 1), so the
        # rank at distance d >= 1 held a partial of d hops; the owner itself never misses
        own_count = sum(q ** k for k in range(distance))
        total += reached * owner_count + (1 - reached) * own_count
    return total / (world * world)


def test_delivered_fraction_matches_the_loss_model():
    loss = 0.3
    cluster = lossy_cluster(loss)
    runs = cluster.run(tasks.repeated_trials, fixed_inputs(), 120, 1.0, "unbiased")
    measured = np.mean([r[2] for r in runs])
    want = expected_delivered_fraction(WORLD, loss)
    assert abs(measured - want) < 0.01, f"delivered {measured:.3f}, model predicts {want:.3f}"
