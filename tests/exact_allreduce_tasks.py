"""Rank functions for tests/test_exact_allreduce.py: the exact allreduce in both forms."""
import numpy as np
import torch

from ud_transport import exact

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int32": torch.int32, "uint8": torch.uint8}


def inputs(rank, count, dtype, seed=7):
    """Rank `rank`'s input: non-integer floats (the sum's rounding depends on its order) or integers."""
    generator = np.random.default_rng(seed * 1000 + rank)
    if dtype in ("int64", "int32", "uint8"):
        values = generator.integers(0, 50, count)
        return torch.from_numpy(values).to(DTYPES[dtype])
    return torch.from_numpy(generator.standard_normal(count)).to(DTYPES[dtype])


def both_forms(comm, count, dtype, op):
    """The exact allreduce of the same inputs, sharded and gathered: (sharded bytes, gathered bytes),
    each rank's result as raw bytes (so NaN-free floats compare bit for bit)."""
    out = {}
    engine = (dtype, op) == ("int32", "sum") or dtype in ("float32", "float64") and op in ("sum", "mean")
    for form in ("sharded", "gathered") + (("engine",) if engine else ()):
        tensor = inputs(comm.rank, count, dtype)
        exact.allreduce(comm, tensor, op, deadline=20.0, form=form)
        out[form] = tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return out


def bytes_sent(comm, count, form, op="sum", dtype="int32"):
    """An exact int32 (or `dtype`) sum, mean or max of `count` elements in `form`: (data payload
    bytes this rank sent over every engine call, the tensor's bytes, the result is right, engine
    calls)."""
    tensor = torch.full((count,), comm.rank + 1, dtype=DTYPES[dtype])
    stats = exact.allreduce(comm, tensor, op, deadline=20.0, form=form)
    sent = sum(s.payload_bytes_sent for s in stats)
    n = comm.world_size
    right = bool(torch.all(tensor == {"sum": n * (n + 1) // 2, "mean": (n + 1) / 2, "max": n}[op]))
    return sent, tensor.nbytes, right, len(stats)


def collectives_of_calls(comm, count, calls):
    """`calls` exact int32 sums in a row: per call, the engine collectives it ran, and whether
    the result was right."""
    out = []
    for _ in range(calls):
        tensor = torch.arange(count, dtype=torch.int32) * (comm.rank + 1)
        stats = exact.allreduce(comm, tensor, "sum", deadline=20.0)
        n = comm.world_size
        right = bool(torch.equal(tensor, torch.arange(count, dtype=torch.int32) * (n * (n + 1) // 2)))
        out.append(([s.collective for s in stats], right))
    return out


def backoff_across_a_refusal(comm, count):
    """Under the cluster's loss (the engine's one-call int32 sum fails, so the next such call skips
    it): an int32 sum, then one refused on rank 0 alone (its op), then another int32 sum. What
    each ended in on this rank, and whether the last one's result is the sum."""
    from ud_transport import LayoutMismatch

    outcomes = []
    for index, op in enumerate(("sum", "bxor" if comm.rank == 0 else "sum", "sum")):
        tensor = torch.full((count,), comm.rank + 1 + index, dtype=torch.int32)
        try:
            exact.allreduce(comm, tensor, op)
            outcomes.append("ok" if bool((tensor == sum(r + 1 + index for r in range(comm.world_size))).all())
                            else "wrong")
        except (ValueError, LayoutMismatch) as error:
            outcomes.append(type(error).__name__)
    return outcomes


def in_rank_order(rank, world_size, count, dtype, op):
    """What an allreduce in rank order must give: rank 0's input plus rank 1's ... in float64,
    divided by world_size for a mean, rounded once (numpy, apart from the library's own code)."""
    total = inputs(0, count, dtype).double().numpy().copy()
    for r in range(1, world_size):
        total += inputs(r, count, dtype).double().numpy()
    if op == "mean":
        total /= world_size
    return total.astype(dtype).tobytes()


def engine_in_rank_order(comm, count, dtype, op):
    """One engine allreduce with reduce_in_rank_order (the algorithm left to it: direct): (this
    rank's result as bytes, in place?)."""
    tensor = inputs(comm.rank, count, dtype)
    stats = comm.allreduce(tensor, op=op, loss_budget=0.0, reduce_in_rank_order=True, deadline=20.0)
    return tensor.numpy().tobytes(), stats.in_place


def in_rank_order_under_loss(comm, count, dtype, op):
    """Under the cluster's injected loss: one engine allreduce in rank order, which fails (budget
    0), then exact.allreduce(form="engine"), which falls back to an exact form. (the first
    call's error, whether it ran in place, whether the tensor kept its input, the second's
    result as bytes)."""
    from ud_transport import LossBudgetExceeded

    tensor = inputs(comm.rank, count, dtype)
    try:
        stats = comm.allreduce(tensor, op=op, loss_budget=0.0, reduce_in_rank_order=True, deadline=20.0)
        error = None
    except LossBudgetExceeded as raised:
        stats, error = raised.stats, type(raised).__name__
    kept = tensor.numpy().tobytes() == inputs(comm.rank, count, dtype).numpy().tobytes()
    exact.allreduce(comm, tensor, op, deadline=20.0, form="engine")
    return error, stats.in_place, kept, tensor.numpy().tobytes()


def engine_as_it_arrives(comm, count, dtype, op):
    """The same engine allreduce without reduce_in_rank_order (each owner adds contributions in
    its own type as they arrive): this rank's result as bytes."""
    tensor = inputs(comm.rank, count, dtype)
    comm.allreduce(tensor, op=op, loss_budget=0.0, algorithm="direct", deadline=20.0)
    return tensor.numpy().tobytes()


def exact_auto(comm, count, dtype, op):
    """exact.allreduce in its "auto" form: (this rank's result as bytes, the engine collectives it ran)."""
    tensor = inputs(comm.rank, count, dtype)
    stats = exact.allreduce(comm, tensor, op, deadline=20.0)
    return tensor.numpy().tobytes(), [s.collective for s in stats]


def refused_in_rank_order(comm):
    """reduce_in_rank_order with what it cannot take: for each, the error's type and whether the
    tensor kept its values."""
    out = []
    for dtype, keywords in ((torch.float32, {"algorithm": "ring", "loss_budget": 0.0}),
                            (torch.float16, {"algorithm": "direct", "loss_budget": 0.0}),
                            (torch.int32, {"algorithm": "direct", "loss_budget": 0.0}),
                            (torch.float32, {"algorithm": "direct", "loss_budget": 0.1}),
                            (torch.float32, {"algorithm": "direct", "loss_budget": 0.0, "on_miss": "return"})):
        tensor = torch.arange(8).to(dtype)
        try:
            comm.allreduce(tensor, reduce_in_rank_order=True, **keywords)
            error = None
        except Exception as raised:  # noqa: BLE001 - the type is the answer
            error = type(raised).__name__
        out.append((error, bool(torch.equal(tensor, torch.arange(8).to(dtype)))))
    return out


def shard_in_rank_order(rank, world_size, count, dtype, op):
    """in_rank_order's result, only rank `rank`'s shard (the engine's block split) of it."""
    from ud_transport import _native

    start, stop = _native.block_start(count, world_size, rank), _native.block_start(count, world_size, rank + 1)
    return in_rank_order(rank, world_size, count, dtype, op)[start * DTYPES[dtype].itemsize:stop * DTYPES[dtype].itemsize]


def reduce_scatters(comm, count, dtype, op):
    """This rank's shard two ways: the engine's reduce_scatter in rank order, and
    exact.reduce_scatter (with the engine collectives it ran). (engine bytes, exact bytes, exact
    collectives)."""
    start, stop = comm.shard_range(count)
    source = inputs(comm.rank, count, dtype)
    engine = torch.full((stop - start,), -1.0, dtype=DTYPES[dtype])
    comm.reduce_scatter(source, engine, op=op, loss_budget=0.0, reduce_in_rank_order=True, deadline=20.0)
    shard = torch.full((stop - start,), -1.0, dtype=DTYPES[dtype])
    stats = exact.reduce_scatter(comm, source, shard, op, deadline=20.0)
    assert torch.equal(source, inputs(comm.rank, count, dtype)), "reduce_scatter changed its input"
    return engine.numpy().tobytes(), shard.numpy().tobytes(), [s.collective for s in stats]


def reduce_scatter_strided_and_int32(comm, count):
    """exact.reduce_scatter of a strided float32 input (every other element of a longer tensor)
    and of an int32 sum: (float32 shard bytes, its input unchanged, int32 shard bytes, the int32
    call's engine collectives)."""
    start, stop = comm.shard_range(count)
    wide = inputs(comm.rank, count, "float32").repeat_interleave(2)
    strided = wide[::2]
    shard = torch.empty(stop - start, dtype=torch.float32)
    exact.reduce_scatter(comm, strided, shard, "sum", deadline=20.0)
    kept = torch.equal(strided, inputs(comm.rank, count, "float32"))
    integers = torch.empty(stop - start, dtype=torch.int32)
    stats = exact.reduce_scatter(comm, inputs(comm.rank, count, "int32"), integers, "sum", deadline=20.0)
    return shard.numpy().tobytes(), kept, integers.numpy().tobytes(), [s.collective for s in stats]


def reduce_scatter_shards(comm, count, dtype, op, calls):
    """`calls` exact.reduce_scatter calls in a row: per call, this rank's shard as bytes and the
    engine collectives the call ran."""
    start, stop = comm.shard_range(count)
    out = []
    for _ in range(calls):
        shard = torch.empty(stop - start, dtype=DTYPES[dtype])
        stats = exact.reduce_scatter(comm, inputs(comm.rank, count, dtype), shard, op, deadline=20.0)
        out.append((shard.numpy().tobytes(), [s.collective for s in stats]))
    return out
