"""Rank functions for tests/test_exact_faults.py: an exact allreduce whose repair round is cut
short on one rank, by its death (SIGKILL) or by abort() (Communicator.interrupt)."""
import os
import signal
import threading
import time

import ud_transport
from ud_transport import exact


def _when_repair_starts(action, delay_s):
    """Run `action` on a thread `delay_s` after this rank's exact layer starts its first repair
    round (the first call came back incomplete: a mask exchange and a repair call follow), of an
    all-gather or (the sharded allreduce's first half) of an all_to_all."""
    originals = {name: getattr(exact, name) for name in ("_repair", "_repair_pieces")}

    def hooked(name):
        def repair(*arguments, **keywords):
            threading.Timer(delay_s, action).start()
            for other, original in originals.items():
                setattr(exact, other, original)
            return originals[name](*arguments, **keywords)
        return repair

    for name in originals:
        setattr(exact, name, hooked(name))


def exact_allreduce_cut_short(comm, count, victim, how, deadline):
    """An exact int32 allreduce; on `victim` the repair round is cut short (`how`: "kill" or
    "interrupt"). Returns (error class name, blamed rank, tensor unchanged?, seconds, message)."""
    import torch

    tensor = torch.arange(count, dtype=torch.int32) * (comm.rank + 1)
    original = tensor.clone()
    if comm.rank == victim:
        action = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if how == "kill" else comm.interrupt
        _when_repair_starts(action, 0.002)
    start = time.monotonic()
    try:
        exact.allreduce(comm, tensor, deadline=deadline)
        return "OK", None, bool(torch.equal(tensor, original)), time.monotonic() - start, ""
    except ud_transport.TransportError as error:
        return (type(error).__name__, getattr(error, "rank", None), bool(torch.equal(tensor, original)),
                time.monotonic() - start, str(error))


def allreduce_of_another_size(comm, deadline):
    """A lossy allreduce whose element count differs on rank 0 (4096 there, 8192 elsewhere): both
    move data, so the layouts differ in JOIN and data alike. (error class, blamed rank, seconds)."""
    import numpy as np

    tensor = np.ones(4096 if comm.rank == 0 else 8192, dtype=np.float32)
    start = time.monotonic()
    try:
        comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
        return "OK", None, time.monotonic() - start
    except ud_transport.TransportError as error:
        return type(error).__name__, getattr(error, "rank", None), time.monotonic() - start
