"""A sender that is alive but has not reached our step yet is waited for, not read as loss.

On the direct schedule a rank serves its peers in turn, and a rank that starts a call late finds
every peer's data for it queued behind their other work. A receiver used to close a step at its
share of the deadline once the sender had been heard from (its credits kept coming) and nothing had
arrived for the step, then dropped the whole block as stale when it came: at 8 ranks on a bridge
with no loss injected, 39 of 100 calls were not whole. Now a receiver past the share asks the
sender (a JOIN request) how far its sending has come, and closes the step only once the sender
says it is done with it. The simulator runs the real engines with every sender paced (each data
datagram costs its sender virtual time) and one rank starting late."""
import pytest

from ud_transport import _native

ALGORITHMS = {"ring": _native.ALGORITHM_RING, "direct": _native.ALGORITHM_DIRECT}
WORLD, CHUNK_BYTES = 8, 1024
SEND_NS_PER_DATAGRAM = 50_000  # a CPU-bound sender: 20,000 datagrams a second


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
@pytest.mark.parametrize("late_start_s, deadline_s", [(0.05, 0.15), (0.3, 0.15), (0.3, 1.0)])
def test_a_sender_busy_with_other_peers_is_waited_for(algorithm, late_start_s, deadline_s):
    count = WORLD * 16384  # float64: 128 chunks a block
    rows = _native.simulate(WORLD, _native.COLLECTIVE_ALLREDUCE, ALGORITHMS[algorithm], count, CHUNK_BYTES, 2,
                            deadline_s=deadline_s, loss_budget=1.0, send_ns_per_datagram=SEND_NS_PER_DATAGRAM,
                            late_rank=0, late_start_s=late_start_s)
    for call, per_rank in enumerate(rows):
        for rank, (status, stats, _, error_squares) in enumerate(per_rank):
            where = f"call {call}, rank {rank}: {stats}"
            assert status == 0 and stats["chunks_lost"] == 0 and stats["delivered_fraction"] == 1.0, where
            assert stats["steps_timed_out"] == 0 and not stats["deadline_expired"], where
            assert error_squares < 1e-20, where
            # asking a live sender stays gentle: well under one JOIN per millisecond of the call
            assert stats["join_messages_sent"] <= stats["elapsed_s"] * 1000 + 4 * WORLD, where


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_steps_whose_data_and_end_markers_are_all_lost_close_long_before_the_deadline(algorithm):
    """Bursts of total loss (Gilbert-Elliott, ~50 datagrams long) take whole steps and their END
    markers: the receiver asks the sender at the step's share and closes the step on its answer."""
    deadline_s = 10.0
    rows = _native.simulate(4, _native.COLLECTIVE_ALLREDUCE, ALGORITHMS[algorithm], 4 * 2000, 64, 40,
                            deadline_s=deadline_s, loss_budget=1.0, loss_kind=2, good_to_bad=0.01, bad_to_good=0.02,
                            loss_in_good=0.0, loss_in_bad=1.0, seed=5)
    stats = [row[1] for call in rows for row in call]
    assert min(s["delivered_fraction"] for s in stats) < 0.9  # the bursts did take data
    assert sum(s["steps_ended"] for s in stats) > 0
    for s in stats:
        assert not s["deadline_expired"] and s["steps_timed_out"] == 0 and s["elapsed_s"] < deadline_s / 4, s
