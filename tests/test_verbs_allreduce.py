"""Allreduce over RDMA UD (the verbs transport) on SoftRoCE.

One guest, ranks sharing rxe0: world sizes 2, 3 and 4 exact at zero loss, a full-MTU call that
delivers 100%, device options (tests/verbs_guest/guest_allreduce.py, in the boot shared by the
verbs test files). Two guests x two ranks with 10% netem loss on the link between them: every
call finishes within its deadline, the estimate is unbiased (and the zero-fill baseline is
not), and the delivered fraction and chunk loss of every rank match the loss model of the ring.
"""
import itertools
import sys

import numpy as np
import pytest

from verbs_guest import rig_session

WORLD = 4
CROSSING_HOPS = {(1, 2), (3, 0)}  # ranks 0,1 on one guest and 2,3 on the other
NETEM_LOSS = 0.10
TRIALS = 60


def ring_model(world, lossy_hops, loss):
    """Expected delivered fraction (unbiased and zero-fill) and chunk loss of each rank when each
    datagram crossing a lossy hop is lost with probability `loss`: enumerates every outcome of
    the 2(N-1) hops a chunk takes (reduce-scatter from its first sender to its owner, then
    all-gather from the owner), for each of the N positions a chunk can start at."""
    unbiased, zero_fill, lost = [0.0] * world, [0.0] * world, [0.0] * world
    for start in range(world):
        owner = (start + world - 1) % world
        rs = [((start + k - 1) % world, (start + k) % world) for k in range(1, world)]
        ag = [((owner + k - 1) % world, (owner + k) % world) for k in range(1, world)]
        for outcome in itertools.product((True, False), repeat=2 * (world - 1)):
            weight = 1.0
            for hop, arrived in zip(rs + ag, outcome):
                p = loss if hop in lossy_hops else 0.0
                weight *= (1 - p) if arrived else p
            if weight == 0.0:
                continue
            count = {start: 1}  # contributions summed at each rank in reduce-scatter
            for (source, target), arrived in zip(rs, outcome):
                count[target] = count[source] + 1 if arrived else 1
                lost[target] += 0.0 if arrived else weight
            has = {owner: True}  # did the owner's estimate reach this rank in all-gather
            for (source, target), arrived in zip(ag, outcome[world - 1:]):
                has[target] = has[source] and arrived
                lost[target] += 0.0 if has[target] else weight
            for rank in range(world):
                unbiased[rank] += weight * (count[owner] if has[rank] else count[rank]) / world / world
                zero_fill[rank] += weight * (count[owner] if has[rank] else 0) / world / world
    steps = 2 * (world - 1)
    return unbiased, zero_fill, [x / steps for x in lost]


def test_ring_model_is_exact_without_loss_and_drops_with_it():
    unbiased, zero_fill, lost = ring_model(4, CROSSING_HOPS, 0.0)
    assert unbiased == zero_fill == [1.0] * 4 and lost == [0.0] * 4
    unbiased, zero_fill, lost = ring_model(4, CROSSING_HOPS, 0.1)
    assert unbiased[0] == pytest.approx(0.8861875) and unbiased[1] == pytest.approx(0.9105625)
    assert all(z < u for z, u in zip(zero_fill, unbiased)) and lost[0] > lost[1] > 0


@pytest.mark.rig
def test_allreduce_in_the_softroce_guest():
    rig_session.single_guest_run().check_file("guest_allreduce.py", minimum_tests=8)


@pytest.mark.rig
def test_two_guests_two_ranks_each_with_10_percent_netem_loss():
    ranks, statuses, seconds, output = rig_session.two_guest_run(TRIALS, netem_loss=f"{NETEM_LOSS:.0%}")
    tail = "\n".join(output.splitlines()[-40:])
    assert statuses == [0, 0] and sorted(ranks) == [0, 1, 2, 3], f"statuses {statuses}:\n{tail}"
    print(f"two guests: {TRIALS} allreduces x 4 ranks in {seconds:.1f} s (boot included)", file=sys.stderr)
    model = dict(zip(("unbiased", "zero_fill"), ring_model(WORLD, CROSSING_HOPS, NETEM_LOSS)[:2]))
    model_lost = ring_model(WORLD, CROSSING_HOPS, NETEM_LOSS)[2]
    for rank, result in ranks.items():
        assert result["transport"] == "verbs"
        rows = result["rows"]
        assert len(rows) == TRIALS
        for row in rows:  # bounded time: every call returned, before its deadline
            assert not row["deadline_expired"] and row["elapsed_s"] < row["deadline_s"], row
        for estimator in ("unbiased", "zero_fill"):
            chosen = [r for r in rows if r["estimator"] == estimator]
            errors = np.array([r["mean_error"] for r in chosen])
            z = errors.mean() / (errors.std(ddof=1) / np.sqrt(len(errors)))
            fractions = np.array([r["delivered_fraction"] for r in chosen])
            standard_error = fractions.std(ddof=1) / np.sqrt(len(fractions))
            where = f"rank {rank} {estimator}: z {z:.2f}, delivered {fractions.mean():.4f} ± {standard_error:.4f}"
            if estimator == "unbiased":
                assert abs(z) < 4.0, where  # the mean error is zero within its standard error
            else:
                assert z < -6.0, where  # the negative control: zero-fill is visibly biased low
            assert abs(fractions.mean() - model[estimator][rank]) < 4 * standard_error + 0.01, \
                f"{where}, model {model[estimator][rank]:.4f}"
            assert 0.5 < fractions.min() and fractions.max() < 1.0, where
        lost = np.array([r["chunks_lost"] / r["chunks_total"] for r in rows])
        standard_error = lost.std(ddof=1) / np.sqrt(len(lost))
        assert abs(lost.mean() - model_lost[rank]) < 4 * standard_error + 0.01, \
            f"rank {rank}: chunk loss {lost.mean():.4f} ± {standard_error:.4f}, model {model_lost[rank]:.4f}"
