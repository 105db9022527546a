"""What the ranks of the scatter and gather tests run (importable by the cluster's workers)."""
import numpy as np
import torch

from ud_transport import exact
from ud_transport.errors import LayoutMismatch
from all_to_all_tasks import expecting


def block_values(root, receiver, block, call=0):
    """Block `receiver` of the root's tensor in call `call`: no two (call, root, receiver) alike."""
    return (np.arange(block) % 7 + 10 * receiver + 100 * root + 1000 * call).astype(np.float32)


def scatters(comm, block, root, calls, loss_budget):
    """Scatters from `root` into a tensor holding a known old value: per call (the tensor after,
    the chunk mask, the stats)."""
    rows = []
    for call in range(calls):
        n = comm.world_size
        if comm.rank == root:
            tensor = np.concatenate([block_values(root, q, block, call) for q in range(n)])
        else:
            tensor = np.full(n * block, -1.0 - call, dtype=np.float32)
        mask = comm.chunk_mask("scatter", tensor)
        stats = comm.scatter(tensor, src=root, loss_budget=loss_budget, deadline=10.0, chunk_mask=mask)
        rows.append((tensor, mask, stats))
    return rows


def gathers(comm, block, root, calls, loss_budget):
    """Gathers to `root` into an output holding a known old value: per call (the output, the chunk
    mask, the stats, whether the shard is unchanged)."""
    rows = []
    for call in range(calls):
        shard = block_values(comm.rank, root, block, call)
        before = shard.copy()
        output = np.full(comm.world_size * block, -1.0 - call, dtype=np.float32)
        mask = comm.chunk_mask("gather", output)
        stats = comm.gather(shard, output, dst=root, loss_budget=loss_budget, deadline=10.0, chunk_mask=mask)
        rows.append((output, mask, stats, np.array_equal(shard, before)))
    return rows


def chunk_ranges_of(comm, count):
    return comm.chunk_ranges(count, "float32")


def exact_rounds(comm, nbytes, dtype_name, calls):
    """exact.scatter from rank 0, then exact.gather to the last rank, `calls` times: per call
    whether each result is right, and the payload bytes this rank sent in each engine call of
    the scatter and of the gather (the first call, then repeats or repairs)."""
    dtype = getattr(torch, dtype_name)
    n, r = comm.world_size, comm.rank
    count = nbytes // dtype.itemsize
    outcome = []
    for call in range(calls):
        def piece(rank):
            generator = torch.Generator().manual_seed(1000 * call + rank)
            return torch.randint(-100, 100, (count,), generator=generator).to(dtype)
        pieces = torch.cat([piece(q) for q in range(n)]) if r == 0 else None
        received = torch.full((count,), 7).to(dtype)
        scattered = exact.scatter(comm, pieces, received, 0)
        table = torch.full((n * count,), 7).to(dtype) if r == n - 1 else None
        gathered = exact.gather(comm, piece(r), table, n - 1)
        right = torch.equal(received, piece(r)) and (table is None or torch.equal(table, torch.cat([piece(q) for q in range(n)])))
        outcome.append((right, [s.payload_bytes_sent for s in scattered], [s.payload_bytes_sent for s in gathered]))
    return outcome


def mismatches(comm):
    """Calls that differ across ranks (rank 0 against the others): each must end in LayoutMismatch
    on every rank with the tensor kept, and the next call must pair. Returns what went wrong."""
    n, r = comm.world_size, comm.rank
    wrong = []
    cases = {
        "scatter against broadcast": lambda t: comm.scatter(t, src=0, loss_budget=0.0, deadline=10.0) if r == 0
        else comm.broadcast(t, src=0, loss_budget=0.0, deadline=10.0),
        "scatters from other roots": lambda t: comm.scatter(t, src=0 if r == 0 else 1, loss_budget=0.0, deadline=10.0),
        "gather against all_gather": lambda t: comm.gather(t[:4], np.zeros(4 * n, np.float32), dst=0, loss_budget=0.0,
                                                           deadline=10.0) if r == 0
        else comm.all_gather(t[:4], np.zeros(4 * n, np.float32), loss_budget=0.0, deadline=10.0),
        "gathers to other roots": lambda t: comm.gather(t[:4], np.zeros(4 * n, np.float32), dst=0 if r == 0 else 1,
                                                        loss_budget=0.0, deadline=10.0),
    }
    # refused on one rank alone (no output there): it still starts a round, so the others' call ends
    cases["exact scatter refused on rank 1"] = lambda t: exact.scatter(
        comm, t if r == 0 else None, None if r == 1 else np.zeros(4, np.float32), 0, deadline=10.0)
    for name, call in cases.items():
        tensor = np.full(4 * n, float(r + 1), np.float32)
        try:
            call(tensor)
            wrong.append(f"{name}: no error")
        except (LayoutMismatch, TypeError) as error:
            if isinstance(error, TypeError) != (name.endswith("rank 1") and r == 1):
                wrong.append(f"{name}: {type(error).__name__}: {error}")
            if not np.array_equal(tensor, np.full(4 * n, float(r + 1), np.float32)):
                wrong.append(f"{name}: the tensor changed")
        pair = np.full(n, float(r), np.float32)
        comm.allreduce(pair, loss_budget=0.0, deadline=10.0)
        if not np.array_equal(pair, np.full(n, float(sum(range(n))), np.float32)):
            wrong.append(f"{name}: the next call did not pair")
    return wrong


def argument_errors(comm):
    """Bad arguments: the named exception, nothing sent (the next call pairs). Returns what went wrong."""
    wrong = []
    n = comm.world_size
    expect = expecting(wrong)
    expect(ValueError, lambda: comm.scatter(np.zeros(n, np.float32), src=n), "is not a rank")
    expect(ValueError, lambda: comm.gather(np.zeros(1, np.float32), np.zeros(n, np.float32), dst=-1), "is not a rank")
    expect(ValueError, lambda: comm.gather(np.zeros(2, np.float32), np.zeros(n, np.float32)), "shard has 2 elements")
    expect(ValueError, lambda: comm.chunk_mask("scatter", np.zeros(n, np.float32)).tolist() and comm.chunk_mask(
        "gathers", np.zeros(n, np.float32)), "chunk masks are offered for")
    pair = np.ones(1, np.float32)
    comm.allreduce(pair, loss_budget=0.0, deadline=10.0)
    if pair[0] != n:
        wrong.append("the next call did not pair")
    return wrong


def exact_broadcasts(comm, cases, src):
    """exact.broadcast of each (element count, dtype name) from `src`, into a tensor holding a
    known other value: per case (the values right, the engine collectives of its calls, the
    payload bytes this rank sent in each)."""
    out = []
    for count, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        sent = (torch.arange(count) % 97 + 3).to(dtype)
        tensor = sent.clone() if comm.rank == src else torch.zeros(count, dtype=dtype)
        stats = exact.broadcast(comm, tensor, src)
        out.append((torch.equal(tensor, sent), [s.collective for s in stats], [s.payload_bytes_sent for s in stats]))
    return out


def broadcast_sizes_that_differ(comm, small, large):
    """Rank 0 broadcasts `small` int32 (a flat broadcast), the others `large` (two steps): each
    rank's error name and whether its tensor kept its values; then a broadcast of one size on
    every rank, which must pair: whether it was right."""
    mine = small if comm.rank == 0 else large
    tensor = torch.full((mine,), comm.rank + 5, dtype=torch.int32)
    try:
        exact.broadcast(comm, tensor, 1, deadline=10.0)
        outcome = "no error"
    except LayoutMismatch:
        outcome = "LayoutMismatch"
    kept = torch.equal(tensor, torch.full((mine,), comm.rank + 5, dtype=torch.int32))
    after = torch.full((small,), comm.rank, dtype=torch.int32)
    exact.broadcast(comm, after, 1, deadline=10.0)
    return outcome, kept, torch.equal(after, torch.full((small,), 1, dtype=torch.int32))


def flat_broadcast_against_scatter(comm):
    """Rank 0 makes an exact broadcast of 4 int32 from rank 1 that claims to be a scatter (a flat
    one: an engine scatter), the others an exact.scatter from rank 1 of 4 int32 a rank: the same
    engine call, count and claim. Each rank's error name and whether its tensor kept its values;
    then whether a broadcast of 4 int32 on every rank pairs."""
    n, r = comm.world_size, comm.rank
    mine = torch.full((4,), r + 5, dtype=torch.int32)
    pieces = torch.arange(4 * n, dtype=torch.int32) if r == 1 else None
    try:
        if r == 0:
            exact.broadcast(comm, mine, 1, deadline=10.0, collective="scatter")
        else:
            exact.scatter(comm, pieces, mine, 1, deadline=10.0)
        outcome = "no error"
    except LayoutMismatch:
        outcome = "LayoutMismatch"
    kept = torch.equal(mine, torch.full((4,), r + 5, dtype=torch.int32))
    after = torch.full((4,), r, dtype=torch.int32)
    exact.broadcast(comm, after, 1, deadline=10.0)
    return outcome, kept, torch.equal(after, torch.full((4,), 1, dtype=torch.int32))
