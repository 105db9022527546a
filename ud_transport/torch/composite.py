"""The collectives c10d asks for that the engine has no schedule of its own for, built from the
exact ones: reduce (an exact allreduce whose result only the root keeps), scatter (the exact
scatter: each piece sent once, from the root to its rank), all-to-all on the engine's own
all_to_all of pieces each of its own size (each piece straight to its receiver, unpadded, in
one call); and sparse allreduce. gather is the
backend's, an exact gather (each shard sent once, to the root).

Each function runs on the backend's worker and is called on every rank of the group alike.
"""
import torch

from .. import exact, pieces
from ..errors import LayoutMismatch


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
    split by output_splits). One exact all-to-all of pieces each of its own size
    (ud_transport.pieces): every rank knows what it sends and what it takes, so nothing is
    padded and no sizes travel; where one rank's input_split_sizes and another's
    output_split_sizes disagree, every rank raises the same ValueError, outputs untouched. Rows
    or elements of another size on some rank are a LayoutMismatch naming it."""
    row, sends, receives = plan_all_to_all(output, source, output_splits, input_splits, comm.world_size)
    element = source.element_size()
    source = source.resolve_conj().resolve_neg()  # a conjugate view's bytes are not its values
    flat = source.contiguous().view(-1).view(torch.uint8)
    target = output.view(-1).view(torch.uint8) if output.is_contiguous() else \
        torch.empty(output.numel() * element, dtype=torch.uint8)
    try:
        pieces.all_to_all(comm, flat, target, sends, receives, row * element, deadline=deadline,
                          collective=("all_to_all_single", element))
    except LayoutMismatch as error:
        if error.rank >= 0:  # another call on that rank, or rows of another size
            raise
        raise ValueError(SPLITS_DISAGREE) from error
    if not output.is_contiguous():
        output.copy_(target.view(output.dtype).view(output.shape))


SPLITS_DISAGREE = ("all_to_all_single on 'ud': the ranks' split sizes disagree: what some rank sends another "
                   "(its input_split_sizes) is not what that rank takes from it (its output_split_sizes)")


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
