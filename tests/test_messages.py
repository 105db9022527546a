"""exact.small_broadcast, as each point-to-point message of a "ud" group (a send and its receive)
and each of its broadcasts runs: it makes broadcast()'s calls with less Python, so a rank that
takes broadcast() instead still pairs with it; a small broadcast's first call must deliver the tensor whole (a loss budget of 0), and only a
miss, agreed, goes on to the attempts that keep a copy; a message that fails leaves the
receiver's tensor as it was."""
import pytest
import torch

import message_tasks as tasks
import ud_transport
from conftest import get_cluster
from ud_transport.exact import SMALL_CALL_COPIES


def test_without_loss_a_message_is_one_call_whether_each_rank_takes_message_or_broadcast():
    per_rank = get_cluster(2, chunk_bytes=256).run(tasks.messages, 1, 4, tasks.by_message_on_even_rounds_of_rank_0)
    for rank, (outcome, plans) in enumerate(per_rank):
        # a plan for each size of whole words (the 3-byte message went to broadcast(), as did the
        # strided view, whose 320 bytes have a plan all the same)
        assert plans == [(size, 1, "broadcast") for size in (4, 8, 320, 2800, 4096)], (rank, plans)
        for index, (right, calls, collectives, sent, left) in enumerate(outcome):
            assert right, (rank, index)
            assert (calls, collectives) == (1, {"broadcast"}), (rank, index, calls, collectives)
            count, dtype_name, contiguous = tasks.CASES[index % len(tasks.CASES)]
            nbytes = count * getattr(torch, dtype_name).itemsize
            assert sent == (-(-nbytes // 4) * 4 if rank == 1 else 0), (rank, index, sent)  # each datagram once
            if left is not None:  # small_broadcast() made the call itself where it could
                assert left == (nbytes % 4 != 0 or not contiguous), (rank, index, left)


@pytest.mark.parametrize("loss", [0.2, 0.5])
def test_under_loss_every_message_arrives_whole_and_both_ranks_make_the_same_calls(loss):
    """At 20% and 50% injected loss the whole first call often misses (one copy of a datagram
    lost, or after a miss all three), and the message goes on in the attempts that keep what
    arrived. Rank 0 takes broadcast() on odd rounds, so small_broadcast() and broadcast() meet in
    every combination."""
    cluster = get_cluster(2, chunk_bytes=256, inject=ud_transport.Bernoulli(loss, seed=13))
    per_rank = [outcome for outcome, _ in cluster.run(tasks.messages, 1, 8, tasks.by_message_on_even_rounds_of_rank_0)]
    calls = [[calls for _, calls, _, _, _ in outcome] for outcome in per_rank]
    assert calls[0] == calls[1], calls  # every repeat is agreed
    for rank, outcome in enumerate(per_rank):
        for index, (right, _, collectives, _, _) in enumerate(outcome):
            assert right, (rank, index, outcome[index])
            assert collectives <= {"broadcast", "agree", "all_gather"}, (rank, index, collectives)
    assert max(calls[0]) > 1, calls  # the whole first call missed somewhere: the rest was exercised
    # the root's first call of each message: its payload once (the first message), then after a
    # miss in one copy SMALL_CALL_COPIES times
    words = [-(-count * getattr(torch, dtype_name).itemsize // 4) * 4 for count, dtype_name, _ in tasks.CASES]
    firsts = [(sent, words[index % len(words)]) for index, (_, _, _, sent, _) in enumerate(per_rank[1])]
    assert firsts[0] == (words[0], words[0]), firsts
    assert all(sent in (nbytes, SMALL_CALL_COPIES * nbytes) for sent, nbytes in firsts), firsts
    assert any(sent == SMALL_CALL_COPIES * nbytes for sent, nbytes in firsts), firsts


def test_a_message_that_runs_out_of_attempts_fails_on_both_ranks_and_the_receiver_keeps_its_tensor():
    """With one attempt, a whole first call that missed is the end: LossBudgetExceeded on both
    ranks, and the receiver's tensor holds its old values (the engine wrote nothing). With two,
    the attempt after it keeps a copy and puts it back."""
    cluster = get_cluster(2, chunk_bytes=256, inject=ud_transport.Bernoulli(0.5, seed=17))
    for attempts in (1, 2):
        per_rank = cluster.run(tasks.failed_messages, 1, 4, attempts)
        outcomes = [[outcome for outcome, _ in rank_out] for rank_out in per_rank]
        assert outcomes[0] == outcomes[1], outcomes  # one verdict
        assert "LossBudgetExceeded" in outcomes[0], outcomes  # 50% loss: some message runs out
        for rank, rank_out in enumerate(per_rank):
            for index, (outcome, as_wanted) in enumerate(rank_out):
                assert as_wanted, (attempts, rank, index, outcome)


def test_whole_first_calls_go_in_one_copy_until_one_misses_then_in_three_for_a_while():
    """The copies of a communicator's whole first calls, from their agreed outcomes alone: one
    copy while they arrive whole; after a miss in one copy, FIRST_CALL_COPIED_CALLS calls in
    SMALL_CALL_COPIES, doubled at each later miss (to FIRST_CALL_COPIED_MAX), halved by as many
    whole single-copy calls in a row; calls larger than SMALL_CALL_BYTES always in one and
    noted not at all."""
    from ud_transport.exact import (SMALL_CALL_BYTES, SMALL_CALL_COPIES, FIRST_CALL_COPIED_CALLS,
                                    FIRST_CALL_COPIED_MAX, _FirstCallCopies)

    copying = _FirstCallCopies()
    small, large = 4096, SMALL_CALL_BYTES + 4

    def call(missed, nbytes=small):
        copies = copying.copies(nbytes)
        copying.note(copies, nbytes, missed)
        return copies
    assert [call(False) for _ in range(5)] == [1] * 5
    assert call(True) == 1  # the miss
    assert [call(False) for _ in range(FIRST_CALL_COPIED_CALLS)] == [SMALL_CALL_COPIES] * FIRST_CALL_COPIED_CALLS
    assert call(True) == 1  # missed again in one copy: twice as long in copies
    assert [call(False) for _ in range(2 * FIRST_CALL_COPIED_CALLS)] == [SMALL_CALL_COPIES] * (2 * FIRST_CALL_COPIED_CALLS)
    assert call(True, large) == 1 and call(False) == 1  # a large miss neither counts nor copies
    copying.left = 3  # and a large call goes in one copy where small ones copy, using up none of it
    assert (call(False, large), copying.left) == (1, 3)
    copying.left = 0
    for _ in range(2 * FIRST_CALL_COPIED_CALLS):  # as many whole in a row halve the wait
        assert call(False) == 1
    assert copying.wait == FIRST_CALL_COPIED_CALLS
    for _ in range(20):
        call(True)
        while copying.left:
            call(False)
    assert copying.wait == FIRST_CALL_COPIED_MAX
