"""The "ud" group's worker thread (ud_transport.torch._worker.SerialWorker): calls run in the
order they were submitted; a small synchronous call is run by the thread that waits for it
(no hand-over to the worker and back) only when nothing is queued before it; an asynchronous
call, or a wait with a timeout, leaves it to the worker. No network: run() is plain Python."""
import threading

import pytest

torch = pytest.importorskip("torch")

from ud_transport.torch._worker import SerialWorker  # noqa: E402


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
