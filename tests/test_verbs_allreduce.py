"""Allreduce over RDMA UD (the verbs transport) on SoftRoCE.

One guest, ranks sharing rxe0: world sizes 2, 3 and 4 exact at zero loss, a full-MTU call that
delivers 100%, device options, a soak that leaves no verbs object behind
(tests/verbs_guest/guest_allreduce.py, in the boot shared by the
verbs test files). Two guests x two ranks with 10% netem loss on the link between them: every
call finishes within its deadline, the estimate is unbiased (and the zero-fill baseline is
not), and the delivered fraction and chunk loss of every rank match the loss model of the ring.
"""
import sys

import numpy as np
import pytest

from support import ring_enumerated, standard_error, z_score
from verbs_guest import rig_session

WORLD = 4
CROSSING_HOPS = {(1, 2), (3, 0)}  # ranks 0,1 on one guest and 2,3 on the other
NETEM_LOSS = 0.10
TRIALS = 60


@pytest.mark.rig
def test_allreduce_in_the_softroce_guest():
    rig_session.single_guest_run().check_file("guest_allreduce.py", minimum_tests=14)


@pytest.mark.rig
def test_two_guests_two_ranks_each_with_10_percent_netem_loss():
    ranks, statuses, seconds, output = rig_session.two_guest_run(TRIALS, netem_loss=f"{NETEM_LOSS:.0%}")
    # each guest's own last lines: one node's traceback must not push the other's out of view
    lines = output.splitlines()
    tail = "\n".join(line for node in ("[node0]", "[node1]", "")
                     for line in [l for l in lines if l.startswith(node) and (node or not l.startswith("[node"))][-30:])
    assert statuses == [0, 0] and sorted(ranks) == [0, 1, 2, 3], f"statuses {statuses}:\n{tail}"
    print(f"two guests: {TRIALS} allreduces x 4 ranks in {seconds:.1f} s (boot included)", file=sys.stderr)
    unbiased, zero_fill, model_lost = ring_enumerated(WORLD, NETEM_LOSS, CROSSING_HOPS)
    model = {"unbiased": unbiased, "zero_fill": zero_fill}
    for rank, result in ranks.items():
        assert result["transport"] == "verbs"
        rows = result["rows"]
        assert len(rows) == TRIALS
        for row in rows:  # bounded time: every call returned, before its deadline
            assert not row["deadline_expired"] and row["elapsed_s"] < row["deadline_s"], row
        for estimator in ("unbiased", "zero_fill"):
            chosen = [r for r in rows if r["estimator"] == estimator]
            errors = np.array([r["mean_error"] for r in chosen])
            z = z_score(errors)
            fractions = np.array([r["delivered_fraction"] for r in chosen])
            error = standard_error(fractions)
            where = f"rank {rank} {estimator}: z {z:.2f}, delivered {fractions.mean():.4f} ± {error:.4f}"
            if estimator == "unbiased":
                assert abs(z) < 4.0, where  # the mean error is zero within its standard error
            else:
                assert z < -6.0, where  # the negative control: zero-fill is visibly biased low
            assert abs(fractions.mean() - model[estimator][rank]) < 4 * error + 0.01, \
                f"{where}, model {model[estimator][rank]:.4f}"
            assert 0.5 < fractions.min() and fractions.max() < 1.0, where
        lost = np.array([r["chunks_lost"] / r["chunks_total"] for r in rows])
        error = standard_error(lost)
        assert abs(lost.mean() - model_lost[rank]) < 4 * error + 0.01, \
            f"rank {rank}: chunk loss {lost.mean():.4f} ± {error:.4f}, model {model_lost[rank]:.4f}"
