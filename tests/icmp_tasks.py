"""Rank functions for tests/test_forged_icmp.py: calls whose outcome every rank reports, so the
test can check that all ranks reached the same verdict and, where OK, the same values."""
import hashlib
import time

import numpy as np

import ud_transport
from ud_transport import exact
from support import rank_fill


def identity(comm):
    return comm.address, comm.session_id


def counters(comm):
    return comm.udp_counters()


def _outcome(call):
    try:
        digest = call()
        return "OK", None, digest
    except ud_transport.TransportError as error:
        return type(error).__name__, getattr(error, "rank", None), str(error)


def lossy_allreduce(comm, count, budget):
    """A float allreduce with `budget`: (outcome, blamed rank, digest of the result or the message)."""
    def call():
        tensor = np.full(count, rank_fill(comm.rank), dtype=np.float32)
        comm.allreduce(tensor, loss_budget=budget, deadline=5.0)
        return hashlib.sha256(tensor.tobytes()).hexdigest()
    return _outcome(call)


def exact_allreduce(comm, count):
    """An exact int32 allreduce: (outcome, blamed rank, digest of the result or the message)."""
    import torch

    def call():
        tensor = torch.arange(count, dtype=torch.int32) * (comm.rank + 1)
        exact.allreduce(comm, tensor, deadline=20.0)
        return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    return _outcome(call)


def sequence_of_calls(comm, count, budget):
    """A lossy allreduce, an exact one and a lossy one with budget 1.0, in that order."""
    return [lossy_allreduce(comm, count, budget), exact_allreduce(comm, count), lossy_allreduce(comm, count, 1.0)]


def loop(comm, count, calls, budget):
    """`calls` rounds of an exact int32 allreduce and a lossy float one: the outcomes, and the
    seconds the loop took."""
    start = time.monotonic()
    outcomes = []
    for _ in range(calls):
        outcomes.append(exact_allreduce(comm, count))
        outcomes.append(lossy_allreduce(comm, count, budget))
    return outcomes, time.monotonic() - start
