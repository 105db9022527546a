"""An exact all-to-all whose pieces each have their own size, as a mixture of experts routes a
different number of tokens to each rank every step (torch's all_to_all_single with split sizes).

Every rank passes only its own sizes, what it sends each rank and what it takes from each, and
nothing is exchanged to learn the others': one engine call (``Communicator.all_to_all_pieces``)
moves every piece once, unpadded, and its verdict carries a checksum of every rank's sizes, so
that where what one rank sends another is not what that rank takes, every rank raises the same
LayoutMismatch. Pieces travel as 32-bit words; the byte counts of the caller's rows map to word
counts one to one (see _words), so a disagreement in rows is one in words too.
"""
import contextlib
import weakref

from .errors import LossBudgetExceeded
from .exact import (DEFAULT_ATTEMPTS, REPAIR_MIN_CHUNKS, SMALL_CALL_BYTES, SMALL_CALL_COPIES, _borrowed,
                    _FirstCallCopies, _repair_copies, _salt, _with_copies, state_since_mismatch)

# An exchange is small where no rank takes REPAIR_MIN_CHUNKS chunks or more (agreed in its first
# call's verdict): a miss is then repeated whole, in SMALL_CALL_COPIES copies, and the next small
# exchanges' first calls go in those copies too while they keep missing (exact._FirstCallCopies:
# at 8 ranks on a bridge with 1% loss, a 64 KiB all_to_all took 14 ms where its first call went
# in one copy, against 7-9 ms with the copies). No rank knows before a call whether it is small,
# so the last exchange's size stands for it, alike on every rank.


class _Exchanges:
    """What a communicator's exchanges carry from one to the next, read from agreed outcomes."""
    __slots__ = ("copying", "small", "mismatches")

    def __init__(self, mismatches):
        self.copying = _FirstCallCopies(mismatches)
        self.small = True
        self.mismatches = mismatches

    def first_copies(self):
        return self.copying.copies(0 if self.small else SMALL_CALL_BYTES + 1)

    def note(self, copies, first):
        """After a first call in `copies`: its agreed outcome and size."""
        self.small = first.agreed_value < REPAIR_MIN_CHUNKS
        self.copying.note(copies, 0 if self.small else SMALL_CALL_BYTES + 1, missed=first.gather_fraction < 1.0)


_exchanges = weakref.WeakKeyDictionary()  # communicator -> _Exchanges


def words_per_piece(rows, row_bytes):
    """The 32-bit words a piece of `rows` rows of `row_bytes` travels as: its bytes in words where
    rows are whole words; padded to the next word where rows are longer than 4 bytes (two row
    counts then never share a word count); a word per row below 4 bytes, empty rows too (1-byte
    rows' counts would share one, and empty rows' all would)."""
    if row_bytes % 4 == 0 and row_bytes:
        return rows * row_bytes // 4
    if row_bytes > 4:
        return -(-rows * row_bytes // 4)
    return rows


def all_to_all(comm, source, output, send_rows, take_rows, row_bytes, *, attempts=DEFAULT_ATTEMPTS, deadline=None,
               collective="all_to_all pieces", copies=None):
    """`source` (a contiguous uint8 torch tensor) holds this rank's pieces back to back,
    ``send_rows[q]`` rows of `row_bytes` for rank q; `output` (the same) takes ``take_rows[p]``
    rows from each rank p, in rank order, written only on success. Calls with a chunk mask until
    every rank holds every piece (agreed): the first call's outcome and the most chunks any rank
    takes (agreed in its verdict) decide alike on every rank whether what is missing is repaired
    (_repair) or the exchange repeated whole in SMALL_CALL_COPIES copies (see _Exchanges).
    `copies`: the first call's, the same on every rank (a repair's own exchanges); None: as the
    communicator's last exchanges met loss (_Exchanges). `collective`: what the caller's call is, checked across ranks with
    `row_bytes` (LayoutMismatch where they differ). Returns the stats of each call."""
    send_words = [words_per_piece(rows, row_bytes) for rows in send_rows]
    take_words = [words_per_piece(rows, row_bytes) for rows in take_rows]
    salt = _salt(collective, row_bytes)
    with contextlib.ExitStack() as stack:
        words = _packed(stack, comm, source, send_rows, send_words, row_bytes)
        received = stack.enter_context(_borrowed(comm, sum(take_words)))
        mask = comm.chunk_mask("all_to_all", received, takes=take_words)
        chunks = min(mask.size, 0xFFFFFFFF)

        def attempt(copies, chunk_mask):
            return comm.all_to_all_pieces(words, received, send_words, take_words, loss_budget=1.0,
                                          deadline=deadline, chunk_mask=chunk_mask, copies=copies,
                                          direct_output=True, layout_salt=_with_copies(salt, copies),
                                          agree_value=chunks)

        exchanges = state_since_mismatch(_exchanges, comm, _Exchanges) if copies is None else None
        first_copies = exchanges.first_copies() if exchanges else copies
        calls = [attempt(first_copies, mask)]
        if exchanges:
            exchanges.note(first_copies, calls[0])
        if calls[0].gather_fraction < 1.0 and calls[0].agreed_value >= REPAIR_MIN_CHUNKS:  # agreed, both
            calls += _repair(comm, words, received, mask.astype(bool), send_words, take_words, attempts, deadline,
                             calls[0])
        elif calls[0].gather_fraction < 1.0:  # a small exchange: repeated whole, keeping what arrived
            held = mask.astype(bool)
            for _ in range(attempts - 1):
                if not comm.agree(not held.all(), deadline=deadline):
                    break
                mask = comm.chunk_mask("all_to_all", received, takes=take_words)
                calls.append(attempt(SMALL_CALL_COPIES, mask))
                held |= mask.astype(bool)
            else:
                if comm.agree(not held.all(), deadline=deadline):
                    raise LossBudgetExceeded(f"rank {comm.rank}: exact all_to_all of pieces still incomplete after "
                                             f"{attempts} attempts", calls[-1])
        _unpacked(received, output, take_rows, take_words, row_bytes)
    return calls


def _repair(comm, words, received, held, send_words, take_words, attempts, deadline, first):
    """Fill the chunks of `received` some rank lacks, in two exact all-to-alls of pieces whose
    sizes both ends know: each rank sends each sender a bitmap of the chunks of its piece that it
    lacks, then each sender sends each rank those chunks (each padded to a whole chunk). Each is
    itself exact (repaired or repeated until held), so one round fills every hole. Returns the
    stats of their calls. The bitmaps go in SMALL_CALL_COPIES from the first call; the chunks in
    the copies exact._repair_copies finds cheapest for the loss the first call met (`first`: the
    worst rank's share lacking, and the most chunks a rank takes, agreed)."""
    import numpy as np
    import torch

    step = comm.chunk_elements("int32")
    taken_chunks = [-(-count // step) for count in take_words]
    sent_chunks = [-(-count // step) for count in send_words]
    bounds = np.cumsum([0] + taken_chunks)
    lacking = [np.flatnonzero(~held[bounds[p]:bounds[p + 1]]) for p in range(comm.world_size)]  # per sender
    # 1. what each rank lacks of each sender's piece, as bits, to that sender
    bitmaps = torch.zeros(sum(-(-count // 32) for count in taken_chunks) * 4, dtype=torch.uint8)
    at = 0
    for p, count in enumerate(taken_chunks):
        bits = np.zeros(-(-count // 32) * 32, dtype=bool)
        bits[lacking[p]] = True
        packed = np.packbits(bits, bitorder="little")
        bitmaps[at:at + packed.size] = torch.from_numpy(packed)
        at += packed.size
    asked = torch.empty(sum(-(-count // 32) for count in sent_chunks) * 4, dtype=torch.uint8)
    calls = all_to_all(comm, bitmaps, asked, [-(-count // 32) for count in taken_chunks],
                       [-(-count // 32) for count in sent_chunks], 4, attempts=attempts, deadline=deadline,
                       collective="all_to_all pieces: lacking", copies=SMALL_CALL_COPIES)
    # 2. the chunks each rank lacks, from each sender, whole chunks of `step` words
    bits = np.unpackbits(asked.numpy(), bitorder="little").astype(bool)
    wanted, at = [], 0
    for q, count in enumerate(sent_chunks):
        wanted.append(np.flatnonzero(bits[at:at + count]))
        at += -(-count // 32) * 32
    outgoing = torch.zeros(sum(len(w) for w in wanted) * step, dtype=torch.int32)
    rows, elements = _chunk_elements(wanted, send_words, step)
    outgoing.view(-1, step)[rows] = words[elements]
    incoming = torch.empty(sum(len(chunks) for chunks in lacking) * step, dtype=torch.int32)
    calls += all_to_all(comm, outgoing.view(torch.uint8), incoming.view(torch.uint8), [len(w) for w in wanted],
                        [len(chunks) for chunks in lacking], 4 * step, attempts=attempts, deadline=deadline,
                        collective="all_to_all pieces: repair", copies=_chunk_copies(comm, first))
    rows, elements = _chunk_elements(lacking, take_words, step)
    received[elements] = incoming.view(-1, step)[rows]
    return calls


def _chunk_copies(comm, first):
    """A repair's copies, alike on every rank: from the first call's agreed loss (the worst rank's
    share lacking, at most a half) and the most chunks a rank takes, as if every rank lacked as
    much."""
    loss = min(0.5, 1.0 - first.gather_fraction)
    lacking = max(1.0, loss * first.agreed_value * comm.world_size)
    return _repair_copies(loss, lacking, lacking, first.agreed_value * comm.world_size)


def _chunk_elements(chunks, piece_words, step):
    """For the chunks `chunks[p]` of each piece p (of `piece_words[p]` words, back to back), one
    after another as rows of `step` words: (a boolean mask of the rows' words that hold a chunk's
    word, every such word's index in the pieces), in the same order."""
    import numpy as np
    import torch

    starts = np.cumsum([0] + list(piece_words))
    first = np.concatenate([starts[p] + np.asarray(c, dtype=np.int64) * step for p, c in enumerate(chunks)] +
                           [np.zeros(0, dtype=np.int64)])
    ends = np.concatenate([np.full(len(c), starts[p + 1], dtype=np.int64) for p, c in enumerate(chunks)] +
                          [np.zeros(0, dtype=np.int64)])
    index = first[:, None] + np.arange(step)[None, :]
    inside = index < ends[:, None]  # a piece's last chunk may be short
    return torch.from_numpy(inside), torch.from_numpy(index[inside])


def _packed(stack, comm, source, rows, words, row_bytes):
    """`source`'s pieces as int32 words, each piece `words[q]` of them: `source` itself where its
    rows are whole words (and it is aligned), else a borrowed buffer with each piece or row padded
    with zeros."""
    import torch

    nbytes = source.numel()
    if row_bytes % 4 == 0 and row_bytes and source.data_ptr() % 4 == 0:
        return source.view(torch.int32) if nbytes else torch.empty(0, dtype=torch.int32)
    packed = stack.enter_context(_borrowed(comm, sum(words)))
    into = packed.view(torch.uint8)
    into.zero_()  # a kept buffer's bytes are not the peers' to read
    if row_bytes >= 4:  # piece by piece: padded to its next word
        start = 0
        for piece_rows, piece_words, first in zip(rows, words, _starts(words)):
            length = piece_rows * row_bytes
            into[4 * first:4 * first + length] = source[start:start + length]
            start += length
    else:  # row by row, each in a word of its own
        total = sum(rows)
        into.view(-1, 4)[:total, :row_bytes] = source[:total * row_bytes].view(total, row_bytes)
    return packed


def _unpacked(received, output, rows, words, row_bytes):
    """The pieces in `received` (int32 words, as _packed laid them out) into `output`'s bytes."""
    import torch

    got = received.view(torch.uint8)
    if row_bytes % 4 == 0:
        output.copy_(got[:output.numel()])
    elif row_bytes > 4:
        start = 0
        for piece_rows, first in zip(rows, _starts(words)):
            length = piece_rows * row_bytes
            output[start:start + length] = got[4 * first:4 * first + length]
            start += length
    else:
        total = sum(rows)
        output.view(total, row_bytes).copy_(got.view(-1, 4)[:total, :row_bytes])


def _starts(words):
    """Where each piece starts, in words."""
    starts, at = [], 0
    for count in words:
        starts.append(at)
        at += count
    return starts

