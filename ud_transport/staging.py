"""Device (CUDA) tensors on a host engine: each call's device tensors get pinned host twins.

The engine reads and writes host memory only. A call on a CUDA tensor therefore runs on a pinned
host twin of it, with the stream rules c10d's own host-staged backends follow (ProcessGroupGloo's
CUDA work):

1. On the caller's thread, when the call is made: an event is recorded on the caller's current
   stream. A side stream waits on it before the device-to-host copies (non-blocking), so a tensor
   a kernel has just been queued to write is read after that kernel. A group's worker queues the
   copies at once where no earlier call still pending writes the same memory: they then run
   while earlier calls are on the wire. Else they are queued where the call runs, behind the
   earlier calls' copies back (two async all_reduces of one tensor: the second reads the first's
   result, as on NCCL's stream).
2. Where the call runs (the caller's thread, or a group's worker): the host waits for the copies
   to land, then the engine works on the twins.
3. On success only, the twins of the tensors the call writes are queued back host-to-device on
   the side stream, and an event is recorded after them. The caller's current stream waits on
   that event (``caller_waits``, what c10d's ``Work.wait()`` does): no host synchronisation.
   On any error nothing is copied back, so the device tensor keeps its values.

Memory: a twin lives from the call's start until its copy back is queued; it comes from torch's
caching host allocator, which keeps freed pinned blocks for reuse and hands a block out again
only after the copies queued on it have run. So pinned memory peaks at the bytes of the calls in
flight at once (for DDP: its gradient buckets) and is reused from then on.

The copies of one call are whole, not segmented with the wire: the engine takes a call's memory
at its start. At the sizes and rates measured (docs/gpu.md) both copies of a 64 MiB call took
under a tenth of the call on the wire; across calls the copies overlap the wire (step 1).

``DEVICE`` holds the device operations; tests on a machine without CUDA put a host stand-in
there to check the order of the steps (tests/test_staging.py)."""
import contextlib
import functools
import inspect
import sys
import threading

ON_DEVICE_TYPES = ("cuda",)


def _torch():
    return sys.modules.get("torch")


def on_device(tensor):
    """True for a torch tensor in device memory this module stages (CUDA)."""
    torch = _torch()
    return torch is not None and isinstance(tensor, torch.Tensor) and DEVICE.owns(tensor)


def any_on_device(tensors):
    torch = _torch()
    if torch is None:
        return False
    tensor_type, owns = torch.Tensor, DEVICE.owns  # asked of every argument of every call: one lookup each
    for tensor in tensors:
        if isinstance(tensor, tensor_type) and owns(tensor):
            return True
    return False


class CudaDevice:
    """CUDA through torch: one side stream per device, made on first use, shared by the calls of
    the process (their copies stay in the order the calls were made)."""

    def __init__(self):
        self._side_streams = {}
        self._lock = threading.Lock()

    def owns(self, tensor):
        return tensor.is_cuda  # ON_DEVICE_TYPES; asked of every tensor of every call, and 5x cheaper than .device

    def check(self, tensor):
        """Raises ValueError where this process cannot serve `tensor`'s device."""
        torch = _torch()
        if not torch.cuda.is_available():
            raise ValueError(f"a tensor on {tensor.device}, but this torch build or machine has no CUDA")

    def side_stream(self, device):
        torch = _torch()
        with self._lock:
            stream = self._side_streams.get(device)
            if stream is None:
                stream = self._side_streams[device] = torch.cuda.Stream(device=device)
            return stream

    def caller_mark(self, device):
        """An event recorded now on the caller's current stream of `device`."""
        torch = _torch()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def record(self, stream):
        torch = _torch()
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def stream_waits(self, stream, event):
        stream.wait_event(event)

    def caller_waits(self, device, event):
        _torch().cuda.current_stream(device).wait_event(event)

    def host_waits(self, event):
        event.synchronize()

    def used_on(self, tensor, stream):
        """The caching allocator must not hand `tensor`'s block out again before the side stream's
        copies of it have run (a caller that drops the tensor and its Work without waiting)."""
        tensor.record_stream(stream)

    def pinned_like(self, tensor):
        torch = _torch()
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def copy(self, destination, source, stream):
        torch = _torch()
        with torch.cuda.stream(stream), torch.no_grad():
            destination.copy_(source, non_blocking=True)

    def streams_of(self, stream):
        """A context in which `stream` is the current one (a CUDA-aware Future records its
        events on the current streams)."""
        return _torch().cuda.stream(stream)


DEVICE = CudaDevice()


class Staged:
    """The device tensors of one call and their pinned host twins.

    Made on the caller's thread: an event marks where the caller's stream stands, and every copy
    to the host is queued behind it. The copies are queued by ``prefetch()`` (a group's worker
    calls it when the call is submitted, where no earlier pending call writes these tensors), or
    else by ``landed()`` where the call runs, behind the copies back of the calls before it.
    ``host(t)`` is the tensor the engine works on in place of `t`.

    Parameters
    ----------
    reads : sequence of tensors
        Tensors the call only reads.
    writes : sequence of tensors
        Tensors the call writes; their old values are staged too (a lost chunk keeps them).
    overwrites : sequence of tensors
        Tensors the call writes whole on success (an exact call's output): their twins are not
        filled from the device, which saves their bytes over the bus.

    Raises
    ------
    ValueError
        Device tensors on more than one device, or a device this process cannot serve.
    """

    def __init__(self, reads=(), writes=(), overwrites=()):
        self._device = DEVICE
        self.twins = {}        # id(original) -> twin
        self._written = []     # (original, twin), in order
        self._to_host = []     # (twin, original): the copies to the host, queued once
        self.device = None
        self.done = None       # the event after the copies back (None: nothing copied back yet)
        self._landed = None
        self._queued = False
        self.storages, self.written_storages = set(), set()  # data pointers (pending calls' conflicts)
        reads, writes, overwrites = list(reads), list(writes), list(overwrites)
        device_tensors = [t for t in reads + writes + overwrites if on_device(t)]
        if not device_tensors:
            return
        devices = {t.device for t in device_tensors}
        if len(devices) > 1:
            raise ValueError(f"one call's tensors must share a device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._device.check(device_tensors[0])
        self.stream = self._device.side_stream(self.device)
        self._mark = self._device.caller_mark(self.device)
        written_ids = {id(t) for t in writes + overwrites}
        filled_ids = {id(t) for t in reads + writes}  # an overwritten tensor also read is filled
        for tensor in device_tensors:
            if id(tensor) in self.twins:
                continue
            twin = self._device.pinned_like(tensor)
            self._device.used_on(tensor, self.stream)
            self.twins[id(tensor)] = twin
            storage = tensor.untyped_storage().data_ptr()
            self.storages.add(storage)
            if id(tensor) in filled_ids:
                self._to_host.append((twin, tensor))
            if id(tensor) in written_ids:
                self._written.append((tensor, twin))
                self.written_storages.add(storage)

    def prefetch(self):
        """Queue the copies to the host now (once): behind the caller's mark on the side stream."""
        if not self or self._queued:
            return
        self._queued = True
        self._device.stream_waits(self.stream, self._mark)
        for twin, tensor in self._to_host:
            self._device.copy(twin, tensor, self.stream)
        self._to_host = []  # (the twins stay in `twins`; record_stream keeps the sources' memory)
        self._landed = self._device.record(self.stream)

    def conflicts_with(self, earlier):
        """True where `earlier` (a call not yet finished) writes memory this call reads or
        writes: its copies to the host must then wait for that call's copies back."""
        return bool(self.storages & earlier.written_storages)

    def __bool__(self):
        return self.device is not None

    def host(self, tensor):
        """The twin of a staged tensor, else `tensor` itself."""
        return self.twins.get(id(tensor), tensor)

    def hosts(self, nested):
        """`nested` (a tensor, or lists/tuples of them, nested) with every staged tensor replaced
        by its twin."""
        if isinstance(nested, (list, tuple)):
            return type(nested)(self.hosts(item) for item in nested)
        return self.host(nested)

    def landed(self):
        """Queue the copies to the host if prefetch() has not, then wait on the host until they
        have run."""
        self.prefetch()
        if self._landed is not None:
            self._device.host_waits(self._landed)
            self._landed = None

    def write_back(self):
        """Queue the copies back of the written twins, then an event after them (``done``). The
        twins are let go: the allocator reuses them once the copies have run."""
        if not self:
            return
        for original, twin in self._written:
            self._device.copy(original, twin, self.stream)
        self.done = self._device.record(self.stream)
        self.release()

    def release(self):
        """Let the twins go without copying anything back (the call failed)."""
        self.twins = {}
        self._written = []
        self._to_host = []

    def caller_waits(self):
        """The current stream of the calling thread waits for the copies back."""
        if self.done is not None:
            self._device.caller_waits(self.device, self.done)

    def on_side_stream(self):
        """A context in which the side stream is current (see CudaDevice.streams_of)."""
        return self._device.streams_of(self.stream)


def run_on_host(call, reads=(), writes=(), overwrites=()):
    """call(), made on host twins of the device tensors among `reads`, `writes` and `overwrites`
    (as Staged takes them): ``call``
    takes the Staged and finds its tensors with ``staged.host(t)``. Synchronous, for the
    caller's own thread: the caller's stream waits for the results; on an error nothing is
    written back and the error is raised."""
    return run_staged(call, Staged(reads, writes, overwrites))


def run_staged(call, staged):
    """run_on_host's steps for a Staged already made."""
    result = on_twins(call, staged)
    staged.caller_waits()
    return result


def on_twins(call, staged):
    """call(staged) once `staged`'s copies to the host have landed; after a success its copies
    back are queued, after an error nothing is copied back and the error is raised. Where the
    caller's stream waits is the caller's business (run_staged, or c10d's Work.wait())."""
    staged.landed()
    try:
        result = call(staged)
    except BaseException:
        staged.release()
        raise
    staged.write_back()
    return result


def stages(reads=(), writes=(), overwrites=(), refusing=None):
    """A decorator: the function's arguments named in `reads`, `writes` and `overwrites` (as Staged
    takes them) may be device tensors, each staged through a host twin (run_on_host) before the
    function runs on host memory.
    refusing(arguments): a context manager around the staging (the exact layer keeps a refused
    call in step with the other ranks this way)."""
    def wrap(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def staged_call(*args, **kwargs):
            # host tensors, every call but a device one: no binding of the arguments (small calls'
            # latency counts in microseconds)
            if not any_on_device(args) and not any_on_device(kwargs.values()):
                return function(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            named = reads + writes + overwrites
            if not any_on_device(arguments.get(name) for name in named):
                return function(*args, **kwargs)

            def on_host(staged):
                for name in named:
                    if name in arguments:
                        arguments[name] = staged.host(arguments[name])
                return function(*bound.args, **bound.kwargs)
            with refusing(arguments) if refusing is not None else contextlib.nullcontext():
                staged = Staged(*([arguments[n] for n in names if n in arguments]
                                  for names in (reads, writes, overwrites)))
            return run_staged(on_host, staged)
        return staged_call
    return wrap
