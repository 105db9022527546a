"""scatter and gather (issue 41): each piece crosses the network once, between the root and its
rank, where a scatter built on a broadcast moved every piece to every rank. Exact without loss;
under loss a chunk that does not arrive keeps the old value bit for bit and the chunk mask names
it, a rank's fraction is of its own result only, and ud_transport.exact.scatter / gather repeat
until every rank holds its result."""
import numpy as np
import pytest

import scatter_gather_tasks as tasks
import ud_transport
from conftest import get_cluster

CHUNK_BYTES = 24  # 6 float32 a chunk; shares its clusters with test_collectives and test_all_to_all


def _chunks(block, chunk_bytes=CHUNK_BYTES):
    return -(-block * 4 // chunk_bytes)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_without_loss_each_rank_gets_its_piece_and_receives_nothing_else(world):
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    for block in (0, 1, 7, 333):
        for root in sorted({0, world - 1}):
            old = np.float32(-1.0)
            for rank, [(tensor, mask, stats)] in enumerate(cluster.run(tasks.scatters, block, root, 1, 0.0)):
                want = np.full(world * block, old)
                for q in range(world):
                    if q == rank or rank == root:
                        want[q * block:(q + 1) * block] = tasks.block_values(root, q, block)
                np.testing.assert_array_equal(tensor, want, err_msg=f"scatter rank {rank} block {block} root {root}")
                assert stats.collective == "scatter" and stats.gather_fraction == 1.0 and mask.all()
                assert stats.datagrams_received == (0 if rank == root else _chunks(block)), (rank, stats)
                assert stats.payload_bytes_sent == ((world - 1) * block * 4 if rank == root else 0), (rank, stats)
            for rank, [(output, mask, stats, kept)] in enumerate(cluster.run(tasks.gathers, block, root, 1, 0.0)):
                want = np.full(world * block, old)
                for q in range(world):
                    if q == rank or rank == root:
                        want[q * block:(q + 1) * block] = tasks.block_values(q, root, block)
                np.testing.assert_array_equal(output, want, err_msg=f"gather rank {rank} block {block} root {root}")
                assert kept and stats.collective == "gather" and stats.gather_fraction == 1.0 and mask.all()
                assert stats.datagrams_received == ((world - 1) * _chunks(block) if rank == root else 0), (rank, stats)
                assert stats.payload_bytes_sent == (0 if rank == root else block * 4), (rank, stats)


def _check_chunks(values, mask, ranges, fresh_values, old, wanted, where):
    """Chunk by chunk: fresh (mask 1) where wanted holds the new value, stale (0) the old one;
    outside `wanted` (elements) the mask is 1 and the value is `outside`."""
    for fresh, (first, stop) in zip(mask, ranges):
        if wanted[first]:
            expect = fresh_values[first:stop] if fresh else np.full(stop - first, old)
            np.testing.assert_array_equal(values[first:stop], expect, err_msg=f"{where}, chunk at {first}")
        else:
            assert fresh, f"{where}: a chunk outside this rank's result is marked missing"


def test_lost_chunks_keep_the_old_value_and_the_fractions_are_of_each_rank_s_own_result():
    world, block, calls, root = 4, 125, 20, 2
    cluster = get_cluster(world, chunk_bytes=32, inject=ud_transport.Bernoulli(0.1, seed=5))
    ranges = cluster.run(tasks.chunk_ranges_of, world * block)[0]
    stale_seen = 0
    for name, task in (("scatter", tasks.scatters), ("gather", tasks.gathers)):
        per_rank = cluster.run(task, block, root, calls, 1.0)
        for call in range(calls):
            old = np.float32(-1.0 - call)
            least = min(row[call][2].own_gather_fraction for row in per_rank)
            for rank in range(world):
                values, mask, stats = per_rank[rank][call][:3]
                # what it holds after the call: the root everything, another rank its own block
                held = np.arange(world * block) // block == rank if rank != root else np.ones(world * block, bool)
                if name == "scatter":
                    sent = np.concatenate([tasks.block_values(root, q, block, call) for q in range(world)])
                    wanted = np.zeros(world * block, bool)
                    wanted[rank * block:(rank + 1) * block] = rank != root
                else:
                    sent = np.concatenate([tasks.block_values(q, root, block, call) for q in range(world)])
                    wanted = np.full(world * block, rank == root)
                    wanted[rank * block:(rank + 1) * block] = False  # its own shard never travels
                _check_chunks(values, mask, ranges, sent, old, wanted, f"{name} call {call} rank {rank}")
                outside = ~held
                np.testing.assert_array_equal(values[outside], np.full(int(outside.sum()), old))  # nothing for it
                share = float((values[held] == sent[held]).mean())
                # the fraction is of this rank's own result (a scatter's block, a gather's at its root),
                # rounded down to the tensor's elements; the agreed one is the least of them
                assert share - 1.0 / (world * block) < stats.own_gather_fraction <= share
                assert stats.gather_fraction == least and int((mask == 0).sum()) == stats.chunks_stale
                stale_seen += stats.chunks_stale
            if name == "gather":
                assert all(row[call][3] for row in per_rank), "a gather changed a rank's shard"
    assert stale_seen > 0, "10% loss must leave some chunks stale"


@pytest.mark.parametrize("loss, nbytes, dtype", [
    (0.0, 20000, "float32"), (0.0, 400, "int32"), (0.05, 5, "uint8"), (0.05, 1002, "float16"), (0.05, 20000, "float32"), (0.2, 4000, "int64"),
])
def test_exact_scatter_and_gather_deliver_everything_and_send_each_piece_once(loss, nbytes, dtype):
    """Without loss one call each, every piece sent once by its holder (a small call's too: its
    first goes in one copy while such calls arrive whole, exact._FirstCallCopies). Under loss every result is
    whole; a call of 64 chunks or more is repaired (only what some rank lacks is sent again), so
    what its holder sends after the first call is less than the first call carried."""
    world = 4
    options = {"inject": ud_transport.Bernoulli(loss, seed=9)} if loss else {}
    cluster = get_cluster(world, chunk_bytes=64, **options)
    per_rank = cluster.run(tasks.exact_rounds, nbytes, dtype, 3)
    padded = -(-nbytes // 4) * 4
    repaired = nbytes * world // 64 >= 64  # the call's chunks, as the exact layer counts them
    for rank, outcome in enumerate(per_rank):
        for call, (right, scatter_bytes, gather_bytes) in enumerate(outcome):
            assert right, f"rank {rank} call {call}"
            if not loss:
                assert scatter_bytes == [(world - 1) * padded if rank == 0 else 0], (rank, scatter_bytes)
                assert gather_bytes == [0 if rank == world - 1 else padded], (rank, gather_bytes)
            elif repaired:
                holds = ([scatter_bytes] if rank == 0 else []) + ([gather_bytes] if rank != world - 1 else [])
                for sent in holds:
                    assert sum(sent[1:]) < sent[0], (rank, call, sent)


def test_calls_that_differ_across_ranks_mismatch_everywhere_and_keep_the_tensor():
    assert get_cluster(3, chunk_bytes=CHUNK_BYTES).run(tasks.mismatches) == [[], [], []]


def test_bad_arguments_are_refused_before_anything_is_sent():
    assert get_cluster(2, chunk_bytes=CHUNK_BYTES).run(tasks.argument_errors) == [[], []]


@pytest.mark.parametrize("world, loss", [(2, 0.0), (3, 0.0), (4, 0.0), (8, 0.0), (4, 0.2)])
def test_a_small_exact_broadcast_goes_to_each_rank_whole_from_the_root(world, loss):
    """A small exact broadcast among 4 ranks or more is one scatter of the tensor's copies: every
    receiver takes its whole tensor from the root and sends no payload (the engine's broadcast
    has every rank relay blocks); without loss, one call whose root sends (world - 1) copies of
    the tensor, each datagram in up to SMALL_CALL_COPIES copies. A large one, or one among fewer
    ranks, stays the engine's broadcast. Under loss both are whole, repeated or repaired."""
    from ud_transport import exact

    options = {"inject": ud_transport.Bernoulli(loss, seed=21)} if loss else {}
    cluster = get_cluster(world, chunk_bytes=64, **options)
    cases = [(7, "uint8"), (1, "int64"), (301, "float16"), (200, "float32"), (3000, "float32")]
    src = world - 1
    per_rank = cluster.run(tasks.exact_broadcasts, cases, src)
    # a repeat is decided by an agreement round: every rank makes the same calls, under loss too
    assert len({tuple(len(collectives) for _, collectives, _ in outcome) for outcome in per_rank}) == 1, per_rank
    for rank, outcome in enumerate(per_rank):
        for (count, dtype), (right, collectives, sent) in zip(cases, outcome):
            where = (rank, count, dtype, collectives, sent)
            assert right, where
            padded = -(-count * np.dtype(dtype).itemsize // 4) * 4
            # 12,000 bytes in 64-byte chunks: too many for a small call
            flat = count != 3000 and world >= exact.FLAT_BROADCAST_MIN_RANKS
            assert set(collectives) == {"scatter" if flat else "broadcast"}, where
            if flat:
                assert sum(sent) == 0 or rank == src, where
            if loss:
                continue
            assert len(collectives) == 1, where
            if flat and rank == src:  # a copy a receiver no longer needs may be left unsent
                assert (world - 1) * padded <= sent[0] <= (world - 1) * padded * exact.SMALL_CALL_COPIES, where
            if count == 3000 and rank != src and world > 2:
                assert sent[0] > 0, where  # the engine's broadcast: receivers relay blocks


def test_a_flat_broadcast_that_loses_every_copy_of_a_datagram_is_repeated_alike_on_every_rank():
    """At 50% injected loss a small flat broadcast loses every copy of some datagram on almost
    every first call (in one copy until a first call misses, then SMALL_CALL_COPIES: 1 in 8 for
    each, 30-39 a call here: 98% or more), so it is repeated whole, each repeat keeping what earlier ones delivered: every rank ends with
    the root's values within a few calls (without keeping, each call would succeed 0.5-2% of
    the time), and every rank makes the same calls, since whether to repeat is agreed."""
    cluster = get_cluster(4, chunk_bytes=64, inject=ud_transport.Bernoulli(0.5, seed=5))
    cases = [(301, "float16"), (200, "float32"), (150, "int32"), (100, "float64")]
    per_rank = cluster.run(tasks.exact_broadcasts, cases, 3)
    calls = [[len(collectives) for _, collectives, _ in outcome] for outcome in per_rank]
    for rank, outcome in enumerate(per_rank):
        for case, (right, collectives, _) in zip(cases, outcome):
            assert right, (rank, case, collectives)
            assert set(collectives) == {"scatter"}, (rank, case, collectives)  # the flat form
            # each datagram missing after k calls with probability 8**-k: more than 8 is ~2e-6
            assert len(collectives) <= 8, (rank, case, collectives)
    assert all(row == calls[0] for row in calls), calls
    assert max(calls[0]) > 1, calls  # repeated: without repeats this loss leaves a hole


def test_the_flat_form_is_for_small_calls_whose_root_sends_little():
    from ud_transport import exact

    assert exact.broadcasts_flat(4096, 8, 24)
    assert exact.broadcasts_flat(4096, 4, 12) and not exact.broadcasts_flat(4096, 3, 9)  # fewer ranks: no faster
    assert not exact.broadcasts_flat(0, 8, 0)  # nothing to send: the engine's call of no elements
    assert not exact.broadcasts_flat(4096, 8, exact.REPAIR_MIN_CHUNKS)  # repaired, not repeated
    assert not exact.broadcasts_flat(exact.SMALL_CALL_BYTES + 4, 4, 40)  # one copy: the engine's form
    assert exact.broadcasts_flat(exact.SMALL_CALL_BYTES, 17, 48)  # 16 x 64 KiB from the root
    assert not exact.broadcasts_flat(exact.SMALL_CALL_BYTES, 18, 48)


def test_broadcasts_of_sizes_that_choose_different_forms_mismatch_everywhere():
    """Rank 0's size goes flat, the others' two steps (an engine scatter against an engine
    broadcast): LayoutMismatch on every rank, no tensor changed, and the next broadcast pairs."""
    per_rank = get_cluster(4, chunk_bytes=CHUNK_BYTES).run(tasks.broadcast_sizes_that_differ, 4, 20000)
    assert per_rank == [("LayoutMismatch", True, True)] * 4, per_rank


def test_a_flat_broadcast_never_pairs_with_a_scatter_that_claims_the_same_bytes():
    """Both are an engine scatter of the same count from the same root; the flat form's salt says
    what it is, so the two raise LayoutMismatch on every rank instead of pairing."""
    per_rank = get_cluster(4, chunk_bytes=CHUNK_BYTES).run(tasks.flat_broadcast_against_scatter)
    assert per_rank == [("LayoutMismatch", True, True)] * 4, per_rank
