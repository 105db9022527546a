"""Every call pairs on every rank, whatever it is passed, and exact calls say what they are
(issue 38): a list with an empty item, an exact call of no elements on some ranks only, a
0-element send to a receive of 4, and exact calls that differ in their collective or op start
the same engine calls on every rank and carry what they are in their layout, so each is
LayoutMismatch on every rank with no tensor changed, and the group and the channel go on in
step. Also all_gather_coalesced in c10d's layout, against Gloo."""
import itertools

import pytest

import torch_tasks
from conftest import get_cluster
from ud_transport import exact

_tags = itertools.count()

# each failed before: an OK on one rank (wrong values, or a no-op) while the others raised or
# waited out the join timeout, or an OK everywhere where the calls were not the same
CASES = ["allreduce of lists, an empty item on rank 0", "allreduce of lists, one item more on rank 0",
         "exact.broadcast of no elements on rank 0", "exact.all_gather of no elements on rank 0",
         "exact.allreduce of no elements on rank 0", "all_reduce MAX on rank 0, SUM elsewhere",
         "all_reduce on rank 0, all_gather_into_tensor elsewhere", "broadcast on rank 0, scatter elsewhere",
         "reduce on rank 0, all_reduce elsewhere", "gather on rank 0, all_gather elsewhere"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_calls_that_differ_are_layout_mismatch_on_every_rank_and_the_group_goes_on(world):
    """Each case, then an all_reduce on the same group: every rank raises LayoutMismatch naming
    the same rank, every tensor as it was, and the all_reduce after it sums on every rank. At 4
    ranks a small exact broadcast goes flat (one engine scatter), so there the broadcast cases
    meet the flat form on some ranks and another call on the others."""
    if world == 4:  # the sizes the broadcast cases pass (4 and 2 * world int32, one 256-byte chunk) go flat
        assert exact.broadcasts_flat(16, world, 1) and exact.broadcasts_flat(8 * world, world, 1)
    per_rank = get_cluster(world, chunk_bytes=256).run(torch_tasks.calls_that_differ, f"p{next(_tags)}")
    for case in CASES:
        named = {out[case][1] for out in per_rank}
        for rank, out in enumerate(per_rank):
            error, _, unchanged = out[case]
            assert error == "LayoutMismatch", (case, rank, out[case])
            assert unchanged, f"rank {rank}: {case}: a tensor changed"
        assert len(named) == 1 and named <= set(range(world)), (case, named)  # one verdict
    for rank, out in enumerate(per_rank):
        total = sum(sender + 1 for sender in range(world))
        assert out["after"] == [[total] * 4] * len(CASES), (rank, out["after"])


def test_a_message_of_no_elements_to_a_receive_of_four_fails_on_both_ends_and_the_channel_goes_on():
    """The sender's exact broadcast of no elements made no engine call: it returned OK, the
    receiver waited out the join timeout, and the channel's next message paired with nothing."""
    per_rank = get_cluster(2, chunk_bytes=256).run(torch_tasks.a_message_of_no_elements, f"m{next(_tags)}")
    for rank, (outcome, unchanged, after) in enumerate(per_rank):
        assert outcome == ["LayoutMismatch", "no error"], (rank, outcome)
        assert unchanged
    assert per_rank[1][2] == [100.0, 101.0, 102.0, 103.0]


def test_all_gather_coalesced_is_in_c10d_layout_as_on_gloo():
    """c10d's output_lists[rank][input] was handed to all_gather as [input][rank]: with as many
    inputs as ranks nothing raised, and each rank's outputs held the wrong pieces."""
    world = 2
    per_rank = get_cluster(world, chunk_bytes=256).run(torch_tasks.all_gather_coalesced_against_gloo,
                                                       f"c{next(_tags)}")
    expected = [[[float(sender * 10 + k + 1)] * 2 for k in range(world)] for sender in range(world)]
    for rank, out in enumerate(per_rank):
        assert out["gloo"] == expected, (rank, out["gloo"])
        assert out["ud"] == out["gloo"], (rank, out)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_allreduce_sums_as_gloo_does(world):
    """A sparse allreduce (torch's test_sparse_all_reduce_sum needs it; before, 'ud' failed on the
    tensor's nbytes): entry counts that differ by rank and duplicate indices, summed exactly, equal
    to Gloo's result on every rank."""
    import torch

    for rank, (ud, gloo) in enumerate(get_cluster(world, chunk_bytes=256).run(torch_tasks.sparse_allreduce_against_gloo,
                                                                             f"s{next(_tags)}")):
        assert torch.equal(ud, gloo), (rank, ud, gloo)
