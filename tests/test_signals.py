"""A call on the main thread runs the process's signal handlers while it waits (every 100 ms:
UDT_WAIT_HOOK_INTERVAL_MS), as Python does between bytecodes: Ctrl-C ends a call that waits on a
late peer within a fraction of a second, the tensor as it was, and a handler that does not
raise runs without ending the call. (A "ud" group runs small synchronous calls on the caller's
thread, often the main one.) Each test has ranks of its own: rank 0 leaves a call its peer never
makes, so the ranks are out of step after it."""
from ud_transport.lab.local_cluster import LocalCluster

import signal_tasks


def test_ctrl_c_ends_a_call_that_waits_for_a_late_peer_and_keeps_the_tensor():
    with LocalCluster(2) as cluster:
        outcome = cluster.run(signal_tasks.interrupted_by_ctrl_c, 5.0, timeout_s=60)[0]
    raised, after_signal_s, kept = outcome
    assert raised == "KeyboardInterrupt", outcome
    assert after_signal_s < 1.0, outcome  # a handler runs within one hook interval, not at the deadline
    assert kept, "the interrupted all-reduce changed its tensor"


def test_a_signal_handler_that_does_not_raise_runs_during_the_call_and_the_call_goes_on():
    with LocalCluster(2) as cluster:
        outcome = cluster.run(signal_tasks.handler_runs_during_the_call, 1.5, timeout_s=60)[0]
    summed, to_handler_s, handler_to_end_s = outcome
    assert summed, outcome
    assert to_handler_s < 0.5, outcome  # not held until the call ended
    assert handler_to_end_s > 0.3, outcome  # the call went on waiting for its peer after it


def test_ctrl_c_ends_a_striped_call_on_every_stripe():
    """Stripe 0 runs on the main thread and hears Ctrl-C; the other stripes, on threads of their
    own, end with it (as after a layout mismatch) instead of waiting out the deadline."""
    with LocalCluster(2, stripes=2) as cluster:
        outcome = cluster.run(signal_tasks.striped_interrupted_by_ctrl_c, 5.0, 1 << 20, timeout_s=60)[0]
    stripes, raised, after_signal_s, kept = outcome
    assert stripes == 2, f"the call ran as {stripes} stripes: the test needs it striped"
    assert raised == "KeyboardInterrupt", outcome
    assert after_signal_s < 1.0, outcome
    assert kept, "the interrupted all-reduce changed its tensor"


def test_a_handler_that_closes_the_communicator_ends_the_call_and_closes_it_after():
    """close() from a handler inside this thread's own call cannot take the lock the call holds:
    it interrupts the call and releases once the call has ended (it used to wait for the lock
    forever)."""
    with LocalCluster(2) as cluster:
        outcome = cluster.run(signal_tasks.handler_closes_the_communicator, 5.0, timeout_s=60)[0]
    raised, after_signal_s, closed = outcome
    assert raised is not None and "interrupted" in raised, outcome
    assert after_signal_s < 1.0 and closed, outcome
