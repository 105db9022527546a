"""A rank that the credit window holds back waits for the next credit instead of spinning.

With a window smaller than one step, the credit walk gives it all to the earliest open step, and
the senders of later steps get none until that step closes. The loop's wake-up time counted each
such sender's credit refresh from its last grant (none yet), which lay in the past, so the loop
made pass after empty pass: on the direct schedule at 4 ranks, 86,000-573,000 credit stalls and
40,000-200,000 idle passes in a call of 588 chunks that took 50-150 ms. Counted, not timed: a
rank that waits makes a few passes per arrival and per refresh interval."""
import numpy as np
import pytest

import tasks
from conftest import get_cluster

PASSES_PER_CHUNK = 20  # far above a waiting rank's count (under 1 here), far below a spinning one's (hundreds)


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_a_rank_held_back_by_the_window_waits_instead_of_spinning(algorithm):
    cluster = get_cluster(4, chunk_bytes=1024, window_bytes=16 * 1024)
    per_rank = cluster.run(tasks.calls_with_copies, "allreduce", 100_000, 3, 1, algorithm, 20.0)
    for rank, rows in enumerate(per_rank):
        for output, want, stats in rows:
            np.testing.assert_array_equal(output, want)
            bound = PASSES_PER_CHUNK * stats.chunks_total
            assert stats.credit_stalls < bound and stats.idle_waits < bound, (
                f"rank {rank}: {stats.credit_stalls} credit stalls and {stats.idle_waits} idle passes "
                f"for {stats.chunks_total} chunks")
