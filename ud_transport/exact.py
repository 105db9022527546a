"""Exact collectives on a lossy communicator, for the traffic that must not
lose anything (parameters at start, control, a periodic re-alignment).

No datagram is retransmitted; what is missing is sent again in a new call.
A broadcast or an all-gather keeps stale values where chunks do not arrive,
and its chunk mask says which chunks took the sender's value. After an
incomplete first call of 64 chunks or more, every rank's mask (which chunks it
holds) is gathered exactly, and the chunks some rank still lacks are sent
again, packed into a small call of the same kind (an all-gather's owners each
send those of their own shard, a broadcast's root sends them all), until
every mask is full. Each repair goes out in the number of copies (1 to 4)
that makes its expected cost least at the loss the first call saw: its bytes
against another round (a mask exchange and a call's latency, far more than a
small repair's bytes). A repair that every rank received whole ends the call
without another exchange. At 1% loss that moves a few % more data, where
repeating the whole call moved all of it again, twice or more. The masks are
the same on every rank, so every rank takes the same branch.

A small broadcast among 4 ranks or more whose root sends at most FLAT_BROADCAST_BYTES in all is
one scatter of the tensor's copies, each rank taking its whole tensor from the root in one step;
it is repeated whole until no rank lacks a chunk of its own row (agreed from the masks, as for
exact.scatter), not compared by checksums.

A call of fewer chunks (the mask exchanges are such calls) is repeated whole
instead, keeping what earlier attempts delivered: after k attempts a chunk is
missing with probability ~p^k. One of at most SMALL_CALL_BYTES goes out in
SMALL_CALL_COPIES copies from its second attempt, since latency, not bytes, is
its cost; its first call (a small broadcast's, a flat one's, a scatter's, a
gather's, an all_to_all's) goes in one copy while such calls on its
communicator arrive whole, and in SMALL_CALL_COPIES for a while after one
missed (_FirstCallCopies).
Completeness across attempts is checked by comparing every rank's
copy: two 32-bit checksums, each agreed as a maximum and as a minimum (4
agreement rounds, only when an attempt was incomplete). Every decision is an
agreed value, so all ranks take every branch together.

Every call writes into its output as chunks arrive (direct_output); the
caller's tensor is put back from a kept copy when the exact call fails. A small
broadcast (not flat) first makes one call that must deliver the tensor whole (a
loss budget of 0): the engine writes it only then, so that call keeps no copy;
only a miss, agreed, goes on to the calls above.

An exact allreduce of a large tensor is an exact all_to_all (block q of every
input to rank q), each block reduced by its owner in rank order, and an exact
all-gather of the reduced blocks: about twice the tensor's bytes per rank. A
small one, or one of 2 ranks, is one exact all-gather of the inputs and the
same reduction on every rank (one call; world_size - 1 times the bytes).
Either way the result is bitwise identical everywhere. An int32 sum first
tries the engine's own allreduce with a loss budget of 0 (one call, twice the
tensor's bytes): where every contribution arrived, agreed, that is the exact
result; where one did not, an exact form runs from the kept input.

Every exact call starts at least one engine call on every rank, whatever it is
passed: one of no elements is a round that moves nothing, and an argument
refused before the first call is replaced by an agreement round. Each call
says what it is in its layout salt (the caller's collective, op and root, and
the byte count), so ranks whose calls differ in any of them raise
LayoutMismatch together, with no tensor changed, and their next calls pair.
"""
import contextlib
import ctypes
import functools
import math
import weakref
import zlib

from . import staging, tensors
from . import _native
from .communicator import _seconds, agree_number
from .errors import LossBudgetExceeded, TransportError

DEFAULT_ATTEMPTS = 64
# From this many chunks up an incomplete all-gather or broadcast is repaired chunk by chunk;
# below, the mask exchange would cost about what repeating the whole call does.
REPAIR_MIN_CHUNKS = 64
# A small call (a mask exchange, a control tensor) is sent this many times from its first attempt
# (a small broadcast's first call: see _FirstCallCopies): a lost datagram costs it a repeat and
# four agreement rounds.
SMALL_CALL_COPIES = 3
SMALL_CALL_BYTES = 64 << 10
# What a repair round costs besides its bytes (a mask exchange, a call's latency), as a share of
# the first call's time: ~25 of ~100 ms at 8 ranks on a bridge at MTU 1500, ~3 of ~12 ms at 2 on
# loopback (scripts/exact_calls.py, 16 MiB).
ROUND_COST_IN_CALLS = 0.25
# An exact allreduce is sharded (an exact all_to_all, each block reduced by its owner, an exact
# all-gather: 2(n-1)/n of the tensor per rank) where that saves this many bytes per rank over one
# all-gather of every input ((n-1) x): the bytes a second call's rounds cost. Measured with
# scripts/exact_calls.py --only allreduce, 4 ranks on loopback (2026-11-28): the forms break even
# at 256 KiB (a saving of 384 KiB); gathered is 1.5x faster at 64 KiB, sharded 1.5x at 1 MiB
# (2x at 8 ranks). At 2 ranks both send the tensor once: always gathered.
SHARDED_SAVING_MIN_BYTES = 384 << 10
# A small exact broadcast (broadcasts_flat) among at least FLAT_BROADCAST_MIN_RANKS ranks whose
# root sends at most FLAT_BROADCAST_BYTES in all goes flat: the whole tensor to each rank in one
# step (one scatter of its copies), where the engine's broadcast is a scatter and an all-gather
# of blocks, 2(n-1) steps with their END markers. On the bridge at MTU 1500 the slowest rank's
# p50 fell 7-28% at 8 ranks (4 and 64 KiB) and 40% at 16 (4 KiB), level at 4; at 2 ranks on
# loopback, where both forms send the same datagrams, it was about a tenth slower (the buffer and
# its copies) (docs/performance/exact_allreduce.md, 2026-11-30).
FLAT_BROADCAST_BYTES = 1 << 20
FLAT_BROADCAST_MIN_RANKS = 4
_ALL_ONES = 0xFFFFFFFF
# Working buffers of the exact calls, per communicator, kept between calls while it lives.
_buffers = weakref.WeakKeyDictionary()
_KEPT_BUFFERS = 4


@contextlib.contextmanager
def _borrowed(comm, count):
    """An int32 torch tensor of `count` elements from `comm`'s buffers, given back after. Fresh
    memory costs a page fault and the kernel's zeroing per page on every call (16 MiB: ~10 ms
    to allocate and fill, against ~2 ms to refill a kept buffer, on the 2-core build machine).
    An exact call made inside another (a mask exchange) gets a buffer of its own. The buffers
    are kept while `comm` lives (at most _KEPT_BUFFERS, the largest ones)."""
    import torch

    free = _buffers.setdefault(comm, [])  # smallest first
    fitting = next((index for index, buffer in enumerate(free) if buffer.numel() >= count), None)
    buffer = free.pop(fitting) if fitting is not None else torch.empty(count, dtype=torch.int32, device="cpu")
    try:
        yield buffer[:count]
    finally:
        free.append(buffer)
        free.sort(key=torch.Tensor.numel)
        del free[:-_KEPT_BUFFERS]


def _without_autograd(collective):
    """Run a collective with autograd off: it writes into tensors that may require grad (a
    Parameter), which autograd forbids in place; c10d's own backends write them too."""
    @functools.wraps(collective)
    def run(*arguments, **keywords):
        import torch

        with torch.no_grad():
            return collective(*arguments, **keywords)
    return run


class _Declined(Exception):
    """A call whose agreed value said some rank's call is not the one the others assumed."""


def _salt(*claim):
    """The layout salt of an exact call from what it claims to be (its collective, op, root, byte
    count...): ranks whose claims differ raise LayoutMismatch where they would otherwise pair two
    calls that happen to move the same bytes (an allreduce MAX with a SUM, a broadcast with a
    scatter). Never 0, which folds nothing into the layout."""
    return zlib.crc32(repr(claim).encode()) or 1


def _staging_in_step(arguments):
    """A call whose tensors cannot be staged (on two devices) is refused in step too."""
    return _refused_in_step(arguments["comm"], arguments.get("deadline"))


@contextlib.contextmanager
def _refused_in_step(comm, deadline):
    """Around the argument checks made before an exact call's first engine call: a refused one
    still starts one, an agreement round, so that the others' call meets it (and ends with
    LayoutMismatch naming this rank) instead of waiting for it or pairing with this rank's next."""
    try:
        yield
    except (ValueError, TypeError):
        try:
            comm.agree(0, deadline=deadline)
        except TransportError:  # the others called with data: their call ended, ours is the error
            pass
        raise


def _as_torch(tensor, writes=False):
    """`tensor` as a torch tensor over the same memory; a read-only numpy array refused where
    it would be written (torch.from_numpy only warns)."""
    import torch

    if isinstance(tensor, torch.Tensor):
        return tensor
    if not hasattr(tensor, "__array_interface__"):  # a TypeError keeps a refused call in step (_refused_in_step)
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(tensor).__name__}")
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
    if flat.stride(0) != 1:  # none or one element is "contiguous" at any stride: view needs 1
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
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


def _repeat(comm, attempt, target, what, attempts, deadline, done=()):
    """Call attempt() until the call is complete or every rank's copy of `target` is the same;
    `done`: the stats of attempts already made. Returns the stats of every attempt."""
    total_stats = list(done)
    for _ in range(attempts):
        stats = attempt()
        total_stats.append(stats)
        if stats.gather_fraction >= 1.0 or _identical_everywhere(comm, target, deadline):
            return total_stats
    raise LossBudgetExceeded(f"rank {comm.rank}: exact {what} still incomplete after {attempts + len(done)} attempts",
                             total_stats[-1])


def _exactly(comm, collective, attempt, target, attempts, deadline, src=None, keep=False, first_by_outcome=False):
    """One call of `collective` ("all_gather" or "broadcast" from `src`) into int32 `target` with
    a chunk mask, then, if some rank missed chunks, repairs (or repeats, below REPAIR_MIN_CHUNKS).
    `attempt(mask, copies)` makes the call. `keep`: on failure put `target` back as it was (it is the
    caller's; a scratch need not be). `first_by_outcome`: a small call's first goes in the copies
    _FirstCallCopies gives, and `attempt` folds its copies into the layout salt (_with_copies)."""
    n, me = comm.world_size, comm.rank
    fresh = comm.chunk_mask(collective, target)  # of no elements too: the call still pairs with the others'
    if target.numel() == 0:
        return [attempt(fresh, 1)]
    small = fresh.size < REPAIR_MIN_CHUNKS  # the same size, so the same branch, on every rank
    copies = _small_call_copies(target.nbytes) if small else 1
    copying = _first_call_copies(comm) if first_by_outcome and copies > 1 else None
    with _borrowed(comm, target.numel()) if keep else contextlib.nullcontext() as saved:
        if keep:
            saved.copy_(target)
        try:  # every call writes into target directly (direct_output): a failed one leaves it partly written
            first_copies = copying.copies(target.nbytes) if copying else copies
            first = attempt(fresh, first_copies)
            if copying:
                copying.note(first_copies, target.nbytes, missed=first.gather_fraction < 1.0)
            if first.gather_fraction >= 1.0:
                return [first]
            if attempts <= 1:
                raise LossBudgetExceeded(f"rank {me}: exact {collective} incomplete after its one attempt", first)
            if small:
                return _repeat(comm, lambda: attempt(None, copies), target, collective, attempts - 1, deadline,
                               done=[first])
            held = fresh.astype(bool)
            if collective == "all_gather":  # this rank's own shard (target holds n of one width)
                held[me * (held.size // n):(me + 1) * (held.size // n)] = True
            elif me == src:
                held[:] = True
            return [first] + _repair(comm, collective, target, held, first, attempts - 1, deadline, src)
        except BaseException:
            if keep:
                target.copy_(saved)
            raise


def _repair(comm, collective, target, held, first, attempts, deadline, src):
    """Fill the chunks of int32 `target` that some rank lacks (`held`: which this rank holds).
    Each round gathers every rank's mask exactly (so every rank reads the same masks and takes
    the same branch), then sends the lacking chunks again, each padded to a whole chunk: in an
    all_gather each owner sends those of its own shard; in a broadcast the root sends them all.
    The repair goes out in copies enough for the loss `first` saw (an agreed fraction, so the
    same number everywhere); once one arrives whole on every rank (agreed), nothing is lacking.
    Chunks are moved by index arrays, not one by one in Python."""
    import numpy as np
    import torch

    n, me = comm.world_size, comm.rank
    starts, stops = comm.chunk_bounds(target.numel(), "int32")
    step = comm.chunk_elements("int32")
    calls = []
    loss = min(0.5, 1.0 - first.gather_fraction)  # the worst rank's share missing: an agreed estimate
    for _ in range(attempts):
        lacking = np.flatnonzero(_lacked_everywhere(comm, held, attempts, deadline).any(axis=0))
        if lacking.size == 0:
            return calls
        if collective == "all_gather":  # owner b sends its lacking chunks, every owner as many (padded)
            owners = lacking // (held.size // n)  # target holds n shards of one width
            counts = np.bincount(owners, minlength=n)
            slots = int(counts.max())
            slot_of = owners * slots + np.arange(lacking.size) - (np.cumsum(counts) - counts)[owners]
            mine = lacking[owners == me]
            chunks = n * slots  # of the repair's output
        else:  # the root sends them all, as many slots as make equal blocks of whole chunks
            slots = chunks = -(-lacking.size // n) * n
            slot_of = np.arange(lacking.size)
            mine = lacking if me == src else lacking[:0]
        copies = _repair_copies(loss, chunks, chunks * (n - 1), held.size)  # every rank but its sender takes a chunk
        outgoing = torch.zeros(slots * step, dtype=torch.int32)
        into, out_of = _element_pairs(starts, stops, mine, np.arange(mine.size), step)
        outgoing[into] = target[out_of]
        if collective == "all_gather":
            incoming = torch.empty(n * slots * step, dtype=torch.int32)
            arrived = comm.chunk_mask("all_gather", incoming)
            calls.append(comm.all_gather(outgoing, incoming, loss_budget=1.0, deadline=deadline, chunk_mask=arrived,
                                         copies=copies, direct_output=True))  # incoming is ours
        else:
            incoming = outgoing
            arrived = comm.chunk_mask("broadcast", incoming)
            calls.append(comm.broadcast(incoming, src, loss_budget=1.0, deadline=deadline, chunk_mask=arrived,
                                        copies=copies, direct_output=True))
        taken = ~held[lacking] & arrived[slot_of].astype(bool)
        out_of, into = _element_pairs(starts, stops, lacking[taken], slot_of[taken], step)
        target[into] = incoming[out_of]
        held[lacking[taken]] = True
        if calls[-1].gather_fraction >= 1.0:  # every rank took every slot: no mask needs gathering again
            return calls
    raise LossBudgetExceeded(f"rank {me}: exact {collective} still incomplete after {attempts} repairs",
                             calls[-1] if calls else first)


def _lacked_everywhere(comm, held, attempts, deadline):
    """Every rank's mask of what it lacks (rank, chunk), from `held` (this rank's, bool) gathered
    exactly as bits: the same array on every rank."""
    import numpy as np

    packed = np.packbits(held)
    everyone = np.empty((comm.world_size, packed.size), dtype=np.uint8)
    all_gather(comm, packed, everyone.reshape(-1), attempts=attempts, deadline=deadline, first_by_outcome=False)
    return ~np.unpackbits(everyone, axis=1, count=held.size).astype(bool)


def _repair_copies(loss, chunks, receptions, first_chunks):
    """The copies of each datagram (1 to the engine's most) that make a repair of `chunks` chunks
    cheapest in expectation: its bytes (chunks / first_chunks of the first call per copy) plus
    another round (ROUND_COST_IN_CALLS) times the chance that some of its `receptions`, each copy
    lost with probability `loss`, lose every copy. Few lacking chunks get several copies; many
    (high loss) get one, since copies of them would cost more than the rounds they save."""
    from . import _native

    def cost(copies):
        return copies * chunks / first_chunks - ROUND_COST_IN_CALLS * math.expm1(-receptions * loss ** copies)

    return min(range(1, _native.MAX_COPIES + 1), key=cost)  # the fewest of equally cheap ones


def _element_pairs(starts, stops, chunks, slots, step):
    """For chunks `chunks` of a tensor (bounds `starts`, `stops`) packed at `slots` of `step`
    elements each: (every element's index in the packing, its index in the tensor), as torch
    index tensors."""
    import numpy as np
    import torch

    lengths = stops[chunks] - starts[chunks]
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    packed = np.repeat(np.asarray(slots, dtype=np.int64) * step, lengths) + within
    return torch.from_numpy(packed), torch.from_numpy(np.repeat(starts[chunks], lengths) + within)


@staging.stages(writes=("tensor",))
@_without_autograd
def broadcast(comm, tensor, src=0, *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="broadcast"):
    """Copy rank `src`'s tensor (any dtype) into every rank's, exactly.
    `collective`: what the caller's call is (e.g. "scatter"), checked across ranks with the byte
    count and `src`: ranks whose calls differ in any of them raise LayoutMismatch. Returns the
    stats of each call (`attempts` of them at most; a small one's first must deliver the tensor
    whole, in one copy on a clean link). On failure every rank's tensor is as it was."""
    return _broadcast(comm, tensor, src, attempts, deadline, collective, whole_first=True)


@staging.stages(writes=("tensor",))
@_without_autograd
def _broadcast_after_whole_miss(comm, tensor, src, attempts, deadline, collective):
    """What broadcast() calls after its whole first call missed (small_broadcast() made that call)."""
    return _broadcast(comm, tensor, src, attempts, deadline, collective, whole_first=False)


def _broadcast(comm, tensor, src, attempts, deadline, collective, whole_first):
    source = comm.rank == src  # only read: a read-only array may be the source
    with _refused_in_step(comm, deadline):
        words, copy_back = as_words(tensor, writes=not source)
    # the byte count too: sizes that pad to the same words must still mismatch
    nbytes = _as_torch(tensor).nbytes
    chunks = comm.chunk_mask("broadcast", words).size
    flat = broadcasts_flat(nbytes, comm.world_size, chunks)
    # flat, it is an engine scatter: its salt must tell it from an exact.scatter claiming the same bytes
    salt = _salt(collective, src, nbytes, "flat") if flat else _salt(collective, src, nbytes)
    if flat:
        stats = _flat_broadcast(comm, words, src, attempts, deadline, salt, nbytes)
    else:
        stats, whole = [], False
        if whole_first and _whole_first(chunks, words.nbytes):
            first, whole = _whole_first_call(comm, words.nbytes, attempts, lambda copies: comm.broadcast(
                words, src, loss_budget=0.0, deadline=deadline, copies=copies, layout_salt=_with_copies(salt, copies)))
            stats, attempts = [first], attempts if whole else attempts - 1
        if not whole:
            stats += _exactly(comm, "broadcast", lambda mask, copies: comm.broadcast(
                words, src, loss_budget=1.0, deadline=deadline, chunk_mask=mask, copies=copies, direct_output=True,
                layout_salt=salt), words, attempts, deadline, src=src, keep=not source)  # the root's is only read
    if not source:
        copy_back()
    return stats


def _whole_first(chunks, nbytes):
    """Whether a broadcast that is not flat, of `chunks` chunks and `nbytes` (its words), starts
    with one call that must deliver it whole (a loss budget of 0; the engine writes the tensor
    only then, so nothing needs keeping): a small one, which is repeated whole anyway. A miss,
    agreed, goes on to _exactly's attempts, which keep a copy. With no loss that is the one call."""
    return 0 < chunks < REPAIR_MIN_CHUNKS and nbytes > 0


# after a small broadcast's first call in one copy missed, the next ones go in SMALL_CALL_COPIES for
# this many calls, doubled at each such miss up to FIRST_CALL_COPIED_MAX (_FirstCallCopies)
FIRST_CALL_COPIED_CALLS = 16
FIRST_CALL_COPIED_MAX = 1024
_first_call_copying = weakref.WeakKeyDictionary()  # comm -> _FirstCallCopies


class _FirstCallCopies:
    """The copies the first call of a communicator's small calls (of at most SMALL_CALL_BYTES: a
    broadcast's whole first call, _whole_first, and the first call of _until_held: a flat
    broadcast's, a scatter's, a gather's, an all_to_all's) goes in. One while they arrive
    whole: on a clean network each datagram once, as Gloo sends it (8 ranks on a bridge, a 4 KiB
    send/recv shift: 1.23-1.31x Gloo's p50 in one copy against 1.67-1.69x in three;
    docs/performance/exact_allreduce.md, "small calls at the price of their engine call"). After
    one in a single copy missed, the next `wait` go in SMALL_CALL_COPIES, where a datagram is lost
    only with all its copies, so that under loss a small call rarely needs more than its first
    call; `wait` starts at FIRST_CALL_COPIED_CALLS and doubles with each such miss up to
    FIRST_CALL_COPIED_MAX, and `wait` single-copy calls whole in a row halve it. What it reads is
    each call's agreed outcome, in the order every rank makes the calls, so every rank passes the
    same copies; the copies are in the call's layout salt besides, and a LayoutMismatch starts
    every rank's count afresh (_first_call_copies). A call that ends otherwise (PeerTimeout, an
    interrupt) is not counted: where it ended so on some ranks only, their counts may differ, and
    the first call whose copies then differ ends in LayoutMismatch, which brings them together.
    A small scatter's, gather's and all_to_all's first call goes by the same count (since
    2026-12-01): at 8 ranks on a bridge a 64 KiB all_to_all in one copy took 6.5-6.8 ms against
    8.0-8.5 in three, where each rank took in three times the bytes (pytorch_step_time.md, "Small
    exchanges in one copy"); at 2 ranks on loopback the two were level."""
    __slots__ = ("wait", "left", "clean", "mismatches")

    def __init__(self, mismatches=0):
        self.wait = self.left = self.clean = 0
        self.mismatches = mismatches  # comm.layout_mismatches when made (_first_call_copies)

    def copies(self, nbytes):
        return SMALL_CALL_COPIES if self.left and nbytes <= SMALL_CALL_BYTES else 1

    def note(self, copies, nbytes, missed):
        """The agreed outcome of a first call in `copies` of `nbytes`: `missed` (some rank lacks a
        chunk) or whole."""
        if nbytes > SMALL_CALL_BYTES:  # always one copy: says nothing of what the small ones need
            return
        if copies > 1:
            self.left -= 1
        elif missed:
            self.wait = min(max(2 * self.wait, FIRST_CALL_COPIED_CALLS), FIRST_CALL_COPIED_MAX)
            self.left, self.clean = self.wait, 0
        else:
            self.clean += 1
            if self.wait and self.clean >= self.wait:
                self.wait, self.clean = self.wait // 2, 0


def state_since_mismatch(table, comm, make):
    """`comm`'s entry in `table` (a weakref.WeakKeyDictionary of per-communicator state that every
    rank keeps alike from agreed outcomes), made afresh by `make(comm.layout_mismatches)` at each
    LayoutMismatch since it was made (counted alike on every rank, a rank that refused the call
    included): where ranks' states came to differ (a rank that failed a call the others
    completed), the mismatch that difference makes brings them back. The state keeps the count
    it was made at in `mismatches`."""
    state = table.get(comm)
    if state is None or state.mismatches != comm.layout_mismatches:
        state = table[comm] = make(comm.layout_mismatches)
    return state


def _first_call_copies(comm):
    """`comm`'s _FirstCallCopies (state_since_mismatch)."""
    return state_since_mismatch(_first_call_copying, comm, _FirstCallCopies)


def _whole_first_call(comm, nbytes, attempts, call):
    """A small broadcast's whole first call, `call(copies)` in the copies _FirstCallCopies gives,
    its agreed outcome noted: (its stats, whether it delivered the tensor whole). A miss is the
    same on every rank, and leaves every tensor as it was; where `attempts` allows no more calls
    it raises what an exact call out of attempts raises."""
    copying = _first_call_copies(comm)
    copies = copying.copies(nbytes)
    try:
        stats = call(copies)
    except LossBudgetExceeded as missed:
        copying.note(copies, nbytes, missed=True)
        if attempts <= 1:
            raise LossBudgetExceeded(f"rank {comm.rank}: exact broadcast incomplete after its one attempt",
                                     missed.stats) from missed
        return missed.stats, False
    copying.note(copies, nbytes, missed=False)
    return stats, True


def _small_call_copies(nbytes):
    """The copies of a small call (_exactly's small branch) of `nbytes`."""
    return SMALL_CALL_COPIES if nbytes <= SMALL_CALL_BYTES else 1


# comm -> {(byte count, src, collective): the resolved arguments of broadcast()'s whole first call
# for them, or None where small_broadcast() leaves the call to broadcast()}
_broadcast_plans = weakref.WeakKeyDictionary()
_BROADCAST_PLANS_KEPT = 64  # per communicator: a group's broadcasts of many list shapes start again past it


def small_broadcast(comm, tensor, src, *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="broadcast"):
    """broadcast(comm, tensor, src) with a small call's Python cut to its engine call: each
    message of a "ud" group (a send and its receive, a broadcast on a communicator of their two
    ranks) and a group's broadcast. A contiguous host torch tensor of whole 32-bit words that
    broadcast() sends whole first (_whole_first) makes here the same first call, its arguments
    resolved once per communicator, byte count, `src` and `collective`, so each rank may take
    either function; a miss (agreed) goes on as broadcast() does. On 2 cores, broadcast()'s
    Python around that call was most of a 4 KiB message's time (docs/performance/
    pytorch_step_time.md, "Messages: send and recv"). Anything else goes to broadcast().
    Returns the stats of each call; on failure `tensor` keeps its values."""
    import torch

    if type(src) is not int or not isinstance(tensor, torch.Tensor):
        # broadcast() checks them
        return broadcast(comm, tensor, src, attempts=attempts, deadline=deadline, collective=collective)
    nbytes = tensor.nbytes
    plans = _broadcast_plans.get(comm)
    if plans is None:
        plans = _broadcast_plans.setdefault(comm, {})
    key = (nbytes, src, collective)
    plan = plans.get(key, False)
    if plan is False:  # the byte count, src and claim alone decide the plan
        if len(plans) >= _BROADCAST_PLANS_KEPT:
            plans.clear()
        plan = plans[key] = _broadcast_plan(comm, nbytes, src, collective) if nbytes % 4 == 0 else None
    if not (plan is not None and tensor.is_cpu and tensor.layout == torch.strided and tensor.is_contiguous()
            and not (tensor.is_quantized or tensor.is_conj() or tensor.is_neg()) and tensor.data_ptr() % 4 == 0):
        return broadcast(comm, tensor, src, attempts=attempts, deadline=deadline, collective=collective)
    address, count = tensor.data_ptr(), tensor.numel()  # what mark_written checks the tensor still has
    # the words, as as_words()'s; the storage pinned, as view_of's, for the call's raw address
    view = tensors.TensorView(address, nbytes // 4, "int32", 4, pin=(tensor, tensor.untyped_storage()))
    deadline_s = _seconds(deadline)
    stats, whole = _whole_first_call(comm, nbytes, attempts, lambda copies: comm._run_resolved(
        _native.COLLECTIVE_BROADCAST, view, view, view.count, deadline_s=deadline_s, mask_address=0, mask_bytes=0,
        **plan[copies > 1]))
    if not whole:  # nothing written: on as broadcast() goes
        return [stats] + _broadcast_after_whole_miss(comm, tensor, src, attempts - 1, deadline, collective)
    if comm.rank != src:
        tensors.mark_written(tensor, address, count)
    return [stats]


def _broadcast_plan(comm, nbytes, src, collective):
    """The resolved arguments of broadcast()'s first call of `nbytes` (whole words) from `src`
    claiming `collective`, in one copy and in SMALL_CALL_COPIES, where that call is a whole one
    (_whole_first); else None."""
    import torch

    if not 0 <= src < comm.world_size:
        return None  # broadcast() refuses it (ValueError)
    chunks = comm.chunk_mask("broadcast", torch.empty(nbytes // 4, dtype=torch.int32)).size
    if broadcasts_flat(nbytes, comm.world_size, chunks) or not _whole_first(chunks, nbytes):
        return None
    salt = _salt(collective, src, nbytes)  # as broadcast()'s
    return tuple(comm._resolve_call(loss_budget=0.0, root=src, copies=copies, layout_salt=_with_copies(salt, copies))
                 for copies in (1, SMALL_CALL_COPIES))  # as _FirstCallCopies chooses


def broadcasts_flat(nbytes, world_size, chunks):
    """Whether an exact broadcast of `nbytes` (`chunks` in the engine broadcast's mask) goes flat:
    the root sends the whole tensor to each rank in one step, a scatter of world_size copies of
    it. Only a small call (one that goes in SMALL_CALL_COPIES copies and is repeated whole, not
    repaired) among FLAT_BROADCAST_MIN_RANKS ranks or more whose root sends at most
    FLAT_BROADCAST_BYTES in all: both forms then move the same copies, and the flat one takes
    fewer steps. Ranks that pass different sizes may choose
    differently; the byte count in the layout salt makes that LayoutMismatch anyway."""
    small = chunks < REPAIR_MIN_CHUNKS and nbytes <= SMALL_CALL_BYTES
    return (small and 0 < nbytes and world_size >= FLAT_BROADCAST_MIN_RANKS
            and (world_size - 1) * nbytes <= FLAT_BROADCAST_BYTES)


def _flat_broadcast(comm, words, src, attempts, deadline, salt, nbytes):
    """Rank `src`'s int32 `words` (the caller's `nbytes`) into every rank's, as one engine scatter
    of world_size rows that each hold all of it: a receiver's whole tensor comes straight from the
    root in one step, where the engine's broadcast (a scatter of blocks, then an all-gather of
    them) takes 2(n-1) steps, each with its END markers. A small call (broadcasts_flat): in
    SMALL_CALL_COPIES copies, repeated whole until every rank holds its row. `words` is written
    only on success. Returns the stats of each call."""
    n, width = comm.world_size, words.numel()
    with _borrowed(comm, n * width) as rows:
        tiled = rows.view(n, width)
        if comm.rank == src:
            for b in range(n):  # row by row: an index_put can wake torch's worker threads, which
                if b != src:    # then hold cores other ranks need; its own row is never sent
                    tiled[b].copy_(words)

        def attempt(mask, copies):
            return comm.scatter(rows, src, loss_budget=1.0, deadline=deadline, chunk_mask=mask, copies=copies,
                                direct_output=True, layout_salt=_with_copies(salt, copies))  # rows is ours

        stats = _until_held(comm, "scatter", attempt, rows, attempts, deadline, payload_bytes=nbytes, small=True)
        if comm.rank != src:
            words.copy_(tiled[comm.rank])
    return stats


@staging.stages(reads=("shard",), writes=("output",), refusing=_staging_in_step)
@_without_autograd
def all_gather(comm, shard, output, *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="all_gather",
               first_by_outcome=True):
    """Gather every rank's shard (any dtype, the same size everywhere) into
    `output`, rank r's at [r * len(shard), (r + 1) * len(shard)), exactly.
    `collective`: what the caller's call is (e.g. ("gather", root)), checked across ranks with the
    shard's byte count: ranks whose calls differ raise LayoutMismatch. `output` is written only
    on success. `first_by_outcome`: a small call's first goes in one copy while such calls arrive
    whole (_FirstCallCopies); False: always in SMALL_CALL_COPIES (a repair's mask exchange, which
    follows a loss, and must not wait on another). Returns the stats of each call."""
    import torch

    with _refused_in_step(comm, deadline):  # refused before anything is sent, not after
        words, _ = as_words(shard)
        shard_bytes = _as_torch(shard).nbytes
        output_bytes = _as_torch(output, writes=True).nbytes
        if output_bytes < comm.world_size * shard_bytes:
            raise ValueError(f"output holds {output_bytes} bytes, {comm.world_size} shards need "
                             f"{comm.world_size * shard_bytes}")
    salt = _salt(collective, shard_bytes)
    width = words.numel()
    with _borrowed(comm, comm.world_size * width) as gathered:
        gathered[comm.rank * width:(comm.rank + 1) * width].copy_(words)
        def attempt(mask, copies):
            return comm.all_gather(words, gathered, loss_budget=1.0, deadline=deadline, chunk_mask=mask, copies=copies,
                                   direct_output=True, layout_salt=_with_copies(salt, copies))  # gathered is ours

        stats = _exactly(comm, "all_gather", attempt, gathered, attempts, deadline, first_by_outcome=first_by_outcome)
        target, copy_back = as_words(output, writes=True)
        target_bytes = target.view(torch.uint8)
        rows = gathered.view(torch.uint8).view(comm.world_size, 4 * width)[:, :shard_bytes]
        target_bytes[:comm.world_size * shard_bytes].copy_(rows.reshape(-1))
    copy_back()
    return stats


@staging.stages(reads=("tensor",), writes=("output",), refusing=_staging_in_step)
@_without_autograd
def all_to_all(comm, tensor, output, *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="all_to_all",
               scratch_output=False, payload_bytes=None, agree_value=None):
    """Block q of `tensor` (any dtype, world_size blocks of equal bytes) goes to rank q, and block
    p of `output` takes rank p's block for this rank, exactly; each piece crosses the network
    once (``Communicator.all_to_all``). `output`, of `tensor`'s size, is written only on success
    and may be `tensor` itself. `collective`: what the caller's call is, checked across ranks with
    the byte count (LayoutMismatch where they differ). `scratch_output`: `output` (not `tensor`)
    is the caller's scratch, which a failed call may leave partly written: where its blocks are
    whole 32-bit words, the pieces land in it directly, with no copy through a buffer.
    `payload_bytes`: the caller's data in `tensor`, its own headers aside (all of it if None; the
    same on every rank): what decides whether the call is small enough to go in
    SMALL_CALL_COPIES copies. `agree_value`: this rank's value (0 to 2**32 - 1), agreed with the
    first call's verdict (the largest of every rank's); where that is not 0, every rank stops
    there alike: nothing is repaired, the function returns None, and `output` is not written
    (but for a `scratch_output`, which the pieces may already have reached).
    Returns the stats of each call."""
    import torch

    n = comm.world_size
    with _refused_in_step(comm, deadline):
        source, target = _as_torch(tensor), _as_torch(output, writes=True)
        if agree_value is not None:  # refused here, in step: every rank raises alike, none calls
            agree_value = agree_number(agree_value)
        if source.nbytes != target.nbytes:
            raise ValueError(f"all_to_all needs an output of the tensor's size ({source.nbytes} bytes, not "
                             f"{target.nbytes})")
        if source.nbytes % n:
            raise ValueError(f"all_to_all needs {n} blocks of equal bytes, and {source.nbytes} bytes do not divide so")
        words, _ = as_words(source)
    # payload_bytes chooses the copies: ranks that pass different ones make different calls
    salt = _salt(collective, source.nbytes) if payload_bytes is None else _salt(collective, source.nbytes, payload_bytes)
    block_bytes = source.nbytes // n
    width = -(-block_bytes // 4)  # a block as whole 32-bit words, padded where it is not
    with contextlib.ExitStack() as stack:
        if 4 * width != block_bytes:
            padded = stack.enter_context(_borrowed(comm, n * width))
            rows = padded.view(torch.uint8).view(n, 4 * width)
            rows[:, :block_bytes].copy_(words.view(torch.uint8)[:source.nbytes].view(n, block_bytes))
            rows[:, block_bytes:].zero_()  # a kept buffer's earlier contents are not the peers' to read
            words = padded
        out_words, copy_back = as_words(target, writes=True)
        straight = (scratch_output and 4 * width == block_bytes and out_words.data_ptr() == target.data_ptr()
                    and not tensors.memory_meets(target.data_ptr(), target.nbytes, source.data_ptr(), source.nbytes))
        received = out_words if straight else stack.enter_context(_borrowed(comm, n * width))

        def attempt(mask, copies):
            stats = comm.all_to_all(words, received, loss_budget=1.0, deadline=deadline, chunk_mask=mask,
                                    copies=copies, direct_output=True,  # received: ours or scratch
                                    layout_salt=_with_copies(salt, copies), agree_value=agree_value or 0)
            if stats.agreed_value:  # agreed: every rank stops here (a repeat passes 0 everywhere)
                raise _Declined(stats)
            return stats

        try:
            stats = _pieces_exactly(comm, attempt, words, received, attempts, deadline, payload_bytes)
        except _Declined:
            return None
        if not straight:
            rows = received.view(torch.uint8).view(n, 4 * width)[:, :block_bytes]
            out_words.view(torch.uint8)[:target.nbytes].copy_(rows.reshape(-1))
    if not straight:
        copy_back()
    return stats


@staging.stages(reads=("tensor",), overwrites=("output",), refusing=_staging_in_step)
@_without_autograd
def scatter(comm, tensor, output, src=0, *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="scatter"):
    """Block r of rank `src`'s `tensor` (world_size blocks of equal bytes, any dtype; only read,
    and only at `src`: others may pass None) becomes rank r's `output` (one block's bytes),
    exactly. Each block crosses the network once, from `src` to its rank
    (``Communicator.scatter``); what a call left missing is sent again (a mask exchange and a
    small scatter of the missing chunks; below REPAIR_MIN_CHUNKS the call is repeated whole,
    keeping what arrived) until every rank holds its block (agreed). `collective`: what the
    caller's call is, checked across ranks with `src` and the block's bytes (LayoutMismatch
    where they differ). `output` is written only on success. Returns the stats of each call."""
    import torch

    n = comm.world_size
    with _refused_in_step(comm, deadline):
        target = _as_torch(output, writes=True)
        block_bytes = target.nbytes
        if comm.rank == src:
            source = _as_torch(tensor)
            if source.nbytes != n * block_bytes:
                raise ValueError(f"scatter needs {n} blocks of the output's {block_bytes} bytes at the root, "
                                 f"got {source.nbytes} bytes")
            words, _ = as_words(source)
    salt = _salt(collective, src, block_bytes)
    width = -(-block_bytes // 4)  # a block as whole 32-bit words, padded where it is not
    with _borrowed(comm, n * width) as blocks:
        rows = blocks.view(torch.uint8).view(n, 4 * width)
        if comm.rank == src:
            rows[:, :block_bytes].copy_(words.view(torch.uint8)[:n * block_bytes].view(n, block_bytes))
            rows[:, block_bytes:].zero_()  # a kept buffer's earlier contents are not the peers' to read

        def attempt(mask, copies):
            return comm.scatter(blocks, src, loss_budget=1.0, deadline=deadline, chunk_mask=mask, copies=copies,
                                direct_output=True, layout_salt=_with_copies(salt, copies))  # blocks is ours

        stats = _until_held(comm, "scatter", attempt, blocks, attempts, deadline,
                            repair=lambda held, first: _repair_rooted(comm, "scatter", blocks, held, first, attempts - 1,
                                                                      deadline, src))
        out_words, copy_back = as_words(target, writes=True)
        out_words.view(torch.uint8)[:block_bytes].copy_(rows[comm.rank, :block_bytes])
    copy_back()
    return stats


@staging.stages(reads=("shard",), writes=("output",), refusing=_staging_in_step)  # off the root, it keeps its values
@_without_autograd
def gather(comm, shard, output, dst=0, *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="gather"):
    """Every rank's shard (any dtype, the same bytes everywhere) into rank `dst`'s `output`, rank
    r's at [r * len(shard), (r + 1) * len(shard)), exactly; elsewhere `output` keeps its values
    and may be None. Each shard crosses the network once, to `dst` (``Communicator.gather``);
    what a call left missing is sent again as for ``scatter`` until `dst` holds every shard
    (agreed). `collective`: what the caller's call is,
    checked across ranks with `dst` and the shard's bytes. Returns the stats of each call."""
    import torch

    n = comm.world_size
    with _refused_in_step(comm, deadline):
        words, _ = as_words(shard)
        shard_bytes = _as_torch(shard).nbytes
        if comm.rank == dst:
            output_bytes = _as_torch(output, writes=True).nbytes
            if output_bytes < n * shard_bytes:
                raise ValueError(f"output holds {output_bytes} bytes, {n} shards need {n * shard_bytes}")
    salt = _salt(collective, dst, shard_bytes)
    width = words.numel()
    with _borrowed(comm, n * width) as gathered:
        def attempt(mask, copies):
            return comm.gather(words, gathered, dst, loss_budget=1.0, deadline=deadline, chunk_mask=mask, copies=copies,
                               direct_output=True, layout_salt=_with_copies(salt, copies))  # gathered is ours

        stats = _until_held(comm, "gather", attempt, gathered, attempts, deadline,
                            repair=lambda held, first: _repair_rooted(comm, "gather", gathered, held, first, attempts - 1,
                                                                      deadline, dst))
        if comm.rank == dst:
            target, copy_back = as_words(output, writes=True)
            rows = gathered.view(torch.uint8).view(n, 4 * width)[:, :shard_bytes]
            target.view(torch.uint8)[:n * shard_bytes].copy_(rows.reshape(-1))
            copy_back()
    return stats


def _with_copies(salt, copies):
    """A call's layout salt with its copies folded in (a small call's first goes in the copies
    _FirstCallCopies gives): ranks whose copies differ raise LayoutMismatch together, and start
    their counts afresh."""
    return zlib.crc32(bytes([copies]), salt) or 1


def _until_held(comm, collective, attempt, target, attempts, deadline, repair=None, payload_bytes=None, small=None):
    """Calls of `collective` into int32 `target`, each with a chunk mask, until every rank holds
    every chunk of its result (agreed). An incomplete first call of REPAIR_MIN_CHUNKS chunks or
    more is followed by `repair(held, first)` (the stats of its calls); a smaller one (or one
    without a repair) is repeated whole, each call keeping what earlier ones delivered, and goes
    out in SMALL_CALL_COPIES copies when its `payload_bytes` (default: target's size) are at
    most SMALL_CALL_BYTES. `small`: whether the call is small (default: target has fewer than
    REPAIR_MIN_CHUNKS chunks), the same on every rank. A small call's first goes in the copies
    _FirstCallCopies gives (one while such calls arrive whole), and `attempt(mask, copies)` folds
    the copies into its layout salt (_with_copies). Returns the stats of each call."""
    held = comm.chunk_mask(collective, target)
    if small is None:
        small = held.size < REPAIR_MIN_CHUNKS  # the same size, so the same branch, on every rank
    sized = target.nbytes if payload_bytes is None else payload_bytes
    copies = SMALL_CALL_COPIES if small and sized <= SMALL_CALL_BYTES else 1
    # the first call's, by what earlier ones met
    copying = _first_call_copies(comm) if copies > 1 else None
    first_copies = copying.copies(sized) if copying else copies
    calls = [attempt(held, first_copies)]
    if copying:
        copying.note(first_copies, sized, missed=calls[0].gather_fraction < 1.0)
    if calls[0].gather_fraction >= 1.0:  # agreed: every rank's least
        return calls
    held = held.astype(bool)
    if not small and repair is not None:
        return calls + repair(held, calls[0])
    for _ in range(attempts - 1):
        if not comm.agree(not held.all(), deadline=deadline):
            return calls
        mask = comm.chunk_mask(collective, target)
        calls.append(attempt(mask, copies))
        held |= mask.astype(bool)
    if not comm.agree(not held.all(), deadline=deadline):
        return calls
    raise LossBudgetExceeded(f"rank {comm.rank}: exact {collective} still incomplete after {attempts} attempts", calls[-1])


def _repair_rooted(comm, collective, target, held, first, attempts, deadline, root):
    """Fill the chunks of int32 `target` a scatter from `root` or a gather to it left missing:
    every rank's mask gathered exactly, then row b of a small call of the same kind carries the
    chunks of block b that block b's receiver (a scatter's rank b, a gather's root) lacks, sent
    by block b's holder (the root, or rank b), every row padded to the most any row lacks."""
    import numpy as np
    import torch

    n, me = comm.world_size, comm.rank
    scatter = collective == "scatter"
    starts, stops = comm.chunk_bounds(target.numel(), "int32")
    step = comm.chunk_elements("int32")
    per_block = held.size // n  # equal blocks: target holds n of one width
    calls = []
    loss = min(0.5, 1.0 - first.gather_fraction)
    for _ in range(attempts):
        lacked = _lacked_everywhere(comm, held, attempts, deadline)  # rank, chunk
        if not lacked.any():
            return calls
        chunk_of = [np.flatnonzero(lacked[b if scatter else root, b * per_block:(b + 1) * per_block]) + b * per_block
                    for b in range(n)]
        slots = max(chunks.size for chunks in chunk_of)
        slot_of = [b * slots + np.arange(chunks.size) for b, chunks in enumerate(chunk_of)]
        sends = [b for b in range(n) if (root if scatter else b) == me and chunk_of[b].size]
        takes = [b for b in range(n) if (b if scatter else root) == me and (root if scatter else b) != me]
        repair = torch.zeros(n * slots * step, dtype=torch.int32)
        if sends:
            into, out_of = _element_pairs(starts, stops, np.concatenate([chunk_of[b] for b in sends]),
                                          np.concatenate([slot_of[b] for b in sends]), step)
            repair[into] = target[out_of]
        arrived = comm.chunk_mask(collective, repair)
        copies = _repair_copies(loss, n * slots, sum(chunks.size for chunks in chunk_of), held.size)
        if scatter:
            calls.append(comm.scatter(repair, root, loss_budget=1.0, deadline=deadline, chunk_mask=arrived,
                                      copies=copies, direct_output=True))
        else:
            own = repair[me * slots * step:(me + 1) * slots * step].clone()  # a gather's input lies apart from its output
            calls.append(comm.gather(own, repair, root, loss_budget=1.0, deadline=deadline, chunk_mask=arrived,
                                     copies=copies, direct_output=True))
        for b in takes:
            taken = arrived[slot_of[b]].astype(bool)
            out_of, into = _element_pairs(starts, stops, chunk_of[b][taken], slot_of[b][taken], step)
            target[into] = repair[out_of]
            held[chunk_of[b][taken]] = True
        if calls[-1].gather_fraction >= 1.0:  # every row arrived whole: no mask needs gathering again
            return calls
    raise LossBudgetExceeded(f"rank {me}: exact {collective} still incomplete after {attempts} repairs",
                             calls[-1] if calls else first)


def _pieces_exactly(comm, attempt, source, target, attempts, deadline, payload_bytes=None):
    """all_to_all of int32 `source` into `target` until every rank holds every piece: a call with
    a chunk mask, then repairs (or, below REPAIR_MIN_CHUNKS, whole calls again until no rank lacks
    a chunk, agreed). Unlike a broadcast's, every rank's result differs: completeness is read
    from the masks, never from comparing copies."""
    return _until_held(comm, "all_to_all", attempt, target, attempts, deadline,
                       repair=lambda held, first: _repair_pieces(comm, source, target, held, first, attempts - 1,
                                                                 deadline), payload_bytes=payload_bytes)


def _repair_pieces(comm, source, target, held, first, attempts, deadline):
    """Fill the chunks of `target` some rank lacks, as _repair does for an all_gather: every
    rank's mask gathered exactly, then rank p sends each rank r the chunks of its block r that r
    lacks from p, every pair's padded to the most any pair lacks, in one small all_to_all."""
    import numpy as np
    import torch

    n, me = comm.world_size, comm.rank
    starts, stops = comm.chunk_bounds(target.numel(), "int32")
    step = comm.chunk_elements("int32")
    per_block = held.size // n  # equal blocks: an all_to_all's chunks are n rows of one length
    calls = []
    loss = min(0.5, 1.0 - first.gather_fraction)
    for _ in range(attempts):
        lacked = _lacked_everywhere(comm, held, attempts, deadline)  # receiver, chunk
        if not lacked.any():
            return calls
        counts = lacked.reshape(n, n, per_block).sum(axis=2)  # receiver, sender
        slots = int(counts.max())

        def pairs(receiver_rows, sender_of_row):
            """(chunk within its block, slot in the repair) for each row's lacking chunks."""
            chunk, slot = [], []
            for row, (receiver, sender) in enumerate(zip(receiver_rows, sender_of_row)):
                lacking = np.flatnonzero(lacked[receiver, sender * per_block:(sender + 1) * per_block])
                chunk.append(lacking)
                slot.append(row * slots + np.arange(lacking.size))
            return np.concatenate(chunk), np.concatenate(slot)

        # as a sender: row r of the repair carries what r lacks from us, out of our block r
        chunks_out, slots_out = pairs(range(n), [me] * n)
        blocks_out = np.repeat(np.arange(n), [int(counts[r, me]) for r in range(n)])
        outgoing = torch.zeros(n * slots * step, dtype=torch.int32)
        into, out_of = _element_pairs(starts, stops, blocks_out * per_block + chunks_out, slots_out, step)
        outgoing[into] = source[out_of]
        incoming = torch.empty(n * slots * step, dtype=torch.int32)
        arrived = comm.chunk_mask("all_to_all", incoming)
        copies = _repair_copies(loss, n * slots, int(counts.sum()), held.size)
        calls.append(comm.all_to_all(outgoing, incoming, loss_budget=1.0, deadline=deadline, chunk_mask=arrived,
                                     copies=copies, direct_output=True))
        # as a receiver: row p of the repair holds what we lack from p, for our block p
        chunks_in, slots_in = pairs([me] * n, range(n))
        blocks_in = np.repeat(np.arange(n), [int(counts[me, p]) for p in range(n)])
        wanted = blocks_in * per_block + chunks_in
        taken = arrived[slots_in].astype(bool)
        out_of, into = _element_pairs(starts, stops, wanted[taken], slots_in[taken], step)
        target[into] = incoming[out_of]
        held[wanted[taken]] = True
        if calls[-1].gather_fraction >= 1.0:
            return calls
    raise LossBudgetExceeded(f"rank {me}: exact all_to_all still incomplete after {attempts} repairs",
                             calls[-1] if calls else first)


@staging.stages(writes=("tensor",))
@_without_autograd
def allreduce(comm, tensor, op="sum", *, attempts=DEFAULT_ATTEMPTS, deadline=None, collective="allreduce", form="auto"):
    """Reduce `tensor` (numpy or torch, CPU, any dtype) across ranks in place,
    exactly and bitwise identically on every rank. op: sum, mean/avg, max,
    min, product (strings or torch ReduceOp). `collective`: what the caller's call
    is (e.g. ("reduce", root)), checked across ranks with the op, the dtype (the
    reduction reads it) and the size: ranks whose calls differ raise LayoutMismatch.

    form: "sharded" sends block q of every rank's input to rank q (an exact all_to_all), rank q
    reduces its block's world_size pieces in rank order, and an exact all-gather gives every
    rank every reduced block: about twice the tensor's bytes per rank, as a ring moves.
    "gathered" is one exact all-gather of every rank's whole input and the same reduction on
    every rank: world_size - 1 times the bytes, but one call instead of two. "auto" takes
    "sharded" where it saves SHARDED_SAVING_MIN_BYTES per rank or more (never at 2 ranks, where
    both send the tensor once).
    Either way the result is the reduction in rank order of the same inputs, widened as
    _reduce_rows does, so both forms give the same bits.

    "engine" (int32 SUM, where the order of the additions cannot change a bit; float32 and
    float64 SUM and MEAN, whose owners then reduce in rank order in float64 as _reduce_rows does:
    ``Communicator.allreduce(reduce_in_rank_order=True)``): first one engine allreduce with a
    loss budget of 0, which moves 2(n-1)/n of the tensor in one call and whose agreed verdict
    says whether every contribution arrived everywhere; only where it did not
    (LossBudgetExceeded, on every rank alike), the sharded or gathered form from the kept input,
    which gives the same bits. "auto" tries it where it applies unless such attempts failed
    lately on this communicator (their outcomes are agreed, so every rank skips alike; see
    _EngineBackoff).

    The form is a function of the size, the world, `form` and the agreed outcomes of earlier
    calls: ranks whose calls agree on those take the same one."""
    import torch

    with _refused_in_step(comm, deadline):
        name = _reduction(op)
        if form not in ("auto", "sharded", "gathered", "engine"):
            raise ValueError(f"form must be 'auto', 'sharded', 'gathered' or 'engine', got {form!r}")
        wrapped = _as_torch(tensor, writes=True)
        engine_applies, in_rank_order = _engine_reduces(wrapped.dtype, name)
        if form == "engine" and not engine_applies:
            raise ValueError(f"form='engine' takes an int32 sum or a float32 or float64 sum or mean, got "
                             f"{wrapped.dtype} and {name}")
    n = comm.world_size
    calls = []
    backoff = _EngineBackoff.of(comm)
    if form == "engine" or form == "auto" and engine_applies and backoff.try_now():
        # in the caller's memory where it is contiguous: a failed engine call puts it back
        in_memory = wrapped.is_contiguous()
        flat = wrapped.view(-1) if in_memory else wrapped.reshape(-1).clone()
        if _engine_first(backoff, calls, lambda: comm.allreduce(
                flat, op=name, loss_budget=0.0, deadline=deadline, reduce_in_rank_order=in_rank_order,
                layout_salt=_salt(collective, name, str(flat.dtype), "engine", flat.nbytes))):
            if not in_memory:
                wrapped.copy_(flat.view(wrapped.shape))
            return calls
        form = "auto"
    flat = wrapped.reshape(-1).clone()  # the input as given (a failed engine call put it back)
    if form in ("auto", "engine"):
        form = form_by_size(flat.nbytes, n)
    claim = (collective, name, str(flat.dtype), form)
    if form == "gathered":
        gathered = torch.empty((n, flat.numel()), dtype=flat.dtype)
        stats = all_gather(comm, flat, gathered, attempts=attempts, deadline=deadline, collective=claim)
        result = _reduce_rows(gathered, name, n)
    else:
        block = -(-flat.numel() // n)  # elements; the last blocks are padded where the count does not divide
        padded = torch.zeros(n * block, dtype=flat.dtype)
        padded[:flat.numel()].copy_(flat)
        pieces = torch.empty_like(padded)  # row p: rank p's values of this rank's block
        stats = all_to_all(comm, padded, pieces, attempts=attempts, deadline=deadline, collective=claim)
        reduced = _reduce_rows(pieces.view(n, block), name, n)
        gathered = torch.empty(n * block, dtype=flat.dtype)
        stats = stats + all_gather(comm, reduced, gathered, attempts=attempts, deadline=deadline, collective=claim)
        result = gathered[:flat.numel()]
    wrapped.copy_(result.view(wrapped.shape))
    return calls + stats


@staging.stages(reads=("tensor",), writes=("output",), refusing=_staging_in_step)
@_without_autograd
def reduce_scatter(comm, tensor, output, op="sum", *, attempts=DEFAULT_ATTEMPTS, deadline=None,
                   collective="reduce_scatter"):
    """`output` becomes this rank's shard (``comm.shard_range`` of `tensor`'s count) of the exact
    reduction of every rank's `tensor` (only read): the bits allreduce gives there. An int32 sum,
    or a float32 or float64 sum or mean, first tries the engine's reduce_scatter with a loss
    budget of 0 (in rank order for the floats), which sends (n-1)/n of the tensor in one call,
    under allreduce's backoff; otherwise, or where it lost something, an exact allreduce of a
    copy, whose shard is kept. `output` is written only on success. Returns the stats of each
    call."""
    with _refused_in_step(comm, deadline):
        name = _reduction(op)
        source, target = _as_torch(tensor), _as_torch(output, writes=True)
        start, stop = comm.shard_range(source.numel())
        if target.numel() != stop - start or target.dtype != source.dtype:
            raise ValueError(f"exact reduce_scatter on rank {comm.rank}: output must be {stop - start} {source.dtype} "
                             f"elements (this rank's shard), got {target.numel()} {target.dtype}")
    engine_applies, in_rank_order = _engine_reduces(source.dtype, name)
    calls, form = [], "auto"
    backoff = _EngineBackoff.of(comm)
    if engine_applies and backoff.try_now():
        flat = source.view(-1) if source.is_contiguous() else source.reshape(-1).clone()  # the engine reads whole rows
        shard = target.view(-1) if target.is_contiguous() else target.reshape(-1).clone()
        if _engine_first(backoff, calls, lambda: comm.reduce_scatter(
                flat, shard, op=name, loss_budget=0.0, deadline=deadline, reduce_in_rank_order=in_rank_order,
                layout_salt=_salt(collective, name, str(flat.dtype), "engine", flat.nbytes))):
            if shard.data_ptr() != target.data_ptr():
                target.copy_(shard.view(target.shape))
            return calls
    if engine_applies:  # the form allreduce's "auto" would take, without looking at the backoff again
        form = form_by_size(source.nbytes, comm.world_size)
    reduced = source.reshape(-1).clone()
    calls += allreduce(comm, reduced, name, attempts=attempts, deadline=deadline, collective=collective, form=form)
    target.copy_(reduced[start:stop].view(target.shape))
    return calls


def form_by_size(nbytes, world_size):
    """The exact allreduce form "auto" takes when the engine's one call is not made or failed."""
    return "sharded" if sharded_saving(nbytes, world_size) >= SHARDED_SAVING_MIN_BYTES else "gathered"


def _reduction(op):
    """The exact layer's name for `op` (ValueError for one it cannot reduce with)."""
    name = tensors.op_name(op)
    name = {"avg": "mean", "prod": "product"}.get(name, name)
    if name not in ("sum", "mean", "max", "min", "product"):
        raise ValueError(f"exact reductions support sum, mean, max, min and product, got {op!r}")
    return name


def _engine_reduces(dtype, name):
    """(whether the engine's one call gives the exact forms' bits for `name` on `dtype`, whether
    it must reduce in rank order for that): an int32 sum in any order; a float32 or float64 sum
    or mean in rank order."""
    import torch

    in_rank_order = name in ("sum", "mean") and dtype in (torch.float32, torch.float64)
    return in_rank_order or name == "sum" and dtype == torch.int32, in_rank_order


def _engine_first(backoff, calls, call):
    """Make the engine's one call; True when it succeeded. Its verdict is agreed, so where it lost
    something every rank records the failed call, backs off alike and goes on to an exact form."""
    try:
        calls.append(call())
    except LossBudgetExceeded as error:
        backoff.failed()
        calls.append(error.stats)
        return False
    backoff.succeeded()
    return True


class _EngineBackoff:
    """When an exact allreduce or reduce_scatter (an int32 sum, a float sum or mean in rank
    order) tries the engine's one call first. Each failed attempt (some contribution lost: the call is
    then repeated in an exact form) doubles the number of calls that skip it, up to 64; a
    success resets it. Every rank sees the same agreed outcomes
    in the same order, so every rank skips the same calls. So does a LayoutMismatch since the
    last look (``Communicator.layout_mismatches``, counted alike everywhere): ranks whose calls
    differed may have looked differently (one refused its call before looking, another looked and
    used up a skip), and without it they would take different forms for the same call after."""
    _of = weakref.WeakKeyDictionary()
    MOST_SKIPPED = 64

    def __init__(self, mismatches=0):
        self.skip_next = 0     # calls still to skip
        self.skip_after = 0    # calls to skip after the next failure
        self.mismatches = mismatches  # comm.layout_mismatches when made (state_since_mismatch)

    @classmethod
    def of(cls, comm):
        return state_since_mismatch(cls._of, comm, cls)

    def try_now(self):
        if self.skip_next:
            self.skip_next -= 1
            return False
        return True

    def failed(self):
        self.skip_after = min(max(1, 2 * self.skip_after), self.MOST_SKIPPED)
        self.skip_next = self.skip_after

    def succeeded(self):
        self.skip_next = self.skip_after = 0


def sharded_saving(nbytes, world_size):
    """Bytes per rank the sharded form saves over the gathered: (n-1) - 2(n-1)/n of the tensor."""
    return (world_size - 1) * (world_size - 2) * nbytes // world_size


def _reduce_rows(rows, name, n):
    """The reduction of rows[0], rows[1], ... in that order, in the input's dtype: floating sums
    and products in float64 (complex128), rounded once at the end; integer ones in their own
    dtype, whose wrap-around gives the bits an int64 sum narrowed would. One order and one
    widening give the same bits wherever it runs. Row by row, so the wide copy is one row, not n
    (1.6-2.7x faster for floats than widening every row and summing, 9x for int32, with the same
    bits, but for float64, which torch's own sum adds in another order than rank order)."""
    import torch

    if name in ("max", "min"):
        return rows.amax(dim=0) if name == "max" else rows.amin(dim=0)
    integer = not (rows.dtype.is_floating_point or rows.dtype.is_complex)
    if integer and name != "mean":
        return rows.prod(dim=0, dtype=rows.dtype) if name == "product" else rows.sum(dim=0, dtype=rows.dtype)
    wide = torch.complex128 if rows.dtype.is_complex else torch.float64 if rows.dtype.is_floating_point else torch.int64
    result = rows[0].to(wide, copy=True)  # never the input row itself (a float64 row's .to() would be)
    for row in rows[1:]:
        result.mul_(row) if name == "product" else result.add_(row)
    if name == "mean":
        result = result / n
    return result.to(rows.dtype)


def barrier(comm, *, deadline=None):
    """Returns once every rank has called it (an agreement round)."""
    comm.agree(0, deadline=deadline)
