"""Exact collectives on a lossy communicator, for the traffic that must not
lose anything (parameters at start, control, a periodic re-alignment).

No datagram is retransmitted; the *call* is repeated. A broadcast or an
all-gather keeps stale values where chunks do not arrive, so repeating it
fills the holes that are left: after k attempts a chunk is missing with
probability ~p^k. The engine reports only whether each attempt was complete,
not which chunks earlier attempts filled, so completeness across attempts is
checked by comparing every rank's copy: two 32-bit checksums, each agreed
as a maximum and as a minimum (4 agreement rounds, only when an attempt was
incomplete). All ranks take every branch together because every decision is
an agreed value.

An all-gather of many chunks repairs instead of repeating: after an incomplete
first attempt every rank's chunk mask (which chunks it holds) is gathered
exactly, and each owner re-sends, packed into a small all-gather, only the
chunks some rank still lacks, until every mask is full. At 1% loss that moves
about 1% more data where repeating the call moved it all again, twice or more.
The masks are the same on every rank, so every rank takes the same branch.

An exact allreduce is an exact all-gather of the inputs followed by the same
local reduction in rank order on every rank: N times the traffic, bitwise
identical results everywhere. Meant for control-sized tensors.
"""
import ctypes
import functools
import zlib

from . import tensors
from .errors import LossBudgetExceeded

DEFAULT_ATTEMPTS = 64
# From this many chunks up an incomplete all-gather is repaired chunk by chunk; below, the mask
# exchange would cost about what repeating the whole call does.
REPAIR_MIN_CHUNKS = 64
_ALL_ONES = 0xFFFFFFFF


def _without_autograd(collective):
    """Run a collective with autograd off: it writes into tensors that may require grad (a
    Parameter), which autograd forbids in place; c10d's own backends write them too."""
    @functools.wraps(collective)
    def run(*arguments, **keywords):
        import torch

        with torch.no_grad():
            return collective(*arguments, **keywords)
    return run


def _as_torch(tensor, writes=False):
    """`tensor` as a torch tensor over the same memory; a read-only numpy array refused where
    it would be written (torch.from_numpy only warns)."""
    import torch

    if isinstance(tensor, torch.Tensor):
        return tensor
    if writes:
        tensors.refuse_read_only(tensor)
    return torch.from_numpy(tensor)


def _bytes_of(tensor):
    view = tensors.view_of(tensor)
    if view.nbytes == 0:
        return b""
    return memoryview((ctypes.c_ubyte * view.nbytes).from_address(view.address)).cast("B")


def as_words(tensor, writes=False):
    """A contiguous int32 torch tensor over `tensor`'s bytes (any dtype, numpy
    or torch), and a function that copies it back when it is not a view: moving
    bytes exactly does not depend on what they mean. `writes`: the caller will
    write the words (a read-only array is refused)."""
    import torch

    wrapped = _as_torch(tensor, writes)
    if wrapped.device.type != "cpu":
        tensors.view_of(wrapped)  # the usual clear error
    flat = wrapped.reshape(-1) if wrapped.is_contiguous() else wrapped.contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0 and flat.data_ptr() % 4 == 0:
        words = raw.view(torch.int32)
    else:
        words = torch.zeros((raw.numel() + 3) // 4, dtype=torch.int32)
        words.view(torch.uint8)[:raw.numel()].copy_(raw)

    def copy_back():
        if words.data_ptr() != flat.data_ptr():
            raw.copy_(words.view(torch.uint8)[:raw.numel()])
        if flat.data_ptr() != wrapped.data_ptr() or not wrapped.is_contiguous():
            wrapped.copy_(flat.view(wrapped.shape))

    return words, copy_back


def _identical_everywhere(comm, tensor, deadline):
    """True on every rank iff every rank's copy of `tensor` has the same two
    checksums (agreed: the same answer everywhere)."""
    data = _bytes_of(tensor)
    for checksum in (zlib.crc32(data), zlib.adler32(data)):
        if comm.agree(checksum, deadline=deadline) != _ALL_ONES - comm.agree(_ALL_ONES - checksum, deadline=deadline):
            return False
    return True


def _repeat(comm, attempt, target, what, attempts, deadline):
    saved = target.clone()  # targets here are always torch tensors (word views or scratch)
    total_stats = []
    for _ in range(attempts):
        stats = attempt()
        total_stats.append(stats)
        if stats.gather_fraction >= 1.0 or _identical_everywhere(comm, target, deadline):
            return total_stats
    target.copy_(saved)
    raise LossBudgetExceeded(f"rank {comm.rank}: exact {what} still incomplete after {attempts} attempts", total_stats[-1])


@_without_autograd
def broadcast(comm, tensor, src=0, *, attempts=DEFAULT_ATTEMPTS, deadline=None):
    """Copy rank `src`'s tensor (any dtype) into every rank's, exactly.
    Returns the stats of each attempt. On failure every rank's tensor is as
    it was."""
    source = comm.rank == src  # only read: a read-only array may be the source
    words, copy_back = as_words(tensor, writes=not source)
    stats = _repeat(comm, lambda: comm.broadcast(words, src, loss_budget=1.0, deadline=deadline), words, "broadcast",
                    attempts, deadline)
    if not source:
        copy_back()
    return stats


@_without_autograd
def all_gather(comm, shard, output, *, attempts=DEFAULT_ATTEMPTS, deadline=None):
    """Gather every rank's shard (any dtype, the same size everywhere) into
    `output`, rank r's at [r * len(shard), (r + 1) * len(shard)), exactly.
    `output` is written only on success."""
    import torch

    words, _ = as_words(shard)
    shard_bytes = _as_torch(shard).nbytes
    _as_torch(output, writes=True)  # refused before anything is sent, not after
    width = words.numel()
    gathered = torch.empty(comm.world_size * width, dtype=torch.int32)
    gathered[comm.rank * width:(comm.rank + 1) * width].copy_(words)
    stats = _gather_words(comm, words, gathered, attempts, deadline)
    target, copy_back = as_words(output, writes=True)
    target_bytes = target.view(torch.uint8)
    if target_bytes.numel() < comm.world_size * shard_bytes:
        raise ValueError(f"output holds {target_bytes.numel()} bytes, {comm.world_size} shards need {comm.world_size * shard_bytes}")
    rows = gathered.view(torch.uint8).view(comm.world_size, 4 * width)[:, :shard_bytes]
    target_bytes[:comm.world_size * shard_bytes].copy_(rows.reshape(-1))
    copy_back()
    return stats


def _gather_words(comm, words, gathered, attempts, deadline):
    """All-gather int32 `words` into `gathered` exactly: one call, then repairs (or repeats, for
    few chunks). Returns the stats of every call that moved the data."""
    fresh = comm.chunk_mask("all_gather", gathered)
    first = comm.all_gather(words, gathered, loss_budget=1.0, deadline=deadline, chunk_mask=fresh)
    if first.gather_fraction >= 1.0:
        return [first]
    if attempts <= 1:
        raise LossBudgetExceeded(f"rank {comm.rank}: exact all_gather incomplete after its one attempt", first)
    if fresh.size < REPAIR_MIN_CHUNKS:  # the same size, so the same branch, on every rank
        return [first] + _repeat(comm, lambda: comm.all_gather(words, gathered, loss_budget=1.0, deadline=deadline),
                                 gathered, "all_gather", attempts - 1, deadline)
    return [first] + _repair(comm, gathered, fresh, first, attempts - 1, deadline)


def _repair(comm, gathered, fresh, first, attempts, deadline):
    """Fill the chunks of `gathered` that `fresh` (this rank's mask after the first call) lacks
    on any rank: each round gathers every rank's mask exactly, then each owner sends the chunks
    someone lacks, each padded to a whole chunk, in an all-gather of the longest such list."""
    import numpy as np
    import torch

    n, me = comm.world_size, comm.rank
    ranges = comm.chunk_ranges(gathered.numel(), torch.int32)
    per_block = len(ranges) // n  # blocks are equal: gathered holds n shards of one width
    step = comm.chunk_elements(torch.int32)
    held = fresh.astype(bool)
    held[me * per_block:(me + 1) * per_block] = True  # this rank's own shard
    packed = np.packbits(held)
    everyone = np.empty((n, packed.size), dtype=np.uint8)
    calls = []
    for _ in range(attempts):
        packed[:] = np.packbits(held)
        all_gather(comm, packed, everyone.reshape(-1), attempts=attempts, deadline=deadline)
        lacking = ~np.unpackbits(everyone, axis=1, count=held.size).astype(bool).all(axis=0)
        if not lacking.any():  # every rank read the same masks
            return calls
        wanted = [np.flatnonzero(lacking[b * per_block:(b + 1) * per_block]) for b in range(n)]
        longest = max(len(w) for w in wanted)
        shard = torch.zeros(longest * step, dtype=torch.int32)
        for k, chunk in enumerate(wanted[me]):
            start, stop = ranges[me * per_block + chunk]
            shard[k * step:k * step + stop - start] = gathered[start:stop]
        repaired = torch.empty(n * longest * step, dtype=torch.int32)
        arrived = comm.chunk_mask("all_gather", repaired)
        calls.append(comm.all_gather(shard, repaired, loss_budget=1.0, deadline=deadline, chunk_mask=arrived))
        for b in range(n):
            for k, chunk in enumerate(wanted[b]):
                index = b * per_block + chunk
                if not held[index] and arrived[b * longest + k]:
                    start, stop = ranges[index]
                    offset = (b * longest + k) * step
                    gathered[start:stop] = repaired[offset:offset + stop - start]
                    held[index] = True
    raise LossBudgetExceeded(f"rank {me}: exact all_gather still incomplete after {attempts} repairs",
                             calls[-1] if calls else first)


@_without_autograd
def allreduce(comm, tensor, op="sum", *, attempts=DEFAULT_ATTEMPTS, deadline=None):
    """Reduce `tensor` (numpy or torch, CPU, any dtype) across ranks in place,
    exactly and bitwise identically on every rank. op: sum, mean/avg, max,
    min, product (strings or torch ReduceOp)."""
    import torch

    name = tensors.op_name(op)
    name = {"avg": "mean", "prod": "product"}.get(name, name)
    if name not in ("sum", "mean", "max", "min", "product"):
        raise ValueError(f"exact allreduce supports sum, mean, max, min and product, got {op!r}")
    wrapped = _as_torch(tensor, writes=True)
    flat = wrapped.reshape(-1).clone()
    gathered = torch.empty((comm.world_size, flat.numel()), dtype=flat.dtype)
    stats = all_gather(comm, flat, gathered, attempts=attempts, deadline=deadline)
    if name in ("max", "min"):
        result = gathered.amax(dim=0) if name == "max" else gathered.amin(dim=0)
    else:
        wide = gathered.to(torch.complex128 if flat.dtype.is_complex else
                           torch.float64 if flat.dtype.is_floating_point else torch.int64)
        result = wide.prod(dim=0) if name == "product" else wide.sum(dim=0)
        if name == "mean":
            result = result / comm.world_size
    wrapped.copy_(result.to(flat.dtype).view(wrapped.shape))
    return stats


def barrier(comm, *, deadline=None):
    """Returns once every rank has called it (an agreement round)."""
    comm.agree(0, deadline=deadline)
