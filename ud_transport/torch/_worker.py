"""One thread per communicator that runs its collectives in the order they
were issued, so callers (DDP's reducer, a comm hook) get a Work at once and
compute overlaps communication: the engine releases the GIL while it runs.
Every rank issues the same collectives in the same order, and this keeps it."""
import queue
import threading

import torch
import torch.distributed as dist

from ..errors import TransportError


class Work(dist._Work):
    """A collective that runs (or ran) on the worker. wait() blocks until it
    is done and raises its error, if any; get_future() gives a Future whose
    value is `result` (what c10d expects, e.g. the list of tensors)."""

    def __init__(self, result):
        super().__init__()
        self._result = result
        self._done = threading.Event()
        self._error = None
        # get_future()'s Future must fail the way C++ waiters read (DDP's reducer waits on it in
        # C++): Future.set_exception stores the exception as the value, which the reducer read as
        # tensors, and the process died (SIGSEGV) on a collective's error. A then() callback that
        # raises sets the Future's error; Python waiters get it as RuntimeError with the message.
        self._ended = torch.futures.Future()
        self._future = self._ended.then(self._result_or_error)

    def _result_or_error(self, _ended):
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, error=None):
        self._error = error
        self._done.set()
        self._ended.set_result(None)

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if not self._done.wait(seconds if seconds else None):
            raise TimeoutError("collective still running")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        return self._future

    def result(self):
        self.wait()
        return self._result


class SerialWorker:
    def __init__(self, name):
        self._queue = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # a submit racing close() would queue behind the end
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run, result):
        """Queue run() (which may raise); returns a Work carrying `result`. After close() it
        raises TransportError: nothing would run the call, and its Work would never finish."""
        with self._closing:
            if self._closed:
                raise TransportError("this 'ud' group is shut down (destroy_process_group): no collective runs on it")
            work = Work(result)
            self._queue.put((run, work))
        return work

    def _loop(self):
        # grad mode is per thread: collectives write into tensors that may require grad (a
        # Parameter), which autograd forbids in place, as c10d's own backends do not care
        torch.set_grad_enabled(False)
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, work = item
            try:
                run()
            except BaseException as error:  # handed to whoever waits
                work._finish(error)
            else:
                work._finish()

    def close(self):
        """Finish what is queued, then stop; later submits raise."""
        with self._closing:
            self._closed = True
            if self._thread.is_alive():
                self._queue.put(None)
        if self._thread.is_alive():
            if threading.current_thread() is not self._thread:
                self._thread.join()
