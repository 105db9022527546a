"""Blocks and schedules, checked on their own (pure functions in C, the same
ones the engine and the simulator run)."""
import pytest

from ud_transport import _native

RING, DIRECT = _native.ALGORITHM_RING, _native.ALGORITHM_DIRECT
ALLREDUCE, REDUCE_SCATTER = _native.COLLECTIVE_ALLREDUCE, _native.COLLECTIVE_REDUCE_SCATTER
ALL_GATHER, BROADCAST = _native.COLLECTIVE_ALL_GATHER, _native.COLLECTIVE_BROADCAST
NO_PEER = -1


@pytest.mark.parametrize("count,world", [(0, 3), (1, 4), (5, 8), (10, 3), (1000, 7), (2**40 + 3, 5)])
def test_blocks_tile_the_tensor(count, world):
    starts = [_native.block_start(count, world, s) for s in range(world + 1)]
    assert starts[0] == 0 and starts[-1] == count
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    assert all(length >= 0 for length in lengths)
    assert max(lengths) - min(lengths) <= 1  # as even as possible


def schedules(collective, algorithm, world, root=0, rotation=0):
    return [_native.schedule(collective, algorithm, rank, world, root, rotation) for rank in range(world)]


def assert_steps_pair_up(every):
    """What rank p sends to q in step i is what q expects from p in step i."""
    world = len(every)
    for rank, (_, steps) in enumerate(every):
        for i, step in enumerate(steps):
            if step["send_peer"] != NO_PEER:
                peer_step = every[step["send_peer"]][1][i]
                assert peer_step["recv_peer"] == rank and peer_step["recv_block"] == step["send_block"], (rank, i)
            if step["recv_peer"] != NO_PEER:
                assert every[step["recv_peer"]][1][i]["send_peer"] == rank
        assert all(0 <= s["send_block"] < world and 0 <= s["recv_block"] < world for s in steps)


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("rotation", [0, 1, 5])
def test_allreduce_schedules(algorithm, world, rotation):
    every = schedules(ALLREDUCE, algorithm, world, rotation=rotation)
    assert_steps_pair_up(every)
    owners = sorted(summary["owned_block"] for summary, _ in every)
    assert owners == list(range(world))  # every block has exactly one owner
    for rank, (summary, steps) in enumerate(every):
        assert len(steps) == 2 * (world - 1) and summary["finalize_after"] == world - 2
        reduce_half, gather_half = steps[: world - 1], steps[world - 1:]
        own = summary["owned_block"]
        # the gather half brings every block but our own, exactly once, as final values
        assert sorted(s["recv_block"] for s in gather_half) == sorted(set(range(world)) - {own})
        assert all(s["recv_mode"] == 1 for s in gather_half) and all(s["recv_mode"] == 0 for s in reduce_half)
        # nothing of the gather half leaves before our block is final
        assert all(s["send_after"] >= world - 2 for s in gather_half)
        if algorithm == DIRECT:
            # one hop per half: every peer sends us its piece of our block, once
            assert {s["recv_peer"] for s in reduce_half} == set(range(world)) - {rank}
            assert all(s["recv_block"] == own for s in reduce_half)
            # staggered: in round k rank r serves r+k
            assert [s["send_peer"] for s in reduce_half] == [(rank + k) % world for k in range(1, world)]
            assert summary["critical_path"] == 2
        else:
            assert reduce_half[-1]["recv_block"] == own
            assert summary["critical_path"] == 2 * (world - 1)


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_reduce_scatter_and_all_gather_give_rank_r_block_r(algorithm, world):
    for collective in (REDUCE_SCATTER, ALL_GATHER):
        every = schedules(collective, algorithm, world)
        assert_steps_pair_up(every)
        for rank, (summary, steps) in enumerate(every):
            assert summary["owned_block"] == rank and len(steps) == world - 1
            if collective == ALL_GATHER:
                assert sorted(s["recv_block"] for s in steps) == sorted(set(range(world)) - {rank})


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
@pytest.mark.parametrize("world,root", [(2, 0), (3, 1), (5, 4), (8, 3)])
def test_broadcast_scatters_from_the_root_then_gathers(algorithm, world, root):
    every = schedules(BROADCAST, algorithm, world, root=root)
    assert_steps_pair_up(every)
    for rank, (_, steps) in enumerate(every):
        scatter = steps[: world - 1]
        received = [s for s in scatter if s["recv_peer"] != NO_PEER]
        if rank == root:
            assert not received and sorted(s["send_block"] for s in scatter) == sorted(set(range(world)) - {root})
        else:
            assert [(s["recv_peer"], s["recv_block"]) for s in received] == [(root, rank)]
        # the gather half sends the root nothing (it holds every block), and every other rank
        # takes each block but its own once
        gather = steps[world - 1:]
        assert all(s["send_peer"] != root for s in gather)
        gathered = [s["recv_block"] for s in gather if s["recv_peer"] != NO_PEER]
        assert gathered == [] if rank == root else sorted(gathered) == sorted(set(range(world)) - {rank})


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
def test_no_receive_overwrites_a_block_before_it_was_sent(algorithm):
    world = 6
    for summary, steps in schedules(ALLREDUCE, algorithm, world, rotation=2):
        for g, step in enumerate(steps):
            earlier_sends = [i for i in range(g + 1) if steps[i]["send_block"] == step["recv_block"] and steps[i]["send_peer"] != NO_PEER]
            assert step["recv_needs_sent"] == (earlier_sends[-1] + 1 if earlier_sends else 0)


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
@pytest.mark.parametrize("collective", [ALLREDUCE, _native.COLLECTIVE_REDUCE_SCATTER, _native.COLLECTIVE_ALL_GATHER, BROADCAST,
                                        _native.COLLECTIVE_SCATTER, _native.COLLECTIVE_GATHER])
@pytest.mark.parametrize("world,root", [(2, 0), (3, 1), (5, 4)])
def test_a_receive_is_whole_exactly_when_its_sender_holds_the_whole_block(collective, algorithm, world, root):
    """recv_whole (issue 10, finding 7) lets a receiver demand the exact chunk count: it must
    hold exactly when the sender cannot lack a chunk: in the reduce half (every rank holds its own
    input everywhere; a scatter comes from the root), from a broadcast's root, and from the owner
    of a reduced or gathered block sending that block. A relay may lack chunks lost upstream."""
    every = schedules(collective, algorithm, world, root=root, rotation=1 if collective == ALLREDUCE else 0)  # as the engine
    for rank, (summary, steps) in enumerate(every):
        for g, step in enumerate(steps):
            if step["recv_peer"] == NO_PEER:
                continue
            sender_summary = every[step["recv_peer"]][0]
            if step["phase"] == 0:
                whole = True
            elif collective == BROADCAST:
                whole = step["recv_peer"] == root
            else:
                whole = sender_summary["owned_block"] == step["recv_block"]
            assert bool(step["recv_whole"]) == whole, (rank, g, step)


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_all_to_all_sends_each_piece_straight_to_its_receiver(algorithm, world):
    """In round k rank r sends its input block r+k to rank r+k, which takes it as its output
    block r in the same round: every piece once, no relay, whatever the algorithm asked."""
    every = schedules(_native.COLLECTIVE_ALL_TO_ALL, algorithm, world)
    for rank, (summary, steps) in enumerate(every):
        assert len(steps) == world - 1 and summary["owned_block"] == rank and summary["critical_path"] == 1
        assert sorted(s["send_peer"] for s in steps) == sorted(set(range(world)) - {rank})
        for i, step in enumerate(steps):
            assert step["send_block"] == step["send_peer"] and step["recv_block"] == step["recv_peer"]
            peer_step = every[step["send_peer"]][1][i]
            assert peer_step["recv_peer"] == rank and peer_step["recv_block"] == rank
            assert step["recv_whole"] and step["recv_needs_sent"] == 0 and step["send_after"] == -1  # no step before it
            assert step["recv_mode"] == 1 and step["phase"] == 1  # overwrite; sends from the input, counted as one


@pytest.mark.parametrize("algorithm", [RING, DIRECT])
@pytest.mark.parametrize("world,root", [(2, 0), (2, 1), (3, 1), (5, 4), (8, 3)])
def test_scatter_and_gather_move_each_piece_once_between_the_root_and_its_rank(algorithm, world, root):
    """A scatter's root sends block q to rank q and nothing else moves; a gather's rank q sends its
    block to the root and nothing else moves (issue 41: gather and scatter at 1x): per rank, at
    most one piece in or out, the root's world - 1, whatever the algorithm asked."""
    for collective, outward in ((_native.COLLECTIVE_SCATTER, True), (_native.COLLECTIVE_GATHER, False)):
        every = schedules(collective, algorithm, world, root=root)
        assert_steps_pair_up(every)
        for rank, (summary, steps) in enumerate(every):
            assert len(steps) == world - 1 and summary["owned_block"] == rank and summary["critical_path"] == 1
            sends = [(i, s) for i, s in enumerate(steps) if s["send_peer"] != NO_PEER]
            receives = [(i, s) for i, s in enumerate(steps) if s["recv_peer"] != NO_PEER]
            root_side, other_side = (sends, receives) if outward else (receives, sends)
            if rank == root:
                assert not other_side and len(root_side) == world - 1
            else:
                assert not root_side and len(other_side) == 1
            for i, step in sends:
                receiver_step = every[step["send_peer"]][1][i]
                assert receiver_step["recv_peer"] == rank and receiver_step["recv_block"] == step["send_block"]
                assert step["send_block"] == (step["send_peer"] if outward else rank)
                assert step["send_after"] == -1
            for i, step in receives:
                assert step["recv_whole"] and step["recv_mode"] == 1 and step["recv_block"] == (rank if outward else step["recv_peer"])
