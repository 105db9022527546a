"""One thread per communicator that runs its collectives in the order they
were issued, so callers (DDP's reducer, a comm hook) get a Work at once and
compute overlaps communication: the engine releases the GIL while it runs.
Every rank issues the same collectives in the same order, and this keeps it."""
import queue
import threading

import torch
import torch.distributed as dist

from ..errors import TransportError
from ..staging import on_twins


class Work(dist._Work):
    """A collective that runs (or ran) on the worker. wait() blocks until it
    is done and raises its error, if any; get_future() gives a Future whose
    value is `result` (what c10d expects, e.g. the list of tensors).

    `staged` (ud_transport.staging.Staged): the call's CUDA tensors went through host twins.
    Then, as for c10d's CUDA backends, wait() makes the caller's current stream wait for the
    copies back (the host waits only for the call), and the future is CUDA-aware: its value's
    events follow the copies back, so DDP's reducer reads the bucket after them."""

    def __init__(self, result, staged=None):
        super().__init__()
        self._result = result
        self._staged = staged if staged else None
        self._done = threading.Event()
        self._error = None
        self._claimed = False  # taken by the worker thread or a waiter (SerialWorker, under its lock)
        self._take = None      # run it on the waiting thread if nobody has yet (SerialWorker.submit)
        # get_future()'s Future is made when first asked for (a synchronous call never asks: making
        # it and its then() cost ~10 us, a tenth of a small call). It must fail the way C++ waiters
        # read (DDP's reducer waits on it in C++): Future.set_exception stores the exception as the
        # value, which the reducer read as tensors, and the process died (SIGSEGV) on a collective's
        # error. A then() callback that raises sets the Future's error; Python waiters get it as
        # RuntimeError with the message.
        self._future_lock = threading.Lock()
        self._ended = self._future = None
        if self._staged is not None:  # its events are recorded on the side stream as the call ends
            self._make_future()

    def _make_future(self):
        self._ended = torch.futures.Future(devices=[self._staged.device]) if self._staged else torch.futures.Future()
        self._future = self._ended.then(self._result_or_error)

    def _result_or_error(self, _ended):
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, error=None):
        self._error = error
        with self._future_lock:
            self._done.set()
            ended = self._ended
        if ended is not None:
            self._settle(ended)

    def _settle(self, ended):
        if self._staged is not None and self._error is None:
            with self._staged.on_side_stream():  # the value's events are recorded after the copies back
                ended.set_result(self._result)
        else:
            ended.set_result(None)

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if self._take is not None and not seconds and not self._done.is_set():  # a wait with a timeout only waits
            self._take()
        if not self._done.wait(seconds if seconds else None):
            raise TimeoutError("collective still running")
        if self._error is not None:
            raise self._error
        if self._staged is not None:
            self._staged.caller_waits()
        return True

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        with self._future_lock:
            settle = self._future is None and self._done.is_set()
            if self._future is None:
                self._make_future()
        if settle:  # it ended before anybody asked (its _finish found no future to settle)
            self._settle(self._ended)
        return self._future

    def result(self):
        self.wait()
        return self._result


class SerialWorker:
    def __init__(self, name):
        self._queue = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # a submit racing close() would queue behind the end
        self._pending = 0  # calls submitted and not yet finished, queued or running (under _closing)
        self._staged_pending = []  # the Staged of those calls (under _closing)
        # one call runs at a time, on whichever thread: the worker's next call waits for one
        # that a waiter or a synchronous caller is running (submit's inline and now)
        self._running = threading.Lock()
        self._running_thread = None  # the thread that holds _running
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run, result, inline=False, staged=None, now=False):
        """Queue run() (which may raise); returns a Work carrying `result`. After close() it
        raises TransportError: nothing would run the call, and its Work would never finish.

        inline: a thread that waits on the Work before the worker has taken the call, with
        nothing queued before it, runs it itself. A synchronous c10d call waits at once, so a
        small one is not handed to the worker thread and back (as much as ~0.5 ms on 2 cores,
        what the call itself takes); an asynchronous one still returns at once and runs on the
        worker, overlapping the caller's work. The order of calls is kept: only the one call
        pending can be taken.

        now: the caller waits for this call before it does anything else (a synchronous c10d
        call: its options' asyncOp is False). With nothing pending and no CUDA tensors, run()
        runs here, on the calling thread, and the Work returned has ended: the call is not
        queued, and the worker thread is not woken (on 2 cores the wake and the race for the
        call cost as much as the Python of a small call). Otherwise as inline.

        staged: the Staged of the call's CUDA tensors (made on the caller's thread); run() works
        on its host twins, which are waited for first and copied back after a success. Their
        copies to the host are queued now, overlapping the calls before it, unless one of those
        writes the same memory (then where it runs, after that call's copies back)."""
        with self._closing:
            if self._closed:
                raise TransportError("this 'ud' group is shut down (destroy_process_group): no collective runs on it")
            work = Work(result, staged)
            if now and work._staged is None and self._pending == 0:
                self._pending += 1
                work._claimed = True
                self._running.acquire()  # free: nothing else is pending (see _take)
                self._running_thread = threading.get_ident()
            else:
                if work._staged is not None:
                    if not any(staged.conflicts_with(earlier) for earlier in self._staged_pending):
                        staged.prefetch()
                    self._staged_pending.append(staged)
                    run = through_host(run, staged)
                self._pending += 1
                if inline or now:
                    work._take = lambda: self._take(run, work)
                self._queue.put((run, work))
                return work
        with torch.no_grad():  # as on the worker thread
            self._run_holding(run, work)
        return work

    def _take(self, run, work):
        with self._closing:
            if work._claimed or self._pending != 1:
                return
            work._claimed = True
            # Taken while the claim is made: a call submitted from another thread the moment
            # after must not reach the worker's _run first. Free: a call that holds it is pending
            # until it has let go, and this one is the only call pending.
            self._running.acquire()
            self._running_thread = threading.get_ident()
        with torch.no_grad():  # as on the worker thread
            self._run_holding(run, work)

    def _run(self, run, work):
        self._running.acquire()
        self._running_thread = threading.get_ident()
        self._run_holding(run, work)

    def _run_holding(self, run, work):
        """run() with _running held (and let go after it)."""
        work._take = None  # (it refers to the work: no cycle left behind)
        try:
            run()
        except BaseException as error:  # handed to whoever waits
            error_or_none = error
        else:
            error_or_none = None
        finally:
            self._running_thread = None
            self._running.release()
        with self._closing:
            self._pending -= 1
            if work._staged is not None:
                self._staged_pending.remove(work._staged)
        work._finish(error_or_none)

    def _loop(self):
        # grad mode is per thread: collectives write into tensors that may require grad (a
        # Parameter), which autograd forbids in place, as c10d's own backends do not care
        torch.set_grad_enabled(False)
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, work = item
            with self._closing:
                taken, work._claimed = work._claimed, True
            if not taken:  # else a waiter ran it (SerialWorker._take)
                self._run(run, work)

    def close(self):
        """Finish what is queued, then stop; later submits raise."""
        with self._closing:
            self._closed = True
            if self._thread.is_alive():
                self._queue.put(None)
        if self._thread.is_alive():
            if threading.current_thread() is not self._thread:
                self._thread.join()
        # a call that a caller or a waiter still runs (unless this thread runs it: a signal
        # handler that shuts the group down from inside the call)
        if threading.current_thread() is not self._thread and self._running_thread != threading.get_ident():
            with self._running:
                pass


def through_host(run, staged):
    """run() on `staged`'s twins (ud_transport.staging.on_twins), as a callable of no arguments."""
    return lambda: on_twins(lambda _: run(), staged)
