"""all_to_all: each piece straight from its sender to its receiver, once. Exact without loss in
every dtype and world; under loss, a chunk that does not arrive keeps the output's old value bit
for bit and the chunk mask names it; ud_transport.exact.all_to_all repairs until every piece is
whole."""
import numpy as np
import pytest

import all_to_all_tasks as tasks
import ud_transport
from conftest import get_cluster

CHUNK_BYTES = 24  # shares its clusters with test_collectives


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32"])
def test_all_to_all_exact(world, dtype):
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    for block in (0, 1, 7, 333):
        for in_place in (False, True):
            for rank, (output, stats, input_kept) in enumerate(cluster.run(tasks.exchange, block, dtype, in_place)):
                want = np.concatenate([np.asarray(tasks.as_numpy(tasks.piece_values(sender, rank, block, dtype)))
                                       for sender in range(world)])
                np.testing.assert_array_equal(output, want, err_msg=f"rank {rank} block {block} in place {in_place}")
                assert input_kept and stats.collective == "all_to_all" and stats.gather_fraction == 1.0
                # each piece crossed once: a rank takes (world - 1) blocks' chunks, no more
                chunks_per_block = -(-block * np.dtype("float32" if dtype == "bfloat16" else dtype).itemsize // CHUNK_BYTES)
                if dtype != "bfloat16":
                    assert stats.datagrams_received == (world - 1) * chunks_per_block, stats


# direct_output: chunks written into the output as they arrive; with 8 KiB chunks and an output
# counted as larger than the cache (in_place_min_bytes 0) they go there past the cache. Blocks of
# 125 float32 end in a short chunk (5 of 8 elements).
@pytest.mark.parametrize("direct_output, chunk_bytes, block", [(False, 32, 125), (True, 32, 125), (True, 8192, 10240)])
def test_lost_chunks_keep_the_old_value_and_the_mask_names_them(direct_output, chunk_bytes, block):
    world, calls = 4, 20
    options = {"in_place_min_bytes": 0} if chunk_bytes > 32 else {}
    cluster = get_cluster(world, chunk_bytes=chunk_bytes, inject=ud_transport.Bernoulli(0.1, seed=11), **options)
    per_rank = cluster.run(tasks.lossy_exchanges, block, calls, direct_output)
    ranges = cluster.run(tasks.chunk_ranges_of, world * block)[0]
    stale_seen = 0
    for call in range(calls):
        old = np.float32(-1000.0 - call)
        for rank in range(world):
            output, mask, chunks_stale, own_gather_fraction = per_rank[rank][call]
            sent = np.concatenate([tasks.piece_values(sender, rank, block, "float32", call) for sender in range(world)])
            assert mask.shape == (len(ranges),)
            for fresh, (first, stop) in zip(mask, ranges):
                np.testing.assert_array_equal(output[first:stop], sent[first:stop] if fresh else np.full(stop - first, old),
                                              err_msg=f"call {call} rank {rank} chunk at {first}")
            own = slice(rank * block, (rank + 1) * block)
            np.testing.assert_array_equal(output[own], sent[own])  # its own piece never travels
            assert int((mask == 0).sum()) == chunks_stale
            assert own_gather_fraction == pytest.approx(float((output == sent).mean()))
            stale_seen += chunks_stale
    assert stale_seen > 0, "10% loss must leave some chunks stale"


@pytest.mark.parametrize("loss, nbytes, dtype", [
    (0.1, 3 * 1001, "int8"), (0.1, 3 * 16000, "float32"), (0.3, 3 * 16000 - 6, "bfloat16"),  # repaired
    (0.6, 3 * 40, "float32"), (0.6, 3 * 5 * 2, "float16")])  # repeated whole (fewer than 64 chunks)
def test_exact_all_to_all_completes_under_loss(loss, nbytes, dtype):
    """From 64 chunks up, the chunks some rank lacks after a lossy exchange are sent again by
    their senders only, to their receivers only; below, the exchange is repeated whole (in three
    copies), keeping what came, until no rank lacks a chunk. Blocks whose bytes are not whole
    32-bit words (3 int8 blocks of 1001) are padded on the way. An output passed as scratch takes
    the pieces straight, repairs included."""
    cluster = get_cluster(3, chunk_bytes=32, inject=ud_transport.Bernoulli(loss, seed=7))
    repaired = nbytes // 32 >= 64
    for in_place in (False, True, "scratch"):
        per_rank = cluster.run(tasks.exact_exchanges, nbytes, dtype, 4, in_place)
        for rank, outcomes in enumerate(per_rank):
            assert all(right for right, _ in outcomes), (rank, outcomes)
            if repaired:  # a repair carries what some pair lacks (about the loss), not whole blocks again
                assert all(repair < (loss + 0.25) * chunks[0] for _, chunks in outcomes for repair in chunks[1:]), outcomes
        assert max(len(chunks) for outcomes in per_rank for _, chunks in outcomes) > 1, "the loss must have cost more calls"


@pytest.mark.parametrize("after_a_miss", [False, True])
def test_the_small_call_copies_follow_the_payload_not_the_headers(after_a_miss):
    """A call is small enough for SMALL_CALL_COPIES copies by its `payload_bytes` (what the caller
    says is its data, headers aside), else by its size: 4 KiB over SMALL_CALL_BYTES goes once
    alone, in the small call's copies when the caller counts only SMALL_CALL_BYTES of it. A small
    call's first goes in those copies only after such a first call missed (exact._FirstCallCopies);
    on a clean communicator it goes once."""
    from ud_transport import exact

    nbytes = exact.SMALL_CALL_BYTES + 4096
    cluster = get_cluster(2, chunk_bytes=8192)  # 9 chunks: fewer than REPAIR_MIN_CHUNKS
    small_copies = exact.SMALL_CALL_COPIES if after_a_miss else 1
    for outcomes in cluster.run(tasks.bytes_sent_by_payload, nbytes, [None, exact.SMALL_CALL_BYTES], after_a_miss):
        assert outcomes == [(True, nbytes // 2), (True, small_copies * nbytes // 2)]  # the peer's block


def test_small_exchanges_go_once_on_a_clean_network_and_in_three_copies_after_a_miss():
    """A small exact all_to_all's first call goes in one copy while such calls arrive whole, and
    after one missed, in SMALL_CALL_COPIES for a while (exact._FirstCallCopies, as a small
    broadcast's): each piece once without loss; under 20% injected loss every result is whole,
    every rank makes the same calls, and some first calls went in three copies (a sender stops
    copying to a receiver whose verdict says it is finished, so such a call sends between one and
    three times the pieces)."""
    from ud_transport import exact

    nbytes, world = 3 * 400, 3  # 3 blocks of 400 bytes: 39 chunks of 32 bytes
    block = nbytes // world
    clean = get_cluster(world, chunk_bytes=32).run(tasks.small_exchanges, nbytes, 3)
    for rank, outcomes in enumerate(clean):
        assert outcomes == [(True, 1, (world - 1) * block)] * 3, (rank, outcomes)
    lossy = get_cluster(world, chunk_bytes=32, inject=ud_transport.Bernoulli(0.2, seed=11)).run(
        tasks.small_exchanges, nbytes, 12)
    assert all(right for outcomes in lossy for right, _, _ in outcomes), lossy
    assert len({tuple(calls for _, calls, _ in outcomes) for outcomes in lossy}) == 1, lossy  # the same calls
    firsts = [sent for _, _, sent in lossy[0]]
    assert firsts[0] == (world - 1) * block, firsts  # once, on a fresh communicator
    once = (world - 1) * block
    assert all(once <= sent <= exact.SMALL_CALL_COPIES * once for sent in firsts), firsts
    assert any(sent > once for sent in firsts[1:]), firsts  # a miss was followed by copies


def test_ranks_that_count_their_payloads_apart_raise_layout_mismatch():
    """payload_bytes chooses the copies, so ranks that pass different ones would make different
    calls: it is part of the call's layout, and they raise LayoutMismatch alike."""
    assert get_cluster(2, chunk_bytes=CHUNK_BYTES).run(tasks.payload_claims_differ) == [("LayoutMismatch", True)] * 2


def test_argument_errors_are_clear_and_send_nothing():
    for wrong in get_cluster(2, chunk_bytes=CHUNK_BYTES).run(tasks.argument_errors):
        assert wrong == [], wrong


def test_a_tensor_of_no_elements_takes_its_empty_mask():
    """chunk_mask gives a tensor of no elements an empty mask; the call takes it (it was refused
    as invalid arguments before)."""
    for done in get_cluster(2, chunk_bytes=CHUNK_BYTES).run(tasks.empty_calls_with_masks):
        assert done == [("all_gather", 1.0), ("all_to_all", 1.0)]


def test_a_scratch_output_takes_the_pieces_straight(monkeypatch):
    """scratch_output: where the blocks are whole words and the output is apart from the input,
    the pieces land in it with no buffer borrowed (and no copy out of one); otherwise as before.
    One rank, in this process (what is checked is the exact layer's choice of buffer)."""
    import torch

    from ud_transport import exact

    borrowed = []
    real = exact._borrowed

    def counting(comm, count):
        borrowed.append(count)
        return real(comm, count)
    monkeypatch.setattr(exact, "_borrowed", counting)
    import torch.distributed as dist

    comm = ud_transport.init(0, 1, store=dist.HashStore(), bind_address="127.0.0.1")
    try:
        source = torch.arange(8, dtype=torch.float32)
        for scratch, output, expected_borrows in ((True, torch.zeros(8), 0), (False, torch.zeros(8), 1),
                                                  (True, source, 1)):  # in place: not straight
            borrowed.clear()
            exact.all_to_all(comm, source, output, scratch_output=scratch)
            assert torch.equal(output, torch.arange(8, dtype=torch.float32)) and len(borrowed) == expected_borrows, (
                scratch, borrowed)
        bytes_ = torch.arange(6, dtype=torch.uint8)  # a block of 6 bytes is not whole words: padded, as before
        out = torch.zeros(6, dtype=torch.uint8)
        borrowed.clear()
        exact.all_to_all(comm, bytes_, out, scratch_output=True)
        assert torch.equal(out, bytes_) and len(borrowed) == 2
    finally:
        comm.close()


def test_a_value_is_agreed_with_the_pieces():
    """agree_value rides the call's verdict: every rank reads the largest any rank passed, the
    pieces arrive as in any call, and a value outside 32 bits is refused clearly."""
    for agreed, right, errors in get_cluster(3, chunk_bytes=CHUNK_BYTES).run(tasks.agreed_values, [0, 7, 3]):
        assert agreed == 7 and right, (agreed, right)
        assert len(errors) == 3 and all("agree_value must be an integer in [0, 2**32)" in e for e in errors), errors


@pytest.mark.parametrize("nbytes", [3 * 1364, 3 << 18])
def test_an_exact_exchange_one_rank_declines_writes_nothing_anywhere(nbytes):
    """exact.all_to_all with agree_value: where one rank passes 1 every rank returns None and
    leaves its output as it was (a small call, and one of REPAIR_MIN_CHUNKS chunks or more,
    which goes in one copy), and the ranks' next call pairs as usual."""
    for returned, kept, right in get_cluster(3, chunk_bytes=CHUNK_BYTES * 64).run(tasks.declined_then_exchanged, 2,
                                                                                    nbytes):
        assert returned is None and kept and right, (returned, kept, right)


def test_an_agree_value_out_of_range_is_refused_in_step():
    """Refused before the first engine call, with an agreement round in its place: the others'
    call ends in LayoutMismatch naming rank 0 at once, rather than waiting for it."""
    assert get_cluster(2, chunk_bytes=CHUNK_BYTES).run(tasks.agree_value_refused_on_one_rank) == ["ValueError",
                                                                                                 "LayoutMismatch"]


# all_to_all_pieces: every pair's piece of its own size (0 to 2 world + 2 elements, times
# `scale`), from nothing but each rank's own sizes. CHUNK_BYTES 24: a float32 piece of 7 elements
# is two chunks, the second short.
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("scale", [1, 9])
def test_pieces_of_their_own_sizes_arrive_whole(world, scale):
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    per_rank = cluster.run(tasks.sized_exchange, scale, "float32", 3)
    for call in range(3):
        for rank in range(world):
            output, mask, stats, input_kept = per_rank[rank][call]
            _, takes = tasks.pieces_of(rank, world, scale, call)
            want = np.concatenate([tasks.piece_values(sender, rank, takes[sender], "float32", call)
                                   for sender in range(world)] + [np.zeros(0, np.float32)])
            np.testing.assert_array_equal(output, want, err_msg=f"rank {rank} call {call}")
            assert input_kept and mask.all() and stats.gather_fraction == stats.delivered_fraction == 1.0
            # each piece crossed once, unpadded: the chunks of what this rank takes from the others
            assert stats.datagrams_received == sum(-(-takes[p] * 4 // CHUNK_BYTES) for p in range(world) if p != rank)


@pytest.mark.parametrize("world, skew", [(2, (0, 1)), (3, (2, 0)), (5, (1, 3))])
def test_pieces_whose_sizes_disagree_fail_alike_on_every_rank(world, skew):
    """Rank skew[1] takes one element more from skew[0] than skew[0] sends: no rank can see that
    alone, and every rank raises the same LayoutMismatch, its output untouched."""
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    per_rank = cluster.run(tasks.sized_exchange, 3, "float32", 1, skew)
    for rank, [(kind, message, output)] in enumerate(per_rank):
        assert kind == "LayoutMismatch", (rank, kind, message)
        assert "pieces disagree" in message
        assert (output == -1).all()
    # and the next call, whose sizes agree, goes through
    for rank, [(output, mask, stats, _)] in enumerate(cluster.run(tasks.sized_exchange, 3, "float32", 1)):
        assert mask.all() and stats.gather_fraction == 1.0


# Under loss: small exchanges are repeated whole (in three copies) until held, larger ones (64
# chunks or more on some rank) repaired in two exact calls (each rank's bitmap of what it lacks
# from each sender, then those chunks). Rows of 4, 6 and 3 bytes: whole words, pieces padded to
# the next word, a word per row.
@pytest.mark.parametrize("world, scale, loss, row_bytes", [
    (3, 2, 0.2, 4), (3, 40, 0.1, 4), (4, 40, 0.3, 6), (3, 30, 0.1, 3), (2, 0, 0.2, 4)])
def test_pieces_of_their_own_sizes_are_exact_under_loss(world, scale, loss, row_bytes):
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES, inject=ud_transport.Bernoulli(loss, seed=5))
    per_rank = cluster.run(tasks.exact_sized_exchanges, scale, 4, row_bytes)
    repeated = 0
    for rank in range(world):
        for call, (output, engine_calls, input_kept) in enumerate(per_rank[rank]):
            np.testing.assert_array_equal(output, tasks.expected_sized_output(rank, world, scale, call, row_bytes),
                                          err_msg=f"rank {rank} call {call}")
            assert input_kept
            repeated += engine_calls > 1
    assert repeated or scale == 0, "the loss must have cost some call a repeat or a repair"


def test_lost_chunks_of_pieces_of_their_own_sizes_keep_the_old_value_and_the_mask_names_them():
    """Lossy (loss budget 1): the mask has one entry per chunk of each piece taken, in rank order
    (a piece's last chunk short); a chunk that did not arrive keeps the output's old value, the
    own piece is always there, and the fractions count elements, each rank's of its own output."""
    world, scale, calls = 3, 9, 6
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES, inject=ud_transport.Bernoulli(0.2, seed=3))
    per_rank = cluster.run(tasks.sized_exchange, scale, "float32", calls, None, 1.0)
    step = CHUNK_BYTES // 4
    stale_seen = 0
    for rank in range(world):
        for call, (output, mask, stats, input_kept) in enumerate(per_rank[rank]):
            _, takes = tasks.pieces_of(rank, world, scale, call)
            want = np.concatenate([tasks.piece_values(p, rank, takes[p], "float32", call) for p in range(world)])
            bounds = [(start + first, min(start + first + step, start + takes[p]))
                      for p, start in enumerate(np.cumsum([0] + takes[:-1])) for first in range(0, takes[p], step)]
            assert mask.shape == (len(bounds),) and input_kept
            fresh = np.zeros(len(want), dtype=bool)
            for arrived, (first, stop) in zip(mask, bounds):
                np.testing.assert_array_equal(output[first:stop], want[first:stop] if arrived else -1)
                fresh[first:stop] = bool(arrived)
            own = slice(sum(takes[:rank]), sum(takes[:rank + 1]))
            assert fresh[own].all()
            assert stats.own_gather_fraction == pytest.approx(fresh.mean() if len(want) else 1.0, abs=1e-9)
            assert stats.gather_fraction <= stats.own_gather_fraction
            stale_seen += int((mask == 0).sum())
    assert stale_seen > 0, "20% loss must leave some chunks stale"


@pytest.mark.parametrize("world", [1, 2])
def test_pieces_refused_on_one_rank(world):
    """Refused before anything is sent, the output untouched (a refusal of one rank alone: the
    test makes it on every rank at once)."""
    for out in get_cluster(world, chunk_bytes=CHUNK_BYTES).run(tasks.sized_refusals):
        kind, message, kept = out.pop("in place")
        assert (kind, kept) == ("ValueError", True) and "overlaps the input" in message, message
        if world == 1:
            kind, message, kept = out.pop("takes more than it sends")
            assert (kind, kept) == ("ValueError", True) and "a world of one" in message, message
        assert not out
