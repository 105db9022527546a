"""The "ud" group's worker thread (ud_transport.torch._worker.SerialWorker): calls run in the
order they were submitted, one at a time whichever thread runs them; a small synchronous call
is run by the thread that waits for it (no hand-over to the worker and back), or by its caller
before submit returns (now), only when nothing is queued before it; an asynchronous call, or a
wait with a timeout, leaves it to the worker. No network: run() is plain Python."""
import threading

import pytest

torch = pytest.importorskip("torch")

from ud_transport.torch._worker import SerialWorker  # noqa: E402


@pytest.fixture
def worker():
    made = SerialWorker("test-worker")
    yield made
    made.close()


def test_a_waited_call_with_nothing_before_it_runs_on_the_waiting_thread():
    worker = SerialWorker("test-take")
    try:
        release = threading.Event()
        where = []
        blocker = worker.submit(release.wait, None)  # keeps the worker busy until released
        # queued behind the blocker: a waiter must not take it (it would run before the blocker ends)
        second = worker.submit(lambda: where.append(("second", threading.current_thread().name)), None, inline=True)
        waiter = threading.Thread(target=second.wait, name="waiter")
        waiter.start()
        waiter.join(0.2)
        assert where == [] and waiter.is_alive(), "the call ran before the one queued ahead of it"
        release.set()
        waiter.join(5)
        blocker.wait()
        assert where == [("second", "test-take")], where  # the worker ran it, in order
        # nothing pending: a call waited on at once is run by the waiting thread itself
        third = worker.submit(lambda: where.append(("third", threading.current_thread().name)), None, inline=True)
        third.wait()
        assert where[-1][0] == "third", where  # it ran before wait() returned, on one thread or the other
        taken = sum(1 for _ in range(50) if _run_and_say_where(worker, inline=True) == threading.current_thread().name)
        assert taken > 0, "no synchronous call was ever run by its waiter"
        assert all(_run_and_say_where(worker, inline=False) == "test-take" for _ in range(20))
    finally:
        worker.close()


def test_a_wait_with_a_timeout_and_errors_and_no_grad():
    worker = SerialWorker("test-timeout")
    try:
        release = threading.Event()
        slow = worker.submit(release.wait, None, inline=True)
        with pytest.raises(TimeoutError):
            slow.wait(0.05)  # a wait with a timeout never runs the call on its own thread
        release.set()
        assert slow.wait() is True

        def fails():
            raise ValueError("refused")
        failing = worker.submit(fails, None, inline=True)
        with pytest.raises(ValueError, match="refused"):
            failing.wait()
        parameter = torch.nn.Parameter(torch.zeros(2))
        # in place on a leaf that requires grad: allowed only without grad mode, on either thread
        written = worker.submit(lambda: parameter.add_(1), None, inline=True)
        written.wait()
        assert torch.equal(parameter.detach(), torch.ones(2))
    finally:
        worker.close()


def _run_and_say_where(worker, inline):
    where = []
    worker.submit(lambda: where.append(threading.current_thread().name), None, inline=inline).wait()
    return where[0]


def test_a_call_made_now_runs_on_the_calling_thread_before_submit_returns(worker):
    where = []
    work = worker.submit(lambda: where.append(threading.current_thread().name), ["result"], now=True)
    assert where == [threading.current_thread().name] and work.is_completed() and work.is_success()
    assert work.wait() is True
    assert work.get_future().value() == ["result"]  # asked for after the call ended

    def fails():
        raise ValueError("refused now")
    failing = worker.submit(fails, None, now=True)
    assert failing.is_completed() and not failing.is_success()
    with pytest.raises(ValueError, match="refused now"):
        failing.wait()
    with pytest.raises(RuntimeError, match="refused now"):
        failing.get_future().wait()


def test_a_call_made_now_behind_a_pending_one_waits_its_turn_on_the_worker(worker):
    release = threading.Event()
    order = []
    blocker = worker.submit(lambda: (release.wait(), order.append("blocker")), None)
    queued = worker.submit(lambda: order.append(("queued", threading.current_thread().name)), None, now=True)
    assert not queued.is_completed(), "a call made now ran before the one pending ahead of it"
    release.set()
    queued.wait()
    blocker.wait()
    assert order[0] == "blocker" and order[1][0] == "queued", order


def test_the_worker_does_not_start_the_next_call_while_a_caller_runs_one(worker):
    """A call run on its caller's thread (now) and one submitted meanwhile from another thread:
    the worker starts the second only after the first ended, as the group's order requires."""
    inside, release = threading.Event(), threading.Event()
    order = []

    def first():
        inside.set()
        release.wait()
        order.append("first")
    caller = threading.Thread(target=lambda: worker.submit(first, None, now=True), name="caller")
    caller.start()
    assert inside.wait(5)
    second = worker.submit(lambda: order.append("second"), None)
    threading.Event().wait(0.2)  # time for the worker to take the second call, were it free to
    assert order == [], "the worker ran the next call while the caller's was still running"
    release.set()
    caller.join(5)
    second.wait()
    assert order == ["first", "second"], order


def test_a_future_asked_for_before_the_call_ends_gets_its_value_or_its_error(worker):
    release = threading.Event()
    work = worker.submit(release.wait, ["value"])
    future = work.get_future()
    assert not future.done()
    release.set()
    assert future.wait() == ["value"]

    def fails():
        release.wait()
        raise ValueError("late error")
    release.clear()
    failing = worker.submit(fails, None)
    future = failing.get_future()
    release.set()
    with pytest.raises(RuntimeError, match="late error"):
        future.wait()
