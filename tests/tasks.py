"""Functions the tests run on every rank: task(comm, *args). Expected values
are computed from rank and world size, so any world size works."""
import time

import numpy as np
import torch

import support
import ud_transport
from support import in_place_at_cache_share, many_large  # noqa: F401  tasks the SoftRoCE guest runs too, so they live in support


def rank_values(rank, count, dtype, integer_valued=True):
    """support.rank_values, and as a torch tensor for bfloat16 (numpy has no such dtype)."""
    if dtype == "bfloat16":
        return torch.tensor(support.rank_values(rank, count, "float64", integer_valued), dtype=torch.bfloat16)
    return support.rank_values(rank, count, dtype, integer_valued)


def allreduce_values(comm, count, dtype, op, integer_valued=True, loss_budget=0.0, deadline=10.0, algorithm=None):
    tensor = rank_values(comm.rank, count, dtype, integer_valued)
    stats = comm.allreduce(tensor, op=op, loss_budget=loss_budget, deadline=deadline, algorithm=algorithm)
    result = tensor.float().numpy() if isinstance(tensor, torch.Tensor) else tensor
    return result, stats


def torch_values(rank, count, dtype_name):
    """arange(count) + rank as a torch tensor: sums of up to 300 are not all exact in 16-bit floats."""
    return torch.arange(count, dtype=getattr(torch, dtype_name)) + rank


def allreduce_torch(comm, count, dtype_name):
    """torch_values reduced in place: (the tensor's values after the call as float64, stats,
    whether it kept its storage, dtype and shape)."""
    tensor = torch_values(comm.rank, count, dtype_name)
    before = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0)
    same = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)) == before
    return tensor.double().numpy(), stats, same


def repeated_trials(comm, inputs_per_rank, trials, loss_budget, estimator, fresh_seed=None, algorithm=None):
    """Run `trials` allreduces. With fresh_seed, inputs are drawn anew each trial
    (exchangeable across ranks, like gradients); otherwise they are fixed."""
    results, inputs, fractions = [], [], []
    for trial in range(trials):
        if fresh_seed is None:
            values = inputs_per_rank[comm.rank].copy()
        else:
            values = support.fresh_values(fresh_seed, trial, comm.rank, inputs_per_rank)
        inputs.append(values.copy())
        stats = comm.allreduce(values, loss_budget=loss_budget, deadline=10.0, estimator=estimator, algorithm=algorithm)
        results.append(values)
        fractions.append(stats.delivered_fraction)
    return np.array(results), np.array(inputs), np.array(fractions)


def _allreduce_error(comm, tensor, loss_budget, deadline):
    """The TransportError an allreduce raised, or None."""
    try:
        comm.allreduce(tensor, loss_budget=loss_budget, deadline=deadline)
    except ud_transport.TransportError as caught:
        return caught
    return None


def allreduce_catching(comm, count, loss_budget, deadline):
    """Returns (input unchanged?, exception or None, elapsed seconds)."""
    tensor = np.arange(count, dtype=np.float32) + comm.rank
    original = tensor.copy()
    start = time.monotonic()
    error = _allreduce_error(comm, tensor, loss_budget, deadline)
    return bool(np.array_equal(tensor, original)), error, time.monotonic() - start


def allreduce_restoring_bytes(comm, count, dtype, loss_budget, deadline):
    """An allreduce expected to fail: returns (the tensor's bytes as given?, exception or None).
    Floats include NaN, -0.0, infinities and a subnormal, which a value comparison would miss."""
    rng = np.random.default_rng(comm.rank)
    if np.dtype(dtype).kind == "f":
        tensor = rng.standard_normal(count).astype(dtype)
        specials = np.array([np.nan, -0.0, np.inf, -np.inf, np.finfo(dtype).tiny / 4], dtype=dtype)
        tensor[: len(specials)] = specials
    else:
        tensor = rng.integers(-(2**31), 2**31 - 1, count, dtype=dtype)
    original = tensor.tobytes()
    error = _allreduce_error(comm, tensor, loss_budget, deadline)
    return tensor.tobytes() == original, error


def address_of(comm):
    return comm.address, comm.chunk_bytes


def stats_after_allreduce(comm, count, deadline, algorithm=None):
    tensor = np.full(count, support.rank_fill(comm.rank), dtype=np.float32)
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=deadline, algorithm=algorithm)
    return tensor, stats


def session_of(comm):
    """The session id this rank's communicator agreed on (what its datagrams carry)."""
    return comm.session_id


def late_allreduce(comm, late_rank, delay_s, deadline):
    """One rank joins late; everyone else is already waiting."""
    if comm.rank == late_rank:
        time.sleep(delay_s)
    tensor = np.full(1000, support.rank_fill(comm.rank), dtype=np.float32)
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
    return bool(np.all(tensor == support.rank_fill_sum(comm.world_size))), stats.delivered_fraction


def mismatched_allreduce(comm, deadline):
    """Every rank calls with a different element count: a caller's bug."""
    tensor = np.ones(100 + 10 * comm.rank, dtype=np.float32)
    try:
        comm.allreduce(tensor, loss_budget=1.0, deadline=deadline)
        error = None
    except ud_transport.TransportError as caught:
        error = caught
    return error, bool(np.all(tensor == 1))


def as_numpy(tensor):
    return tensor.float().numpy() if isinstance(tensor, torch.Tensor) else tensor


def zeros_like_values(count, dtype):
    return torch.zeros(count, dtype=torch.bfloat16) if dtype == "bfloat16" else np.zeros(count, dtype=dtype)


def reduce_scatter_values(comm, count, dtype, op, algorithm):
    tensor = rank_values(comm.rank, count, dtype)
    before = as_numpy(tensor).copy()
    start, stop = comm.shard_range(count)
    output = zeros_like_values(stop - start, dtype)
    stats = comm.reduce_scatter(tensor, output, op=op, loss_budget=0.0, deadline=10.0, algorithm=algorithm)
    assert np.array_equal(as_numpy(tensor), before), "reduce_scatter changed its input"
    return as_numpy(output).copy(), (start, stop), stats


def all_gather_values(comm, count, dtype, algorithm):
    start, stop = comm.shard_range(count)
    shard = rank_values(comm.rank, count, dtype)[start:stop].clone() if dtype == "bfloat16" else \
        rank_values(comm.rank, count, dtype)[start:stop].copy()
    output = zeros_like_values(count, dtype)
    stats = comm.all_gather(shard, output, loss_budget=0.0, deadline=10.0, algorithm=algorithm)
    return as_numpy(output).copy(), stats


def broadcast_values(comm, count, dtype, root, algorithm):
    tensor = rank_values(comm.rank, count, dtype)
    stats = comm.broadcast(tensor, root, loss_budget=0.0, deadline=10.0, algorithm=algorithm)
    return as_numpy(tensor).copy(), stats


def lossy_gathers(comm, count, calls, algorithm, kind, direct_output=False):
    """all_gather (or broadcast from rank 0) under loss into an output that holds
    a known old value; returns what each call left there."""
    rows = []
    for call in range(calls):
        old = np.full(count, -1000.0 - call, dtype=np.float32)
        fresh = (np.arange(count, dtype=np.float32) * 3 + 7 * comm.rank + call).astype(np.float32)
        output = old.copy()
        start, stop = comm.shard_range(count)
        if kind == "all_gather":
            stats = comm.all_gather(fresh[start:stop].copy(), output, loss_budget=1.0, deadline=10.0, algorithm=algorithm,
                                    direct_output=direct_output)
        else:
            if comm.rank == 0:
                output = fresh.copy()
            stats = comm.broadcast(output, 0, loss_budget=1.0, deadline=10.0, algorithm=algorithm,
                                   direct_output=direct_output)
        rows.append((output, stats.chunks_stale, stats.own_gather_fraction))
    return rows


def verdicts_under_loss(comm, calls, count, budget, algorithm):
    """Outcome of each call as (exception class or "ok", rank it names)."""
    outcomes = []
    for call in range(calls):
        tensor = np.full(count, comm.rank + 1.0, dtype=np.float32)
        try:
            comm.allreduce(tensor, loss_budget=budget, deadline=5.0, algorithm=algorithm)
            outcomes.append(("ok", None))
        except ud_transport.TransportError as error:
            outcomes.append((type(error).__name__, getattr(error, "rank", None)))
    return outcomes


def verdict_round_ends(comm, calls, count):
    """Per call: its outcome, when this rank returned against the call's hard deadline, and
    whether it stopped waiting for a silent peer's acknowledgement."""
    ends = []
    for call in range(calls):
        tensor = np.full(count, comm.rank + 1.0, dtype=np.float32)
        try:
            stats, outcome = comm.allreduce(tensor, loss_budget=1.0, deadline=2.0), "ok"
        except ud_transport.TransportError as error:
            outcome = f"{type(error).__name__} naming {getattr(error, 'rank', None)}: {error}"
            ends.append((outcome, None, None, 0))
            continue
        slack = min(max(stats.deadline_s / 4, 0.05), 1.0)  # the verdict round's slack past the data deadline (liveness.c)
        ends.append((outcome, stats.elapsed_s - stats.join_wait_s - stats.output_s, stats.deadline_s + slack,
                     stats.verdict_acks_presumed))
        # Then wait for the others through the store, as a job waits in another collective: a rank
        # that returned sends nothing of its next call that could stand in for a lost answer.
        prefix = f"verdict-round-ends/{stats.sequence}"  # the same on every rank, new with every call
        comm.store.set(f"{prefix}/{comm.rank}", b"1")
        comm.store.wait([f"{prefix}/{r}" for r in range(comm.world_size)])
    return ends


def agree_values(comm, calls):
    results = []
    for call in range(calls):
        value = (comm.rank * 7 + call) % 11
        results.append((comm.agree(value, deadline=5.0), comm.agree(comm.rank == call % comm.world_size, deadline=5.0),
                        comm.agree(False, deadline=5.0)))
    return results


def budget_successes(comm, calls, count):
    succeeded = 0
    for call in range(calls):
        tensor = np.random.default_rng([call, comm.rank]).standard_normal(count).astype(np.float32)
        try:
            comm.allreduce(tensor, loss_budget=0.1, deadline=5.0)
            succeeded += 1
        except ud_transport.LossBudgetExceeded:
            pass
    return succeeded


def argument_errors(comm):
    """Each bad call must raise the named exception; returns what did not."""
    import datetime

    wrong = []
    start, stop = comm.shard_range(10)

    def expect(exception, call):
        try:
            call()
            wrong.append(f"no {exception.__name__}")
        except exception:
            pass

    data = np.ones(10, dtype=np.float32)
    expect(ValueError, lambda: comm.reduce_scatter(data, np.zeros(stop - start + 1, dtype=np.float32)))
    expect(TypeError, lambda: comm.reduce_scatter(data, np.zeros(stop - start, dtype=np.float64)))
    expect(ValueError, lambda: comm.all_gather(np.ones(stop - start + 1, dtype=np.float32), data))
    expect(ValueError, lambda: comm.broadcast(data, comm.world_size))
    expect(ValueError, lambda: comm.agree(2**32))
    expect(ValueError, lambda: comm.allreduce(data, algorithm="tree"))
    expect(TypeError, lambda: comm.allreduce(np.ones(4, dtype=">f4")))
    for copies in (0, ud_transport._native.MAX_COPIES + 1, True, 1.5, "2"):
        expect(ValueError, lambda: comm.allreduce(data, copies=copies))
    expect(ValueError, lambda: comm.all_gather(data[start:stop].copy(), data, copies=0))
    if not np.all(data == 1):
        wrong.append("a refused call changed the tensor")
    # accepted spellings
    import torch.distributed as dist

    comm.allreduce(data, op=dist.ReduceOp.SUM, deadline=datetime.timedelta(seconds=5), loss_budget=0.0)
    if not np.all(data == comm.world_size):
        wrong.append("ReduceOp.SUM with a timedelta deadline did not sum")
    comm.allreduce(data, op=ud_transport.ReduceOp.SUM, estimator=ud_transport.Estimator.ZERO_FILL, loss_budget=0.0)
    if not np.all(data == comm.world_size ** 2):
        wrong.append("ud_transport.ReduceOp.SUM with Estimator.ZERO_FILL did not sum")
    return wrong


def reduce_scatter_trials(comm, count, trials, estimator, seed, algorithm):
    """reduce_scatter of inputs drawn anew each trial (exchangeable, like gradients):
    returns this rank's shards and every input, so the test knows the truth."""
    start, stop = comm.shard_range(count)
    shards, inputs = [], []
    for trial in range(trials):
        values = support.fresh_values(seed, trial, comm.rank, count)
        output = np.zeros(stop - start)
        comm.reduce_scatter(values, output, loss_budget=1.0, deadline=10.0, estimator=estimator, algorithm=algorithm)
        shards.append(output)
        inputs.append(values)
    return np.array(shards), np.array(inputs), (start, stop)


def allreduce_within_budget(comm, count, loss_budget, deadline):
    """Allreduce of support.marked_values in float32. Returns (result, stats) or (None, the exception)."""
    tensor = support.marked_values(comm.rank, count).astype(np.float32)
    try:
        return tensor, comm.allreduce(tensor, loss_budget=loss_budget, deadline=deadline)
    except ud_transport.TransportError as error:
        return None, error


def _snapshot(*tensors):
    return [as_numpy(t).copy() for t in tensors]


def _unchanged(before, *tensors):
    return all(np.array_equal(old, as_numpy(t), equal_nan=True) for old, t in zip(before, tensors))


def every_collective_failing(comm, count, algorithm, how):
    """Each collective in a way that must fail on every rank: how="budget" asks
    for nothing lost (under injected loss), how="layout" has every rank call
    with another size (or root). Returns {collective: (exception class name,
    rank it names, every tensor and output unchanged)}."""
    if how == "layout":
        count += 8 * comm.rank
    start, stop = comm.shard_range(count)
    values = np.arange(count, dtype=np.float32) * 0.5 + comm.rank
    budget = 0.0 if how == "budget" else 1.0
    root = comm.rank if how == "layout" else comm.world_size - 1
    deadline = 1.0 if how == "layout" else 5.0  # a mismatch is only known at the deadline
    calls = {
        "allreduce": lambda t: comm.allreduce(t[0], loss_budget=budget, deadline=deadline, algorithm=algorithm),
        "reduce_scatter": lambda t: comm.reduce_scatter(t[0], t[1], loss_budget=budget, deadline=deadline, algorithm=algorithm),
        "all_gather": lambda t: comm.all_gather(t[0], t[1], loss_budget=budget, deadline=deadline, algorithm=algorithm),
        "broadcast": lambda t: comm.broadcast(t[0], root, loss_budget=budget, deadline=deadline, algorithm=algorithm),
        "all_to_all": lambda t: comm.all_to_all(t[0], t[1], loss_budget=budget, deadline=deadline),
    }
    whole = count // comm.world_size * comm.world_size  # equal blocks (differing across ranks for "layout")
    operands = {
        "allreduce": (values.copy(),),
        "reduce_scatter": (values.copy(), np.full(stop - start, -7.0, dtype=np.float32)),
        "all_gather": (values[start:stop].copy(), np.full(count, -7.0, dtype=np.float32)),
        "broadcast": (values.copy(),),
        "all_to_all": (values[:whole].copy(), np.full(whole, -7.0, dtype=np.float32)),
    }
    outcome = {}
    for name, call in calls.items():
        tensors = operands[name]
        before = _snapshot(*tensors)
        try:
            call(tensors)
            outcome[name] = ("ok", None, _unchanged(before, *tensors))
        except ud_transport.TransportError as error:
            outcome[name] = (type(error).__name__, getattr(error, "rank", None), _unchanged(before, *tensors))
    return outcome


def receive_buffer_of(comm):
    """(receive buffer the kernel granted, credit window the engine uses) on this rank."""
    return getattr(comm, "receive_buffer_bytes", 0), comm.window_bytes


def allreduce_many_lossy(comm, count, calls):
    """Several allreduces of count float32 with loss allowed; per call (delivered fraction, chunks lost, idle-closed steps)."""
    tensor = np.ones(count, dtype=np.float32)
    rows = []
    for _ in range(calls):
        stats = comm.allreduce(tensor, loss_budget=1.0, deadline=30.0)
        rows.append((round(stats.delivered_fraction, 5), stats.chunks_lost, stats.steps_answered))
    return [r for r in rows if r[1]]


def allreduces_across_wrap(comm, last_sequence, calls, algorithm):
    """Set the sequence number of the last call on this rank (every rank alike),
    then run `calls` allreduces: (sequences seen, all exact, delivered fractions)."""
    comm._engine.set_sequence(last_sequence)
    expected = support.rank_fill_sum(comm.world_size)
    sequences, exact, fractions = [], True, []
    for _ in range(calls):
        tensor = np.full(2000, support.rank_fill(comm.rank), dtype=np.float32)
        stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0, algorithm=algorithm)
        sequences.append(stats.sequence)
        fractions.append(stats.delivered_fraction)
        exact = exact and bool(np.all(tensor == expected))
    return sequences, exact, fractions


def misaligned_allreduce(comm, count, dtype, offset, algorithm):
    """An allreduce on an array that starts `offset` bytes past an aligned address."""
    itemsize = np.dtype(dtype).itemsize
    raw = bytearray(count * itemsize + 16)
    start = (-np.frombuffer(raw, dtype=np.uint8).ctypes.data) % 16 + offset
    tensor = np.frombuffer(raw, dtype=dtype, count=count, offset=start)
    tensor[:] = rank_values(comm.rank, count, dtype)
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0, algorithm=algorithm)
    return tensor.ctypes.data % itemsize, tensor.copy(), stats.delivered_fraction



def resize_during_call(comm, late_rank, delay_s, kind):
    """While this rank's call waits for a late peer, another thread takes the
    only other reference to the tensor, tries to resize it (numpy) and drops
    it. Returns (what happened, the call's delivered fraction, exact)."""
    import threading
    import weakref

    count = 4096
    make = (lambda: np.full(count, support.rank_fill(comm.rank), dtype=np.float32)) if kind == "numpy" else \
        (lambda: torch.full((count,), float(support.rank_fill(comm.rank))))
    expected = support.rank_fill_sum(comm.world_size)
    if comm.rank == late_rank:
        time.sleep(delay_s)
        tensor = make()
        stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0)
        return None, stats.delivered_fraction, bool(np.all(np.asarray(tensor) == expected))
    holder = {"tensor": make()}
    alive = weakref.ref(holder["tensor"])
    outcome = {}

    def meddle():
        time.sleep(delay_s / 3)
        tensor = holder.pop("tensor")
        if kind == "numpy":
            try:
                tensor.resize(64 * count)
                outcome["resize"] = "done"
            except ValueError:
                outcome["resize"] = "refused"
        else:  # what a training loop does to a parameter: give it other storage
            tensor.data = torch.zeros(count)
        del tensor
        outcome["alive_after_drop"] = alive() is not None

    meddler = threading.Thread(target=meddle)
    meddler.start()
    try:
        stats = comm.allreduce(holder["tensor"], loss_budget=0.0, deadline=10.0)
        outcome["raised"] = None
    except RuntimeError as error:
        outcome["raised"] = str(error)
    meddler.join()
    return outcome, None, None


def autograd_sees_in_place_collective(comm, collective):
    """A tensor autograd saved for backward is changed by a collective in place:
    backward must refuse, as it does after any in-place torch op. Returns
    (version before, version after, backward's error or None)."""
    count = 64
    weight = torch.ones(count, requires_grad=True)
    tensor = torch.full((count,), float(comm.rank + 1))
    loss = (weight * tensor).sum()  # saves `tensor` for the gradient of weight
    before = tensor._version
    if collective == "allreduce":
        comm.allreduce(tensor, loss_budget=0.0, deadline=10.0)
    else:
        comm.broadcast(tensor, 0, loss_budget=0.0, deadline=10.0)
    after = tensor._version
    try:
        loss.backward()
        return before, after, None
    except RuntimeError as error:
        return before, after, str(error)


def alone_allreduce_sent(comm, count, deadline, algorithm):
    """Allreduce on this rank only (its peers are not in the call): the call
    fails with PeerTimeout; returns how many datagrams it sent besides the
    verdict round's and the JOIN requests asking whether the peer is alive,
    and how often a credit limit stopped it."""
    tensor = np.ones(count, dtype=np.float32)
    try:
        comm.allreduce(tensor, loss_budget=0.0, deadline=deadline, algorithm=algorithm)
    except ud_transport.PeerTimeout as error:
        stats = error.stats
        return stats.datagrams_sent - stats.agree_messages_sent - stats.join_messages_sent, stats.credit_stalls
    raise AssertionError("the call succeeded without its peer")


def call_dependent_allreduce(comm, count, call, algorithm=None):
    """Inputs that differ from call to call (rank_fill + 1000 * call), so a datagram of an earlier
    call admitted into this one would change the result. Returns (exact?, stats)."""
    tensor = np.full(count, support.rank_fill(comm.rank) + 1000 * call, dtype=np.float32)
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0, algorithm=algorithm)
    expected = support.rank_fill_sum(comm.world_size) + 1000 * call * comm.world_size
    return bool(np.all(tensor == expected)), stats



def two_threads_on_one_communicator(comm, count, calls):
    """Two threads of this rank call allreduce on the same communicator at once, `calls` each;
    thread t's input is (rank + 1) * (t + 1) everywhere. Returns {sequence: (thread, the
    result's distinct values)} for every call this rank made."""
    import threading

    outcomes, start = {}, threading.Barrier(2)

    def run(thread):
        start.wait()
        for _ in range(calls):
            tensor = np.full(count, (comm.rank + 1) * (thread + 1), dtype=np.float32)
            stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0)
            outcomes[stats.sequence] = (thread, sorted(set(tensor.tolist())))

    threads = [threading.Thread(target=run, args=(t,)) for t in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def default_algorithm(comm):
    """The schedule a call with default options runs on this communicator."""
    return comm.allreduce(np.ones(comm.world_size, dtype=np.float32), loss_budget=0.0).algorithm


def chunk_masks_under_loss(comm, count, calls):
    """Direct reduce_scatter (zero fill) and all_gather with chunk masks, `calls` times: per call
    (reduce mask, shard, all_gather mask, gathered output, the output before, chunks_lost,
    chunks_stale). Inputs: rank r gives (r + 1) * (1 + element index % 5)."""
    base = (np.arange(count) % 5 + 1).astype(np.float32)
    start, stop = comm.shard_range(count)
    outcomes = []
    for call in range(calls):
        tensor = base * (comm.rank + 1)
        shard = np.zeros(stop - start, dtype=np.float32)
        reduce_mask = comm.chunk_mask("reduce_scatter", tensor, algorithm="direct")
        reduced = comm.reduce_scatter(tensor, shard, loss_budget=1.0, algorithm="direct", estimator="zero_fill",
                                      chunk_mask=reduce_mask)
        before = np.full(count, -1.0 - call, dtype=np.float32)
        output = before.copy()
        gather_mask = comm.chunk_mask("all_gather", output, algorithm="direct")
        gathered = comm.all_gather(shard, output, loss_budget=1.0, algorithm="direct", chunk_mask=gather_mask)
        outcomes.append((reduce_mask, shard, gather_mask, output, before, reduced.chunks_lost, gathered.chunks_stale))
    return outcomes


def broadcast_masks_under_loss(comm, count, calls, src):
    """Broadcasts from `src` with chunk masks, `calls` times: per call (mask, what the tensor holds
    after, what it held before)."""
    outcomes = []
    for call in range(calls):
        before = np.full(count, -1.0 - call - comm.rank, dtype=np.float32)
        tensor = (np.arange(count) % 5 + 1).astype(np.float32) if comm.rank == src else before.copy()
        mask = comm.chunk_mask("broadcast", tensor)
        comm.broadcast(tensor, src, loss_budget=1.0, chunk_mask=mask)
        outcomes.append((mask, tensor, before))
    return outcomes


def chunk_layout(comm, count):
    """(this rank's shard's chunk ranges, every chunk's range) of a float32 tensor of `count`."""
    return comm.chunk_ranges(count, "float32", block=comm.rank), comm.chunk_ranges(count, "float32")


def calls_with_copies(comm, collective, count, calls, copies, algorithm, deadline=10.0):
    """`calls` collectives of integer-valued inputs, each datagram sent `copies` times; per call
    (what the call left in its output as float64, the exact answer, stats)."""
    rows = []
    for call in range(calls):
        values = [(np.arange(count) % 7 + rank + call).astype(np.float32) for rank in range(comm.world_size)]
        mine = values[comm.rank]
        start, stop = comm.shard_range(count)
        common = dict(loss_budget=1.0, deadline=deadline, algorithm=algorithm, copies=copies)
        if collective == "allreduce":
            output, want = mine.copy(), sum(values)
            stats = comm.allreduce(output, **common)
        elif collective == "reduce_scatter":
            output, want = np.zeros(stop - start, dtype=np.float32), sum(values)[start:stop]
            stats = comm.reduce_scatter(mine, output, **common)
        elif collective == "all_gather":
            want = np.concatenate([values[r][slice(*comm.shard_range(count, r))] for r in range(comm.world_size)])
            output = np.full(count, -1.0, dtype=np.float32)
            stats = comm.all_gather(mine[start:stop].copy(), output, **common)
        else:
            output, want = mine.copy(), values[0]
            stats = comm.broadcast(output, 0, **common)
        rows.append((output.astype(np.float64), want.astype(np.float64), stats))
    return rows


def system_calls_of_a_large_then_a_small_call(comm, large_count, small_count):
    """Allreduce `large_count` float32, then `small_count`: the transport's description and each
    call's (datagrams sent, send_calls, receive_calls, datagrams received)."""
    out = []
    for count in (large_count, small_count):
        stats = comm.allreduce(np.ones(count, dtype=np.float32), loss_budget=0.0)
        out.append((stats.datagrams_sent, stats.send_calls, stats.receive_calls, stats.datagrams_received))
    return comm.transport_description, out


def sequence_steps(comm):
    """How Communicator.sequence moves: per step, the calls made and the sequence after."""
    start = comm.sequence
    steps = []
    comm.agree(0, deadline=5.0)
    steps.append(comm.sequence - start)
    comm.allreduce(np.ones(1000, dtype=np.float32), loss_budget=0.0, deadline=5.0)
    steps.append(comm.sequence - start)
    try:  # refused in Python, before the engine: no call
        comm.all_to_all(np.zeros(comm.world_size + 1, dtype=np.float32), np.zeros(comm.world_size + 1, dtype=np.float32))
    except ValueError:
        pass
    steps.append(comm.sequence - start)
    try:  # a call that fails on every rank (another size on each) still counts
        comm.allreduce(np.ones(10 + comm.rank, dtype=np.float32), loss_budget=0.0, deadline=1.0)
    except ud_transport.LayoutMismatch:
        pass
    steps.append(comm.sequence - start)
    return steps


def allreduce_on_miss(comm, count, loss_budget, on_miss, deadline):
    """A float32 allreduce with `on_miss` (the same or not on every rank, per rank if a list):
    (outcome type name, stats.budget_missed, whether the tensor kept its values)."""
    mode = on_miss[comm.rank] if isinstance(on_miss, list) else on_miss
    tensor = np.full(count, comm.rank + 1.0, dtype=np.float32)
    before = tensor.copy()
    try:
        stats = comm.allreduce(tensor, loss_budget=loss_budget, deadline=deadline, on_miss=mode)
        return "OK", stats.budget_missed, bool(np.array_equal(tensor, before))
    except ud_transport.TransportError as error:
        stats = getattr(error, "stats", None)
        return type(error).__name__, stats.budget_missed if stats else None, bool(np.array_equal(tensor, before))


def exact_calls_between_store_barriers(comm, calls):
    """`calls` exact int32 allreduces of 4 KiB, each after a barrier through the store (so that no
    rank's next call starts before every rank has returned: a rank's next call cannot stand in
    for a lost acknowledgement). Returns (acknowledgements presumed, calls whose sum was wrong)."""
    from ud_transport import exact

    tensor = torch.empty(1024, dtype=torch.int32)
    presumed = wrong = 0
    for call in range(calls):
        tensor.fill_(comm.rank + 1)
        comm.store.set(f"apart/{call}/{comm.rank}", b"1")
        comm.store.wait([f"apart/{call}/{r}" for r in range(comm.world_size)])
        presumed += sum(stats.verdict_acks_presumed for stats in exact.allreduce(comm, tensor))
        wrong += not bool(torch.all(tensor == comm.world_size * (comm.world_size + 1) // 2))
    return presumed, wrong


def gso_counts_of_a_broadcast_in_copies(comm, count, copies):
    """A broadcast of `count` float32 from rank 0 sent `copies` times: this rank's UDP transport's
    (GSO messages, datagrams in them) during the call."""
    before = comm.udp_counters()
    comm.broadcast(np.full(count, 1.0 + comm.rank, dtype=np.float32), 0, loss_budget=0.0, copies=copies)
    after = comm.udp_counters()
    return tuple(after[name] - before[name] for name in ("send_gso_messages", "send_gso_datagrams"))
