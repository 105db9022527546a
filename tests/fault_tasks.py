"""Rank functions for the fault tests: a rank that dies, pauses or comes late
in the middle of real calls. Each returns what the test asserts on."""
import os
import signal
import subprocess
import threading
import time

import numpy as np

import ud_transport
from support import rank_fill, rank_fill_sum


def filled(comm, count):
    return np.full(count, rank_fill(comm.rank), dtype=np.float32)


def sleep_through(comm, seconds):
    """Be a rank that does not come to the call."""
    time.sleep(seconds)


def die_during_allreduce(comm, count, join_after_s, die_after_s):
    """Come to an allreduce `join_after_s` late (the others are already in it),
    then SIGKILL this process `die_after_s` after entering it."""
    time.sleep(join_after_s)
    tensor = filled(comm, count)
    _after_entering(die_after_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).set()
    comm.allreduce(tensor, loss_budget=0.0, deadline=60.0)
    time.sleep(60)  # reached only if the call ended first; the test then sees no PeerTimeout


def allreduce_outcome(comm, count, deadline, entering=None):
    """(error or None, input unchanged?, seconds the call took); `entering` (an
    Event) is set right before the call."""
    tensor = filled(comm, count)
    if entering is not None:
        entering.set()
    start = time.monotonic()
    try:
        comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
        error = None
    except ud_transport.TransportError as caught:
        error = caught
    return error, bool(np.all(tensor == rank_fill(comm.rank))), time.monotonic() - start


def allreduce_outcome_one_late(comm, late_rank, late_s, count, deadline):
    """allreduce_outcome, with `late_rank` entering the call `late_s` after the others."""
    if comm.rank == late_rank:
        time.sleep(late_s)
    return allreduce_outcome(comm, count, deadline)


def clean_calls(comm, count, calls):
    """`calls` allreduces after a failed one: for each, (exact?, delivered fraction, silent_rank)."""
    outcomes = []
    for _ in range(calls):
        tensor = filled(comm, count)
        stats = comm.allreduce(tensor, loss_budget=0.0, deadline=10.0)
        outcomes.append((bool(np.all(tensor == rank_fill_sum(comm.world_size))), stats.delivered_fraction,
                         stats.silent_rank))
    return outcomes


def regroup_and_allreduce(comm, survivors, count):
    """The survivors close their communicator and form a new one without the
    dead rank, on the same store; returns whether its allreduce is exact."""
    comm.close()
    rank = survivors.index(comm.rank)
    with ud_transport.Communicator(rank, len(survivors), comm.store, "udp", comm.options, name="survivors") as regrouped:
        tensor = np.full(count, rank_fill(rank), dtype=np.float32)
        stats = regrouped.allreduce(tensor, loss_budget=0.0, deadline=10.0)
        return bool(np.all(tensor == rank_fill_sum(len(survivors)))), stats.delivered_fraction


def _after_entering(seconds, action):
    """Start a thread that runs `action` `seconds` after the returned event is set
    (set it right before entering the engine: the call releases the GIL)."""
    entered = threading.Event()

    def run():
        entered.wait()
        time.sleep(seconds)
        action()

    threading.Thread(target=run, daemon=True).start()
    return entered


def _pause_self(pause_s):
    """A function that stops this process for `pause_s`. The process cannot wake itself: a child,
    started now, sends SIGCONT pause_s after it is told to. Starting it when the pause is due
    instead (fork and exec, 100 ms and more on a busy 2-core machine) let a short call end
    before the stop, and the pause then missed the call it was meant for."""
    waker = subprocess.Popen(["sh", "-c", f"read go && sleep {pause_s} && kill -CONT {os.getpid()}"], stdin=subprocess.PIPE)

    def pause():
        waker.stdin.write(b"go\n")
        waker.stdin.flush()
        os.kill(os.getpid(), signal.SIGSTOP)

    return pause


def allreduce_with_a_pause(comm, paused_rank, count, join_after_s, pause_after_s, pause_s, deadline):
    """Every rank allreduces; `paused_rank` comes `join_after_s` last and is
    SIGSTOPped `pause_after_s` after entering the call, for `pause_s`.
    Returns (exact?, delivered fraction, elapsed, chunks lost)."""
    tensor = filled(comm, count)
    if comm.rank == paused_rank:
        time.sleep(join_after_s)
        _after_entering(pause_after_s, _pause_self(pause_s)).set()
    stats = comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
    return bool(np.all(tensor == rank_fill_sum(comm.world_size))), stats.delivered_fraction, stats.elapsed_s, stats.chunks_lost


def quick_calls_then_a_straggler(comm, late_rank, delay_s, count, quick_calls):
    """A few quick calls (the adaptive deadline learns they are fast), then
    `late_rank` comes `delay_s` late to the next one, then one more call.
    Uses the default deadline. Returns per call (exact?, delivered, join_wait_s, deadline_s)."""
    outcomes = []
    for call in range(quick_calls + 2):
        if call == quick_calls and comm.rank == late_rank:
            time.sleep(delay_s)
        tensor = filled(comm, count)
        stats = comm.allreduce(tensor, loss_budget=0.0)
        outcomes.append((bool(np.all(tensor == rank_fill_sum(comm.world_size))), stats.delivered_fraction,
                         stats.join_wait_s, stats.deadline_s))
    return outcomes


def allreduce_outcome_with_a_pause(comm, paused_rank, count, join_after_s, pause_after_s, pause_s, deadline):
    """allreduce_outcome, with `paused_rank` coming `join_after_s` last and
    SIGSTOPped about `pause_after_s` into the call, for `pause_s`."""
    entering = None
    if comm.rank == paused_rank:
        time.sleep(join_after_s)
        entering = _after_entering(pause_after_s, _pause_self(pause_s))
    return allreduce_outcome(comm, count, deadline, entering)


def lossy_allreduce_with_a_pause(comm, paused_rank, count, pause_after_s, pause_s, deadline):
    """Every rank allreduces with loss allowed; `paused_rank` is SIGSTOPped `pause_after_s`
    after entering the call, for `pause_s`. Returns (status ok?, chunks lost, datagrams the
    injected loss dropped at this rank, elapsed, steps closed on the sender's answer)."""
    tensor = filled(comm, count)
    if comm.rank == paused_rank:
        _after_entering(pause_after_s, _pause_self(pause_s)).set()
    stats = comm.allreduce(tensor, loss_budget=1.0, deadline=deadline)
    return True, stats.chunks_lost, stats.injected_drops, stats.elapsed_s, stats.steps_answered
