"""The ring's arithmetic, checked on its own (pure functions in C)."""
import pytest

from ud_transport import _native


@pytest.mark.parametrize("count,world", [(0, 3), (1, 4), (5, 8), (10, 3), (1000, 7), (2**40 + 3, 5)])
def test_segments_tile_the_tensor(count, world):
    starts = [_native.segment_start(count, world, s) for s in range(world + 1)]
    assert starts[0] == 0 and starts[-1] == count
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    assert all(length >= 0 for length in lengths)
    assert max(lengths) - min(lengths) <= 1  # as even as possible


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_ring_schedule(world):
    steps = 2 * (world - 1)
    for rank in range(world):
        upstream, downstream = (rank - 1) % world, (rank + 1) % world
        reduce_scatter = [_native.recv_segment(rank, world, g) for g in range(world - 1)]
        all_gather = [_native.recv_segment(rank, world, g) for g in range(world - 1, steps)]
        owned = (rank + 1) % world
        # reduce-scatter visits every segment but our own; the last one we receive is the one we own
        assert sorted(reduce_scatter) == sorted(set(range(world)) - {rank})
        assert reduce_scatter[-1] == owned
        # all-gather brings every segment we do not own, exactly once
        assert sorted(all_gather) == sorted(set(range(world)) - {owned})
        for g in range(steps):
            # what we receive at step g is what our upstream sends at step g
            assert _native.recv_segment(rank, world, g) == _native.send_segment(upstream, world, g)
            # and what we forward at step g+1 is what we received at step g
            if g + 1 < steps:
                assert _native.send_segment(rank, world, g + 1) == _native.recv_segment(rank, world, g)
        assert _native.send_segment(downstream, world, 0) == downstream
