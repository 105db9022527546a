"""Functions the tests run on every rank: task(comm, *args). Expected values
are computed from rank and world size, so any world size works."""
import time

import numpy as np
import torch

import ud_transport


def rank_values(rank, count, dtype, integer_valued=True):
    """Deterministic per-rank input. Integer-valued data sums exactly in every dtype."""
    base = np.arange(count, dtype=np.int64)
    values = (base * 7 + rank * 3) % 11 - 5 if integer_valued else np.sin(base + rank) * (rank + 1)
    if dtype == "bfloat16":
        return torch.tensor(values, dtype=torch.bfloat16)
    return values.astype(dtype)


def allreduce_values(comm, count, dtype, op, integer_valued=True, loss_budget=0.0, deadline=10.0):
    tensor = rank_values(comm.rank, count, dtype, integer_valued)
    stats = comm.allreduce(tensor, op=op, loss_budget=loss_budget, deadline=deadline)
    result = tensor.float().numpy() if isinstance(tensor, torch.Tensor) else tensor
    return result, stats


def allreduce_torch(comm, count, dtype_name):
    tensor = torch.arange(count, dtype=getattr(torch, dtype_name)) + comm.rank
    stats = comm.allreduce(tensor)
    return tensor.double().numpy(), stats


def repeated_trials(comm, inputs_per_rank, trials, loss_budget, estimator, fresh_seed=None, algorithm=None):
    """Run `trials` allreduces. With fresh_seed, inputs are drawn anew each trial
    (exchangeable across ranks, like gradients); otherwise they are fixed."""
    results, inputs, fractions = [], [], []
    for trial in range(trials):
        if fresh_seed is None:
            values = inputs_per_rank[comm.rank].copy()
        else:
            values = np.random.default_rng([fresh_seed, trial, comm.rank]).normal(1.0, 1.0, inputs_per_rank).astype(np.float64)
        inputs.append(values.copy())
        stats = comm.allreduce(values, loss_budget=loss_budget, deadline=10.0, estimator=estimator, algorithm=algorithm)
        results.append(values)
        fractions.append(stats.delivered_fraction)
    return np.array(results), np.array(inputs), np.array(fractions)


def many_large(comm, count, calls):
    tensor = np.full(count, comm.rank + 1, dtype=np.float32)
    fractions, lost = [], 0
    expected = comm.world_size * (comm.world_size + 1) / 2
    exact = True
    for _ in range(calls):
        tensor.fill(comm.rank + 1)
        stats = comm.allreduce(tensor, loss_budget=0.0, deadline=60.0)
        fractions.append(stats.delivered_fraction)
        lost += stats.chunks_lost
        exact = exact and bool(np.all(tensor == expected))
    return fractions, lost, exact


def allreduce_catching(comm, count, loss_budget, deadline):
    """Returns (input unchanged?, exception or None, elapsed seconds)."""
    tensor = np.arange(count, dtype=np.float32) + comm.rank
    original = tensor.copy()
    start = time.monotonic()
    try:
        comm.allreduce(tensor, loss_budget=loss_budget, deadline=deadline)
        error = None
    except ud_transport.TransportError as caught:
        error = caught
    return bool(np.array_equal(tensor, original)), error, time.monotonic() - start


def stall(comm, seconds):
    """Be a rank that stops answering: sleep instead of joining the collective."""
    time.sleep(seconds)
    return None


def address_of(comm):
    return comm.address, comm.chunk_bytes


def stats_after_allreduce(comm, count, deadline):
    tensor = np.full(count, comm.rank + 1, dtype=np.float32)
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
    return tensor, stats


def session_of(comm, prefix):
    return int(bytes(comm.store.get(f"{prefix}/session")).decode(), 16)


def late_allreduce(comm, late_rank, delay_s, deadline):
    """One rank joins late; everyone else is already waiting."""
    if comm.rank == late_rank:
        time.sleep(delay_s)
    tensor = np.full(1000, comm.rank + 1, dtype=np.float32)
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
    return bool(np.all(tensor == comm.world_size * (comm.world_size + 1) / 2)), stats.delivered_fraction


def mismatched_allreduce(comm, deadline):
    """Every rank calls with a different element count: a caller's bug."""
    tensor = np.ones(100 + 10 * comm.rank, dtype=np.float32)
    try:
        comm.allreduce(tensor, loss_budget=1.0, deadline=deadline)
        error = None
    except ud_transport.TransportError as caught:
        error = caught
    return error, bool(np.all(tensor == 1))
