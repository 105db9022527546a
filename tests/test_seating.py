"""Seating newcomers when a group grows (ud_transport.seats), when one side gives up: a newcomer
that waited too long, a grow whose newcomers did not come, a grow of two that one came to.

Until 2026-11-29 a grow offered the next tickets blindly: a newcomer that had given up kept its
ticket, so the next grow seated a process that was gone and failed at its timeout while the next
newcomer waited for nothing; and a grow whose newcomer never came had already torn its group
down, and left a seat behind that the next newcomer took and then waited on a meeting nobody
came to. The store-level cases run the ranks and newcomers as threads over one store; the last
runs real communicators (UDP on loopback), and elastic_tasks the default "ud" group."""
import threading

import numpy as np
import pytest

import elastic_tasks
import ud_transport
from conftest import get_cluster
from ud_transport import Communicator, TransportError, seats


def _store():
    import torch.distributed as dist

    return dist.HashStore()


class Background(threading.Thread):
    """Runs `function` on a thread and keeps what it returned or raised."""

    def __init__(self, function, *arguments):
        super().__init__(daemon=True)
        self.function, self.arguments, self.result, self.error = function, arguments, None, None
        self.start()

    def run(self):
        try:
            self.result = self.function(*self.arguments)
        except Exception as error:  # kept for the test to look at
            self.error = error

    def outcome(self, timeout_s=30):
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.function.__name__} still runs after {timeout_s} s"
        return self.result, self.error


def test_a_grow_seats_the_next_newcomer_after_one_that_gave_up():
    store = _store()
    with pytest.raises(TransportError, match="ticket 1"):
        seats.take_seat(store, "job", 0.2)
    newcomer = Background(seats.take_seat, store, "job", 20)
    key = seats.settle_grow(store, "job", 0xABC, 0, 0, 3, 1, 10)
    seat, error = newcomer.outcome()
    assert error is None, error
    assert (seat.ticket, seat.rank, seat.world_size, seat.key) == (2, 3, 4, key)


def test_a_grow_nobody_comes_to_fails_on_every_rank_and_the_next_grow_seats_a_later_newcomer():
    store = _store()
    ranks = [Background(seats.settle_grow, store, "job", 0xABC, 0, rank, 2, 1, 0.5) for rank in (1, 0)]
    for rank in ranks:
        _, error = rank.outcome()
        assert isinstance(error, TransportError) and "did not take their seats" in str(error) \
            and "as it was" in str(error), error
    newcomer = Background(seats.take_seat, store, "job", 20)  # comes late: the withdrawn seat is not its
    keys = [Background(seats.settle_grow, store, "job", 0xABC, 1, rank, 2, 1, 10) for rank in (0, 1)]
    met = {rank.outcome()[0] for rank in keys}
    seat, error = newcomer.outcome()
    assert error is None, error
    assert met == {seat.key} and seat.attempt == 1 and (seat.rank, seat.world_size) == (2, 3), (met, vars(seat))
    assert seat.ticket == 2, "the first ticket was the withdrawn grow's: the newcomer must have moved past it"


def test_a_newcomer_seated_by_a_grow_that_is_withdrawn_waits_for_the_next():
    store = _store()
    newcomer = Background(seats.take_seat, store, "job", 30)
    with pytest.raises(TransportError, match="1 of the 2 newcomers"):
        seats.settle_grow(store, "job", 0xABC, 0, 0, 1, 2, 0.5)  # one came, one did not
    assert newcomer.is_alive(), "the newcomer took a seat in a grow that was withdrawn: it must wait on"
    key = seats.settle_grow(store, "job", 0xABC, 1, 0, 1, 1, 10)
    seat, error = newcomer.outcome()
    assert error is None, error
    assert (seat.key, seat.rank, seat.world_size, seat.attempt) == (key, 1, 2, 1)


def test_a_seated_newcomer_waits_for_the_outcome_past_its_own_time():
    """A newcomer seated at once with 1 s of its own, in a grow of two whose second newcomer comes
    2 s later: once seated it is committed, so the grow goes on with both (it used to leave after
    its own time while the grow, its seats all taken, went on to a meeting without it)."""
    import time

    store = _store()
    early = Background(seats.take_seat, store, "job", 1.0)
    ranks = [Background(seats.settle_grow, store, "job", 0xABC, 0, rank, 2, 2, 10) for rank in (0, 1)]
    time.sleep(2.0)
    late = Background(seats.take_seat, store, "job", 20)
    keys = {rank.outcome()[0] for rank in ranks}
    (first, error_first), (second, error_second) = early.outcome(), late.outcome()
    assert error_first is None and error_second is None, (error_first, error_second)
    assert keys == {first.key} == {second.key} and sorted([first.rank, second.rank]) == [2, 3], keys


def test_a_late_rank_0_cannot_grow_alone_after_the_others_gave_up():
    """Rank 1 gives up waiting for rank 0 (twice the grow's timeout) and decides the grow failed;
    rank 0, coming later, reads that outcome instead of seating anyone, so every rank raises; the
    waiting newcomer is seated by the next grow."""
    store = _store()
    newcomer = Background(seats.take_seat, store, "job", 30)
    with pytest.raises(TransportError, match="rank 0 did not settle"):
        seats.settle_grow(store, "job", 0xABC, 0, 1, 2, 1, 0.3)
    with pytest.raises(TransportError, match="rank 0 did not settle"):
        seats.settle_grow(store, "job", 0xABC, 0, 0, 2, 1, 0.3)
    assert newcomer.is_alive(), "the newcomer was seated by a grow that failed"
    keys = {rank.outcome()[0] for rank in [Background(seats.settle_grow, store, "job", 0xABC, 1, rank, 2, 1, 10)
                                            for rank in (0, 1)]}
    seat, error = newcomer.outcome()
    assert error is None and keys == {seat.key} and seat.attempt == 1, (error, keys)


def test_a_rank_0_that_offered_seats_and_then_lost_the_decision_fails_with_the_others():
    """Rank 1 gives up on rank 0 at twice the grow's timeout (2 s); rank 0 comes 1.5 s late,
    offers two seats, one newcomer takes one, and rank 0 withdraws the other at its own timeout
    (2.5 s), after rank 1 decided: both ranks raise rank 1's outcome, and the seated newcomer
    waits for the next grow, which seats it."""
    import time

    store = _store()
    newcomer = Background(seats.take_seat, store, "job", 30)
    gave_up = Background(seats.settle_grow, store, "job", 0xABC, 0, 1, 2, 2, 1.0)
    time.sleep(1.5)
    with pytest.raises(TransportError, match="rank 0 did not settle"):
        seats.settle_grow(store, "job", 0xABC, 0, 0, 2, 2, 1.0)
    assert "rank 0 did not settle" in str(gave_up.outcome()[1])
    assert newcomer.is_alive(), "the newcomer was seated by a grow that failed"
    keys = {rank.outcome()[0] for rank in [Background(seats.settle_grow, store, "job", 0xABC, 1, rank, 2, 1, 10)
                                            for rank in (0, 1)]}
    seat, error = newcomer.outcome()
    assert error is None and keys == {seat.key} and (seat.attempt, seat.rank) == (1, 2), (error, keys)


def test_a_seat_offered_by_a_rank_0_that_died_is_not_taken_for_good():
    """Rank 0 offers a seat and dies before settling (its offer is made here by hand); a newcomer
    takes the seat. Rank 1 gives up on rank 0 and fails the grow, and the newcomer, reading that,
    waits for the next grow (after a shrink and a new rank 0, in a real job) instead of staying
    committed to the dead one's."""
    store = _store()
    seats._offer(store, "job", "0000000000000abc:0:2:1:0.3", 1)
    newcomer = Background(seats.take_seat, store, "job", 30)
    with pytest.raises(TransportError, match="rank 0 did not settle"):
        seats.settle_grow(store, "job", 0xABC, 0, 1, 2, 1, 0.3)
    assert newcomer.is_alive(), "the newcomer was seated by a grow that failed"
    key = seats.settle_grow(store, "job", 0xDEF, 0, 0, 1, 1, 10)  # the shrunk group, a new session
    seat, error = newcomer.outcome()
    assert error is None and (seat.key, seat.session_id, seat.rank) == (key, 0xDEF, 1), error


def test_a_failed_grow_leaves_the_communicator_working_and_a_later_one_takes_the_newcomer():
    """A world of one grows by one with nobody there: TransportError within the store timeout,
    the communicator still sums; then a newcomer joins and the next grow makes two ranks that sum
    each other's tensors."""
    store = _store()
    comm = ud_transport.init(0, 1, store=store, transport="udp", store_timeout_s=1.0, name="lonely")
    try:
        with pytest.raises(TransportError, match="as it was"):
            comm.grow(1)
        tensor = np.ones(4, dtype=np.float32)
        comm.allreduce(tensor)
        assert np.array_equal(tensor, np.ones(4, dtype=np.float32))
        newcomer = Background(lambda: Communicator.join(store, "lonely", timeout_s=30))
        grown = comm.grow(1)
        joined, error = newcomer.outcome()
        assert error is None, error
        try:
            assert (grown.rank, grown.world_size, joined.rank, joined.world_size) == (0, 2, 1, 2)
            tensors = [np.full(1024, 1.0, dtype=np.float32), np.full(1024, 2.0, dtype=np.float32)]
            calls = [Background(member.allreduce, tensor) for member, tensor in zip((grown, joined), tensors)]
            for call in calls:
                assert call.outcome()[1] is None
            assert all(np.array_equal(tensor, np.full(1024, 3.0, dtype=np.float32)) for tensor in tensors)
        finally:
            grown.close()
            joined.close()
    finally:
        ud_transport.close()


def test_a_failed_grow_group_leaves_the_default_ud_group_standing(store_port):
    """grow_group(1) with no newcomer on a 2-rank default "ud" group: TransportError on both ranks
    and the group still all-reduces; a process that joins afterwards is seated by the next
    grow_group, the three ranks sum, and a "ud" subgroup of a survivor and the newcomer made
    after the grow sums too."""
    per_rank = get_cluster(3).run(elastic_tasks.grow_nobody_then_somebody, store_port, "grow-fail", timeout_s=180)
    for rank, (failed, standing, grown) in enumerate(per_rank):
        if rank < 2:
            assert failed and "as it was" in failed, f"rank {rank}: the first grow_group did not fail: {failed}"
            assert standing == 3.0, f"rank {rank}: the group did not all-reduce after the failed grow: {standing}"
        assert grown == (rank, 3, 6.0, 5.0 if rank else None), f"rank {rank}: after the second grow {grown}"
