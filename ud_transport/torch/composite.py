"""The collectives c10d asks for that the engine has no schedule of its own for, built from the
exact ones: reduce (an exact allreduce whose result only the root keeps), scatter (the exact
scatter: each piece sent once, from the root to its rank), all-to-all on the engine's own
all_to_all (each piece straight to its receiver: in the guessed call of a repeated even
split, bare; otherwise headed by its sender's split sizes, pieces of uneven sizes padded; a
declined guess or a second call sends pieces again); and sparse allreduce. gather is the
backend's, an exact gather (each shard sent once, to the root).

Each function runs on the backend's worker and is called on every rank of the group alike.
"""
import weakref

import numpy as np
import torch

from .. import exact


def reduce(comm, tensor, op, root, deadline, collective="reduce"):
    """The root's tensor becomes the reduction of every rank's; the others keep theirs.
    `collective` (with the root and op) is checked across ranks: an allreduce, or a reduce to
    another root, on some rank is LayoutMismatch on every rank."""
    work = tensor.contiguous() if comm.rank == root else tensor.clone()
    exact.allreduce(comm, work, op, deadline=deadline, collective=(collective, root))
    if comm.rank == root and work.data_ptr() != tensor.data_ptr():
        tensor.copy_(work)


def sparse_allreduce(comm, tensor, deadline, collective):
    """A sparse COO tensor becomes the sum of every rank's, as Gloo's sparse allreduce: every rank's
    entry count, then its indices and values (padded to the largest count) are all-gathered
    exactly, concatenated in rank order and coalesced, so every rank sums the same entries in the
    same order (bitwise the same result everywhere). `collective` (with the shape and dtype) is
    checked across ranks; a dense tensor elsewhere is LayoutMismatch."""
    claim = (collective, tuple(tensor.shape), str(tensor.dtype), tensor.sparse_dim())
    mine = tensor.coalesce()
    indices, values = mine.indices().contiguous(), mine.values().contiguous()
    n = comm.world_size
    counts = torch.empty(n, dtype=torch.int64)
    exact.all_gather(comm, torch.tensor([indices.shape[1]], dtype=torch.int64), counts, deadline=deadline,
                     collective=("sparse entries",) + claim)
    most = int(counts.max())
    padded_indices = torch.zeros((indices.shape[0], most), dtype=torch.int64)
    padded_indices[:, :indices.shape[1]] = indices
    padded_values = torch.zeros((most,) + tuple(values.shape[1:]), dtype=values.dtype)
    padded_values[:values.shape[0]] = values
    all_indices = torch.empty((n,) + tuple(padded_indices.shape), dtype=torch.int64)
    all_values = torch.empty((n,) + tuple(padded_values.shape), dtype=values.dtype)
    exact.all_gather(comm, padded_indices, all_indices, deadline=deadline, collective=("sparse indices",) + claim)
    exact.all_gather(comm, padded_values, all_values, deadline=deadline, collective=("sparse values",) + claim)
    kept = [int(count) for count in counts]
    summed = torch.sparse_coo_tensor(torch.cat([all_indices[r][:, :kept[r]] for r in range(n)], dim=1),
                                     torch.cat([all_values[r][:kept[r]] for r in range(n)]), tensor.shape).coalesce()
    tensor.copy_(summed)


def scatter(comm, output, pieces, root, deadline, collective="scatter"):
    """output gets the root's pieces[rank] (pieces: the root's list of world_size tensors), each
    piece sent once. `collective` is checked across ranks: a broadcast of as many bytes elsewhere
    is LayoutMismatch."""
    stacked = torch.stack([piece.reshape(-1) for piece in pieces]) if comm.rank == root else None
    exact.scatter(comm, stacked, output, root, deadline=deadline, collective=collective)  # as_words writes it back


def check_scatter_pieces(pieces, output, world_size):
    """ValueError unless pieces are world_size tensors of output's size and dtype (the root's check)."""
    if len(pieces) != world_size or any(p.numel() != output.numel() or p.dtype != output.dtype for p in pieces):
        raise ValueError(f"scatter on 'ud' needs {world_size} pieces of {output.numel()} {output.dtype} elements "
                         f"(the output's), got {[(p.numel(), p.dtype) for p in pieces]}")


def all_to_all(comm, output, source, output_splits, input_splits, deadline):
    """all_to_all_single: rows of `source` (split along dim 0 by input_splits, evenly if empty) go
    to the ranks in order; `output` gets each rank's rows for this one, in rank order (its dim 0
    split by output_splits). Unless a guessed call (below) is the whole exchange, every rank's
    splits (even ones too: a rank may pass sizes where another splits evenly, as Gloo allows)
    travel with the first call, each piece headed by its sender's split sizes, so every rank reads
    every rank's and checks them against each other: a mismatch is the same `ValueError` on every
    rank.

    That first call's pieces are padded to the width of the group's last all_to_all's widest
    piece (a quarter more after an uneven call: _next_width): where this call's pieces fit, the
    first call is the whole exchange. Otherwise (the first call of a group, wider pieces now, or
    past SPECULATED_PIECE_MAX_BYTES) it carries the split sizes alone, and the pieces follow in
    a second call, padded to the largest (or straight from `source` where every piece is full).
    Before all that, after even calls in one shape, a
    call goes straight from `source` and agrees in its verdict whether every rank's was that
    shape (_even_call); only where one rank's was not does the rest follow. The width and the
    shape are chosen from agreed tables and verdicts only, so every rank makes the same calls; a
    LayoutMismatch on the group (counted alike everywhere) forgets them."""
    n = comm.world_size
    row, sends, receives = plan_all_to_all(output, source, output_splits, input_splits, n)
    element = source.element_size()
    row_bytes = row * element
    source = source.resolve_conj().resolve_neg()  # a conjugate view's bytes are not its values
    flat = source.contiguous().view(-1).view(torch.uint8)
    state = _state_of(comm)
    if state.guess() is not None and _even_call(comm, state, flat, output, sends, receives, row_bytes, element,
                                                deadline):
        return
    width = state.width
    # No error forgets the width here: an agreed one leaves every rank's alike, a LayoutMismatch
    # forgets it everywhere (_state_of), and one rank's own (a torch error, an interrupt) would
    # leave that rank's apart from the others' and fail the next, correct call.
    pieces = _pieces(comm, flat, sends, row_bytes, width, deadline, header=sends + receives + [row, element])
    # every rank's header, as the (n, 2n + 2) table; numpy: a few microseconds an operation on a
    # table this small, where torch's take ~10
    table = pieces[:, :_header_bytes(n)].numpy().copy().view(np.int64)
    _check_table(table, n)
    widest = int(table[:, :n].max()) * row_bytes  # the largest piece any rank sends any rank
    full = bool((table[:, :2 * n] * row_bytes == widest).all())  # every piece that wide: no padding
    state.width = _next_width(widest, full, row_bytes)
    state.note_even((widest, row_bytes, element) if full and widest else None)
    if widest == 0 or widest <= width:
        _copy_out(output, pieces, receives, row_bytes, _header_bytes(n))
    elif full:
        exact.all_to_all(comm, source, output, deadline=deadline)  # rows split evenly = bytes split evenly
    else:
        _copy_out(output, _pieces(comm, flat, sends, row_bytes, widest, deadline), receives, row_bytes, 0)


# The widest piece the first call of an all_to_all pads to (after _next_width's quarter: a width
# past it is none, and the sizes go alone). Its pieces are copied into a padded buffer and out of
# it, where the exchange of split sizes it saves is one small exact call. At 8 ranks on a bridge
# (MTU 1500) it saved a third of a 64 KiB call, and nothing of a 4 MiB one (512 KiB pieces), whose
# copies on 2 cores cost what the exchange did (exact_allreduce.md). Past it, uneven calls padded
# to the last widest piece and a quarter took 1.25x the bytes, 7% less time at 1 MiB and 7% more
# at 4 MiB (8 ranks; pytorch_step_time.md, "Uneven splits"), so the cap holds for them too.
SPECULATED_PIECE_MAX_BYTES = 128 << 10


# The guess, before any of that: once calls have been even everywhere in one shape, the next goes
# straight from `source` in one exact all_to_all, with no header, padding or table, and says with
# the call's verdict whether this rank's call had that shape (agree_value: 0 if so). Where every
# rank's did, that call is the whole exchange; where one rank's did not, every rank learns it from
# the same verdict, drops that call's pieces and goes on as above. A decline costs a whole exchange
# (the verdict follows the data), so each one doubles the even calls in a row the next guess waits
# for (up to MOST_EVEN_CALLS_ASKED), and only as many guesses taken since halve it again: a loop
# that repeats a shape fewer times than that between other calls stops guessing. Measured against
# the padded first call alone (pytorch_step_time.md): 2 ranks on loopback, 4 KiB, 1.36-1.45x
# Gloo's p50 against 1.76-1.83x; 8 on a bridge, 1 MiB, 26 ms against 31-33; 4 MiB (past the cap,
# where the sizes went alone first) 50 ms against 58-59. The state is changed only from agreed
# tables and verdicts, so it stays alike on every rank, but for a call that fails on one rank alone
# (as the width above).
MOST_EVEN_CALLS_ASKED = 64


class _AllToAllState:
    """What a group's all_to_all calls carry from one call to the next (see above), changed only
    from agreed tables and verdicts."""
    __slots__ = ("width", "shape", "in_a_row", "declines", "taken", "mismatches")

    def __init__(self, mismatches):
        self.width = 0         # what the next first call pads its pieces to (0: the sizes alone)
        self.shape = None      # (piece bytes, row bytes, element bytes) of the last even calls
        self.in_a_row = 0      # even calls in a row in that shape
        self.declines = 0      # the next guess waits for 2 ** declines of them
        self.taken = 0         # guesses taken since the last change of `declines` (not in a row)
        self.mismatches = mismatches

    def guess(self):
        """The shape the next call is guessed to have on every rank, or None: no guess now."""
        wanted = self.in_a_row >= min(2 ** self.declines, MOST_EVEN_CALLS_ASKED)
        return self.shape if self.shape is not None and wanted else None

    def note_even(self, shape):
        """After a call whose agreed table showed `shape` even everywhere (None: not even)."""
        self.in_a_row = self.in_a_row + 1 if shape is not None and shape == self.shape else int(shape is not None)
        self.shape = shape


_states = weakref.WeakKeyDictionary()  # communicator -> _AllToAllState


def _state_of(comm):
    return exact.state_since_mismatch(_states, comm, _AllToAllState)  # forgotten alike on every rank


def _even_call(comm, state, flat, output, sends, receives, row_bytes, element, deadline):
    """The guessed call (see above): True if it was the whole exchange; False if some rank's call
    did not have the assumed shape (every rank alike), and nothing was written."""
    shape = state.shape
    mine = (min(sends) == max(sends) == min(receives) == max(receives)
            and (sends[0] * row_bytes, row_bytes, element) == shape)
    if mine:
        source, target = flat, output
    else:  # this rank's call is another: the bytes of the others' guess, and a decline
        source = torch.zeros(comm.world_size * shape[0], dtype=torch.uint8)
        target = torch.empty_like(source)
    stats = exact.all_to_all(comm, source, target, deadline=deadline, collective=("all_to_all even",) + shape,
                             scratch_output=not mine, agree_value=0 if mine else 1)
    if stats is None:
        state.shape, state.in_a_row, state.taken = None, 0, 0
        state.declines = min(state.declines + 1, MOST_EVEN_CALLS_ASKED.bit_length() - 1)
        return False
    state.in_a_row += 1
    state.taken += 1
    if state.declines and state.taken >= 2 ** state.declines:
        state.declines, state.taken = state.declines - 1, 0
    return True


def _header_bytes(world_size):
    """A piece's header: its sender's sends and receives (rows per rank), row elements and element bytes."""
    return 8 * (2 * world_size + 2)


def _next_width(widest, full, row_bytes):
    """The width the next first call pads its pieces to, after a call whose widest piece was
    `widest` (all of them, if `full`): that width for an even call; for an uneven one (a mixture
    of experts' routing, drawn anew each step) UNEVEN_HEADROOM more, in whole rows, so that the
    next call's pieces mostly fit and it goes in one call, not the sizes first and the pieces
    after; 0 (no padding: the sizes alone) past SPECULATED_PIECE_MAX_BYTES."""
    width = widest if full else -(-widest * UNEVEN_HEADROOM[0] // (UNEVEN_HEADROOM[1] * row_bytes)) * row_bytes
    return width if width <= SPECULATED_PIECE_MAX_BYTES else 0


# After an uneven call, the next first call pads its pieces to the widest piece and a quarter.
UNEVEN_HEADROOM = (5, 4)


def _padded(flat, sends, row_bytes, width, header=None):
    """(n, header + width) bytes: piece q of `flat` (sends[q] rows) in row q after `header`, zeros
    after. If any piece is wider than `width`, none goes: the table will show it, and every rank
    sends its pieces again in a second call."""
    n = len(sends)
    head = 0 if header is None else _header_bytes(n)
    rows = torch.empty((n, head + width), dtype=torch.uint8, device="cpu")  # each byte written once below
    if header is not None:
        rows[:, :head] = torch.from_numpy(np.array(header, dtype=np.int64).view(np.uint8))
    if min(sends) == max(sends) and sends[0] * row_bytes <= width:  # even: one copy
        piece = sends[0] * row_bytes
        rows[:, head:head + piece] = flat.view(n, piece)
        rows[:, head + piece:].zero_()  # a kept buffer's bytes are not the peers' to read
        return rows
    rows[:, head:].zero_()
    if max(sends) * row_bytes > width:
        return rows
    for receiver, piece in enumerate(flat.split([count * row_bytes for count in sends])):
        rows[receiver, head:head + piece.numel()] = piece
    return rows


def _pieces(comm, flat, sends, row_bytes, width, deadline, header=None):
    """One exact all_to_all of this rank's pieces, each padded to `width` bytes (after `header`,
    this rank's split sizes, in the first call; "all_to_all" alone in the second). Returns the
    pieces received, headers included."""
    source = _padded(flat, sends, row_bytes, width, header)
    received = torch.empty_like(source)
    collective = "all_to_all" if header is None else ("all_to_all with splits", width)
    # copies are chosen by the pieces' width, headers aside (the same on every rank: a 64 KiB call
    # with its headers is still a small call, whose copies follow exact._FirstCallCopies); a call
    # of headers alone by its size
    exact.all_to_all(comm, source.view(-1), received.view(-1), deadline=deadline, collective=collective,
                     scratch_output=True, payload_bytes=len(sends) * width if width else None)
    return received


def _copy_out(output, pieces, receives, row_bytes, head):
    """Each sender's rows (after `head` header bytes of its piece) into `output`, in rank order."""
    if min(receives, default=0) == max(receives, default=0):  # even: one copy
        got = pieces[:, head:head + receives[0] * row_bytes].reshape(-1)
    else:
        got = torch.cat([pieces[sender, head:head + count * row_bytes] for sender, count in enumerate(receives)])
    output.copy_(got.view(output.dtype).view(output.shape))


def plan_all_to_all(output, source, output_splits, input_splits, world_size):
    """(elements per row, rows sent to each rank, rows received from each): ValueError for what
    this rank alone can tell is wrong (checked before the call is queued)."""
    row = _row_elements(source, output)
    if source.dtype != output.dtype:
        raise ValueError(f"all_to_all_single on 'ud': input {source.dtype}, output {output.dtype}")
    return row, _splits(input_splits, source, world_size, "input"), _splits(output_splits, output, world_size, "output")


def _row_elements(source, output):
    """Elements per dim-0 row: the two tensors must agree on the other dimensions."""
    if source.dim() == 0 or output.dim() == 0 or source.shape[1:] != output.shape[1:]:
        raise ValueError(f"all_to_all_single on 'ud' needs tensors of at least one dimension that agree past "
                         f"dim 0, got input {tuple(source.shape)} and output {tuple(output.shape)}")
    row = 1
    for size in source.shape[1:]:
        row *= size
    return row


def _splits(splits, tensor, world_size, which):
    """The rows per rank: `splits` as given (world_size counts summing to dim 0), or dim 0 evenly."""
    rows = tensor.shape[0]
    if not splits:
        if rows % world_size:
            raise ValueError(f"all_to_all_single on 'ud': {which} has {rows} rows, not a multiple of "
                             f"{world_size} ranks; pass {which}_split_sizes")
        return [rows // world_size] * world_size
    splits = [int(count) for count in splits]
    if len(splits) != world_size or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"all_to_all_single on 'ud': {which}_split_sizes {splits} must be {world_size} "
                         f"counts summing to the {which}'s {rows} rows")
    return splits


def _check_table(table, world_size):
    """Every rank's sends against their receivers' receives, the row size and the element size;
    the same on every rank."""
    table = np.asarray(table)
    rows, elements = table[:, 2 * world_size], table[:, 2 * world_size + 1]
    if not bool((rows == rows[0]).all()):
        raise ValueError(f"all_to_all_single on 'ud': the ranks' rows differ in size ({rows.tolist()} elements)")
    if not bool((elements == elements[0]).all()):
        raise ValueError(f"all_to_all_single on 'ud': the ranks' elements differ in size ({elements.tolist()} bytes)")
    sends, receives = table[:, :world_size], table[:, world_size:2 * world_size]
    mismatched = np.argwhere(sends != receives.T)
    if len(mismatched):
        sender, receiver = (int(i) for i in mismatched[0])
        raise ValueError(f"all_to_all_single on 'ud': rank {sender} sends {int(sends[sender, receiver])} rows to rank "
                         f"{receiver}, which expects {int(receives[receiver, sender])}")
