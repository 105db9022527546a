"""Rank functions for tests/test_signals.py: a call on the main thread waiting for a peer that
is late, while a signal comes."""
import os
import signal
import threading
import time

import numpy as np


def interrupted_by_ctrl_c(comm, late_s):
    """Rank 0 all-reduces while rank 1 stays away for late_s; SIGINT reaches rank 0 0.3 s into
    its call. Returns (what rank 0's call raised, seconds from the signal to the raise, whether
    its tensor kept its values)."""
    if comm.rank != 0:
        time.sleep(late_s)
        return None
    return _all_reduce_under_ctrl_c(comm, 1000, late_s)


def _all_reduce_under_ctrl_c(comm, elements, late_s):
    """(what an all-reduce raised when SIGINT came 0.3 s into it, seconds from the signal to the
    raise, whether the tensor kept its values)."""
    tensor = np.arange(elements, dtype=np.float32)
    kept = tensor.copy()
    sent = []

    def ctrl_c():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
    threading.Timer(0.3, ctrl_c).start()
    try:
        comm.allreduce(tensor, loss_budget=0.1, deadline=late_s * 4)
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    ended = time.monotonic()
    return raised, ended - sent[0], bool(np.array_equal(tensor, kept))


def handler_runs_during_the_call(comm, late_s):
    """Rank 0's call waits late_s for rank 1; a SIGUSR1 handler that does not raise must run
    while the call waits, and the call must end as every call does. Returns (the sum is right,
    seconds from the signal to its handler, seconds from the handler to the call's end)."""
    tensor = np.ones(1000, dtype=np.float32)
    if comm.rank != 0:
        time.sleep(late_s)
        comm.allreduce(tensor, loss_budget=0.0)
        return None
    handled, sent = [], []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: handled.append(time.monotonic()))

    def poke():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGUSR1)
    threading.Timer(0.3, poke).start()
    try:
        comm.allreduce(tensor, loss_budget=0.0)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    ended = time.monotonic()
    return bool(np.all(tensor == comm.world_size)), handled[0] - sent[0], ended - handled[0]


def striped_interrupted_by_ctrl_c(comm, late_s, elements):
    """As interrupted_by_ctrl_c, for a call run as stripes (stripe 0 on the main thread, the
    others on threads of their own): both ranks all-reduce `elements` once (its stats say how
    many stripes ran), then rank 1 stays away for late_s while SIGINT reaches rank 0 0.3 s into
    its second call. Returns (stripes of the first call, what the second raised, seconds from the
    signal to the raise, whether the tensor kept its values); rank 1 returns the stripes only."""
    tensor = np.ones(elements, dtype=np.float32)
    stripes = comm.allreduce(tensor, loss_budget=0.1).stripes
    if comm.rank != 0:
        time.sleep(late_s)
        return stripes
    return (stripes, *_all_reduce_under_ctrl_c(comm, elements, late_s))


def handler_closes_the_communicator(comm, late_s):
    """Rank 0's call waits late_s for rank 1; a SIGTERM handler runs the interrupt() docstring's
    `comm.interrupt(); comm.close()` inside that call (the call holds the communicator's lock).
    Returns (what the call raised, seconds from the signal to the raise, whether the communicator
    is closed after it)."""
    import ud_transport

    if comm.rank != 0:
        time.sleep(late_s)
        return None
    sent = []

    def stop(signum, frame):
        comm.interrupt()
        comm.close()
    previous = signal.signal(signal.SIGTERM, stop)

    def terminate():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Timer(0.3, terminate).start()
    try:
        comm.allreduce(np.ones(1000, dtype=np.float32), loss_budget=0.1, deadline=late_s * 4)
        raised = None
    except ud_transport.TransportError as error:
        raised = str(error)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return raised, time.monotonic() - sent[0], comm.closed
