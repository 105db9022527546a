"""Rank tasks of tests/test_stripes.py (run inside LocalCluster ranks)."""
import numpy as np
import torch

import ud_transport
from support import expected_allreduce, rank_values


def striped_results(comm, count, dtype, broadcast_count):
    """An allreduce of `count` rank_values of `dtype` and a broadcast of `broadcast_count` float32:
    (stripes, chunks, delivered, allreduce error, broadcast stripes, broadcast error)."""
    if dtype == "bfloat16":
        tensor = torch.from_numpy(rank_values(comm.rank, count, "float32")).to(torch.bfloat16)
        stats = comm.allreduce(tensor, loss_budget=0.0)
        error = float(np.abs(tensor.float().numpy() - expected_allreduce(comm.world_size, count)).max())
    else:
        tensor = rank_values(comm.rank, count, dtype)
        stats = comm.allreduce(tensor, loss_budget=0.0)
        error = float(np.abs(tensor.astype(np.float64) - expected_allreduce(comm.world_size, count)).max())
    weights = rank_values(comm.rank, broadcast_count, "float32") + comm.rank * 1000
    sent = comm.broadcast(weights, src=comm.world_size - 1, loss_budget=0.0)
    broadcast_error = float(np.abs(weights - (rank_values(comm.world_size - 1, broadcast_count, "float32")
                                             + (comm.world_size - 1) * 1000)).max())
    return stats.stripes, stats.chunks_total, stats.delivered_fraction, error, sent.stripes, broadcast_error


def unstriped_collectives(comm, count):
    """stats.stripes of calls that run on one stripe: small, reduce_scatter, all_gather."""
    small = comm.allreduce(np.ones(1024, dtype=np.float32), loss_budget=0.0)
    tensor = np.ones(count, dtype=np.float32)
    start, stop = comm.shard_range(count)
    shard = np.empty(stop - start, dtype=np.float32)
    scattered = comm.reduce_scatter(tensor, shard, loss_budget=0.0)
    output = np.zeros(count, dtype=np.float32)
    gathered = comm.all_gather(np.full(stop - start, comm.rank, dtype=np.float32), output, loss_budget=0.0)
    right = bool((shard == comm.world_size).all()) and all(
        (output[slice(*comm.shard_range(count, r))] == r).all() for r in range(comm.world_size))
    return small.stripes, scattered.stripes, gathered.stripes, right


def lossy_agreed_stats(comm, calls, count):
    """Per call, the stats every rank must agree on, under injected loss."""
    agreed = []
    for call in range(calls):
        tensor = np.random.default_rng([call, comm.rank]).standard_normal(count).astype(np.float32)
        stats = comm.allreduce(tensor, loss_budget=1.0)
        agreed.append((stats.stripes, round(stats.reduce_fraction, 12), round(stats.gather_fraction, 12),
                       stats.stripes_vetoed, bool(np.isfinite(tensor).all()), stats.chunks_lost, stats.injected_drops))
    return agreed


def put_back_when_a_stripe_fails(comm, calls, count):
    """Exact calls under loss: per call the outcome, the stripes vetoed, and whether a failed
    call left the tensor exactly as it was given."""
    outcomes = []
    for call in range(calls):
        original = np.random.default_rng([call, comm.rank]).standard_normal(count).astype(np.float32)
        tensor = original.copy()
        try:
            stats = comm.allreduce(tensor, loss_budget=0.0)
            outcomes.append(("ok", stats.stripes_vetoed, True))
        except ud_transport.LossBudgetExceeded as error:
            outcomes.append(("loss", error.stats.stripes_vetoed, bool((tensor == original).all())))
    return outcomes


def mismatch_then_matching(comm, count):
    """Calls where rank 0, then rank 1, strips and the other does not, each followed by a call
    alike on every rank: per call "mismatch", "exact" or what went wrong."""
    outcomes = []
    for striping_rank in (0, 1):
        size = count if comm.rank == striping_rank else 1024
        try:
            comm.allreduce(np.ones(size, dtype=np.float32), loss_budget=0.0)
            outcomes.append("no error")
        except ud_transport.LayoutMismatch:
            outcomes.append("mismatch")
        except ud_transport.TransportError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
        tensor = rank_values(comm.rank, count, "float32")
        stats = comm.allreduce(tensor, loss_budget=0.0)
        exact = stats.stripes == 2 and np.array_equal(tensor.astype(np.float64), expected_allreduce(comm.world_size, count))
        outcomes.append("exact" if exact else f"wrong (stripes {stats.stripes})")
    return outcomes
