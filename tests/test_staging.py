"""ud_transport.staging on a machine without CUDA: the staging of device tensors through host
twins, checked with a host stand-in for the device (HostStandInDevice, a mock: it is not CUDA).

The stand-in treats the CPU tensors a test registers as "device" tensors, hands out ordinary CPU
tensors as "pinned" twins, copies synchronously, and logs every device operation (copies, event
records, stream waits, host waits), so the tests read the order of the steps from the log: the
side stream waits on the caller's mark before any copy to the host, the host waits for the
copies before the call, only written tensors are copied back, only after a success, and the
caller's stream waits on the event recorded after the copies back. It goes in place of
``staging.DEVICE`` (monkeypatch).

Real CUDA is not exercised here: not the streams, events, pinned memory or non-blocking copies
themselves, nor the CUDA-aware torch.futures.Future a staged Work of the c10d backend makes
(it refuses a CPU device on the host; the worker tests put a plain Future in its place).

The end-to-end tests run two ranks as two threads of this process (two Communicators on one
in-memory store), so the stand-in installed here reaches both."""
import contextlib
import datetime
import itertools
import threading
import typing

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ud_transport import exact, options as options_module, staging, tensors  # noqa: E402
from ud_transport.communicator import Communicator  # noqa: E402
from ud_transport.errors import LayoutMismatch  # noqa: E402
from ud_transport.torch import backend  # noqa: E402
from ud_transport.torch._worker import SerialWorker, through_host  # noqa: E402

_PlainFuture = torch.futures.Future
_T = typing.TypeVar("_T")


class _Stream:
    def __init__(self, name):
        self.name = name


class _Event:
    def __init__(self, label):
        self.label = label


class HostStandInDevice:
    """A stand-in (mock) for staging.CudaDevice, on the host: "device" tensors are the CPU
    tensors registered with `device_tensor`, twins are plain CPU tensors, copies are synchronous
    copy_, streams and events are labels, and every operation is appended to `log`:

    ("check", name), ("record", stream, event), ("wait", stream, event) (the caller's stream is
    "caller"), ("host waits", event), ("pin", name), ("to host", name, stream),
    ("to device", name, stream), ("enter", stream) / ("exit", stream) (streams_of).
    Events are labelled e1, e2, ... in the order they are made."""

    def __init__(self):
        self.log = []
        self._names = {}    # id -> name, of device tensors and twins
        self._held = []     # keeps them alive: an id is not reused while the test runs
        self._twins = set()
        self._labels = itertools.count(1)
        self._lock = threading.Lock()  # two ranks (threads) share the stand-in

    def device_tensor(self, values, name):
        """Registers `values` (a CPU tensor) as a device tensor called `name`; returns it."""
        with self._lock:
            self._names[id(values)] = name
            self._held.append(values)
        return values

    def name(self, tensor):
        return self._names[id(tensor)]

    def entries(self, kind, name=None):
        return [e for e in self.log if e[0] == kind and (name is None or e[1] == name)]

    def _event(self):
        with self._lock:
            return _Event(f"e{next(self._labels)}")

    # -- CudaDevice's interface ------------------------------------------------

    def owns(self, tensor):
        return id(tensor) in self._names and id(tensor) not in self._twins

    def check(self, tensor):
        self.log.append(("check", self.name(tensor)))

    def side_stream(self, device):
        return _Stream("side")

    def caller_mark(self, device):
        event = self._event()
        self.log.append(("record", "caller", event.label))
        return event

    def record(self, stream):
        event = self._event()
        self.log.append(("record", stream.name, event.label))
        return event

    def stream_waits(self, stream, event):
        self.log.append(("wait", stream.name, event.label))

    def caller_waits(self, device, event):
        self.log.append(("wait", "caller", event.label))

    def host_waits(self, event):
        self.log.append(("host waits", event.label))

    def used_on(self, tensor, stream):
        self.log.append(("used on", self.name(tensor), stream.name))

    def pinned_like(self, tensor):
        twin = torch.empty(tensor.shape, dtype=tensor.dtype)
        with self._lock:
            self._names[id(twin)] = f"twin of {self.name(tensor)}"
            self._twins.add(id(twin))
            self._held.append(twin)
        self.log.append(("pin", self.name(tensor)))
        return twin

    def copy(self, destination, source, stream):
        with torch.no_grad():
            destination.copy_(source)
        if id(destination) in self._twins:
            self.log.append(("to host", self.name(source), stream.name))
        else:
            self.log.append(("to device", self.name(destination), stream.name))

    @contextlib.contextmanager
    def streams_of(self, stream):
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.log.append(("exit", stream.name))


@pytest.fixture
def device(monkeypatch):
    """A fresh HostStandInDevice as staging.DEVICE for the test (every Staged made in it uses it)."""
    stand_in = HostStandInDevice()
    monkeypatch.setattr(staging, "DEVICE", stand_in)
    return stand_in


class _HostFuture(_PlainFuture[_T]):
    """A plain torch.futures.Future, whatever devices it is asked to follow: a staged Work asks
    for a CUDA-aware one, which the host refuses for a CPU device ("Expected devices to have
    indices"). Generic, as torch.futures subscripts its Future."""
    asked = None  # the devices each Future was asked for, while the fixture holds it

    def __init__(self, *, devices=None):
        _HostFuture.asked.append(devices)
        super().__init__()


@pytest.fixture
def plain_future(monkeypatch):
    """_HostFuture in place of torch.futures.Future; returns the devices each was asked for."""
    monkeypatch.setattr(_HostFuture, "asked", [])
    monkeypatch.setattr(torch.futures, "Future", _HostFuture)
    return _HostFuture.asked


def _at(log, entry):
    assert entry in log, (entry, log)
    return log.index(entry)


def _checks_the_order(log, written, read=()):
    """The rules of staging.py's module docstring, read from the stand-in's log of one call that
    ran (("call",) logged by the call) and succeeded."""
    mark = next(e for e in log if e[:2] == ("record", "caller"))
    side_waits = _at(log, ("wait", "side", mark[2]))
    to_host = [i for i, e in enumerate(log) if e[0] == "to host"]
    assert to_host and side_waits < min(to_host), log  # the copies follow the caller's queued work
    assert sorted(log[i][1] for i in to_host) == sorted([*written, *read]), log
    landed = next(e for e in log[max(to_host):] if e[:2] == ("record", "side"))
    call = _at(log, ("call",))
    assert _at(log, ("host waits", landed[2])) < call, log  # the host waits for the copies first
    to_device = [i for i, e in enumerate(log) if e[0] == "to device"]
    assert sorted(log[i][1] for i in to_device) == sorted(written), log  # only what the call writes
    assert all(i > call for i in to_device), log
    done = next(e for e in log[max(to_device, default=call):] if e[:2] == ("record", "side"))
    assert _at(log, done) > max(to_device, default=call), log  # done follows every copy back
    assert _at(log, ("wait", "caller", done[2])) > _at(log, done), log
    return done[2]


# -- Staged and run_on_host ------------------------------------------------------


def test_the_steps_of_a_call_come_in_order(device):
    """The side stream waits on the caller's mark before the first copy to the host; the host
    waits on the landed event before the call runs; the copy back comes after the call; done is
    recorded after every copy back, and the caller's stream waits on done."""
    source = device.device_tensor(torch.arange(4.0), "source")
    target = device.device_tensor(torch.zeros(4), "target")

    def call(staged):
        device.log.append(("call",))
        # the engine reads the twins: the device's values, in other memory
        assert staged.host(source) is not source and torch.equal(staged.host(source), torch.arange(4.0))
        staged.host(target).copy_(staged.host(source) * 2)
        return "result"
    assert staging.run_on_host(call, reads=[source], writes=[target]) == "result"
    assert torch.equal(target, torch.arange(4.0) * 2)
    assert torch.equal(source, torch.arange(4.0))
    _checks_the_order(device.log, written=["target"], read=["source"])
    assert device.log[0] == ("check", "source")  # the device is checked before anything is queued


def test_a_staged_call_waits_for_nothing_before_its_write_back(device):
    """Made, a Staged has queued its copies to the host only: done is None and caller_waits()
    makes no stream wait; write_back() records done, after which caller_waits() waits on it."""
    tensor = device.device_tensor(torch.ones(3), "tensor")
    staged = staging.Staged(writes=[tensor])
    assert staged and staged.device == tensor.device and staged.done is None
    staged.caller_waits()
    assert not device.entries("wait", "caller") and not device.entries("to device")
    staged.landed()
    staged.landed()  # a second wait is no second host wait
    assert len(device.entries("host waits")) == 1
    staged.write_back()
    staged.caller_waits()
    assert device.log[-1] == ("wait", "caller", staged.done.label)
    assert staged.twins == {}  # let go after their copy back is queued


def test_only_written_tensors_are_copied_back_and_a_repeated_tensor_has_one_twin(device):
    """A tensor only read gets a twin but no copy back (even where its twin was changed); a tensor
    passed twice, read and written, is pinned and copied once each way; a CPU tensor among them
    is used as it is."""
    both = device.device_tensor(torch.full((2,), 1.0), "both")
    read = device.device_tensor(torch.full((3,), 2.0), "read")
    written = device.device_tensor(torch.full((4,), 3.0), "written")
    on_host = torch.full((5,), 4.0)
    staged = staging.Staged(reads=[both, read, on_host], writes=[written, both])
    assert len(staged.twins) == 3
    assert [e[1] for e in device.entries("pin")] == ["both", "read", "written"]
    # each original is marked used on the side stream (record_stream): a caller that drops it
    # before the copies ran must not see its memory handed to another tensor meanwhile
    assert [(e[1], e[2]) for e in device.entries("used on")] == [("both", "side"), ("read", "side"), ("written", "side")]
    assert staged.host(on_host) is on_host
    nested = staged.hosts([both, (read, [both, on_host])])
    assert nested[0] is nested[1][1][0] is staged.host(both) and nested[1][1][1] is on_host
    assert isinstance(nested[1], tuple)
    staged.landed()
    for tensor in (both, read, written):
        staged.host(tensor).fill_(9.0)
    staged.write_back()
    assert [e[1] for e in device.entries("to device")] == ["both", "written"]
    assert torch.equal(read, torch.full((3,), 2.0))
    assert torch.equal(both, torch.full((2,), 9.0)) and torch.equal(written, torch.full((4,), 9.0))


def test_a_call_of_host_tensors_stages_nothing(device):
    """No device tensor: the Staged is empty (false), and neither it nor run_on_host touches the device."""
    plain = torch.ones(2)
    staged = staging.Staged(reads=[plain], writes=[plain])
    assert not staged and staged.host(plain) is plain
    staged.landed(), staged.write_back(), staged.caller_waits()
    assert staging.run_on_host(lambda s: s.host(plain).add_(1), writes=[plain]) is plain
    assert torch.equal(plain, torch.full((2,), 2.0)) and device.log == []


def test_an_error_in_the_call_copies_nothing_back(device):
    """A call that writes the twin and then raises: the error reaches the caller, nothing is
    copied back (no copy to the device, no done, no wait of the caller's stream), and the device
    tensor keeps its values."""
    tensor = device.device_tensor(torch.arange(5.0), "tensor")

    def call(staged):
        device.log.append(("call",))
        staged.host(tensor).fill_(-1.0)  # a partial result the call then abandons
        raise RuntimeError("lost on the wire")
    with pytest.raises(RuntimeError, match="lost on the wire"):
        staging.run_on_host(call, writes=[tensor])
    assert torch.equal(tensor, torch.arange(5.0))
    after = device.log[_at(device.log, ("call",)):]
    assert not [e for e in after if e[0] in ("to device", "record", "wait")], device.log


def test_tensors_on_two_devices_are_refused_before_anything_is_queued(device):
    """One call's device tensors must share a device: a CPU and a meta tensor, both "device"
    tensors of the stand-in, raise ValueError naming both devices, with no copy or mark queued."""
    first = device.device_tensor(torch.ones(2), "first")
    second = device.device_tensor(torch.empty(2, device="meta"), "second")
    with pytest.raises(ValueError, match=r"share a device.*'cpu', 'meta'"):
        staging.Staged(reads=[first], writes=[second])
    assert device.log == []


# -- the worker of the c10d backend ---------------------------------------------


def test_through_host_waits_for_the_copies_then_copies_back_after_a_success(device):
    """through_host(run, staged): the landed event is waited on before run, and the copy back and
    done come after it; on an error the twins are let go, nothing is copied back, and the error
    is raised."""
    tensor = device.device_tensor(torch.ones(3), "tensor")
    staged = staging.Staged(writes=[tensor])

    def run():
        device.log.append(("call",))
        staged.host(tensor).mul_(5)
    through_host(run, staged)()
    staged.caller_waits()  # what Work.wait() does
    _checks_the_order(device.log, written=["tensor"])
    assert torch.equal(tensor, torch.full((3,), 5.0))

    device.log.clear()
    failing = staging.Staged(writes=[tensor])

    def fails():
        failing.host(tensor).zero_()
        raise ValueError("refused")
    with pytest.raises(ValueError, match="refused"):
        through_host(fails, failing)()
    assert failing.twins == {} and failing.done is None and not device.entries("to device")
    assert torch.equal(tensor, torch.full((3,), 5.0))


@pytest.mark.parametrize("inline", [False, True])
def test_a_staged_work_makes_the_callers_stream_wait_after_the_copies_back(device, plain_future, inline):
    """SerialWorker.submit(..., staged=): the worker (or the waiting thread, inline) runs the call
    on the twins; Work.wait() returns after the copy back and done, then makes the caller's
    stream wait on done; the future's value is set with the side stream current. A failed call
    raises from wait() with nothing copied back and no stream wait. (A plain Future stands in
    for the CUDA-aware one: plain_future.)"""
    tensor = device.device_tensor(torch.ones(4), "tensor")
    worker = SerialWorker("test-staging")
    try:
        staged = staging.Staged(writes=[tensor])

        def run():
            device.log.append(("call",))
            staged.host(tensor).add_(1)
        work = worker.submit(run, [tensor], inline=inline, staged=staged)
        assert plain_future[-1] == [staged.device]  # the future is asked to follow the device
        assert work.wait() is True
        done = _checks_the_order(device.log, written=["tensor"])
        # the value's events would be recorded on the side stream, after done
        assert _at(device.log, ("record", "side", done)) < _at(device.log, ("enter", "side"))
        assert work.get_future().wait() == [tensor] and torch.equal(tensor, torch.full((4,), 2.0))

        device.log.clear()
        failing = staging.Staged(writes=[tensor])

        def fails():
            failing.host(tensor).zero_()
            raise RuntimeError("deadline")
        work = worker.submit(fails, [tensor], inline=inline, staged=failing)
        with pytest.raises(RuntimeError, match="deadline"):
            work.wait()
        assert not device.entries("to device") and not device.entries("wait", "caller")
        assert not device.entries("enter")
        assert torch.equal(tensor, torch.full((4,), 2.0))
    finally:
        worker.close()


def test_a_call_on_memory_an_earlier_pending_call_writes_reads_that_calls_result(device, plain_future):
    """Two calls queued on one worker (the second submitted while the first still runs): where
    the first writes the tensor the second reads, the second's copy to the host is queued after
    the first's copy back (it reads the first's result, as a second all_reduce on NCCL's stream
    does); on another tensor it is queued at once, overlapping the first (prefetch). Removing the
    conflict check makes the first case read the old values."""
    shared = device.device_tensor(torch.ones(2), "shared")
    other = device.device_tensor(torch.ones(2), "other")
    worker = SerialWorker("test-staging-order")
    try:
        for second_tensor, name in ((shared, "shared"), (other, "other")):
            device.log.clear()
            release = threading.Event()
            first = staging.Staged(writes=[shared])

            def run_first(first=first):
                release.wait(10)
                first.host(shared).add_(10)
                device.log.append(("first ran",))
            first_work = worker.submit(run_first, [shared], staged=first)
            second = staging.Staged(writes=[second_tensor])
            seen = []

            def run_second(second=second, second_tensor=second_tensor):
                seen.append(second.host(second_tensor).clone())
            second_work = worker.submit(run_second, [second_tensor], staged=second)
            release.set()
            first_work.wait()
            second_work.wait()
            first_back = _at(device.log, ("to device", "shared", "side"))
            second_to_host = [i for i, e in enumerate(device.log) if e[:2] == ("to host", name)][-1]
            if name == "shared":
                assert second_to_host > first_back, device.log
                assert torch.equal(seen[0], torch.full((2,), 11.0))  # the first call's result
            else:
                assert second_to_host < _at(device.log, ("first ran",)), device.log  # queued at submit
                assert torch.equal(seen[0], torch.ones(2))
    finally:
        worker.close()


def test_an_overwritten_output_is_not_copied_to_the_host_but_is_copied_back(device):
    """Staged(overwrites=[t]): t's twin is not filled from the device (an exact call writes it
    whole), and it is copied back after a success; a tensor both read and overwritten is filled."""
    output = device.device_tensor(torch.full((3,), 7.0), "output")
    both = device.device_tensor(torch.full((3,), 1.0), "both")
    staged = staging.Staged(reads=[both], overwrites=[output, both])
    staged.landed()
    assert [e[1] for e in device.entries("to host")] == ["both"]
    staged.host(output).fill_(2.0)
    staged.host(both).fill_(3.0)
    staged.write_back()
    assert sorted(e[1] for e in device.entries("to device")) == ["both", "output"]
    assert torch.equal(output, torch.full((3,), 2.0)) and torch.equal(both, torch.full((3,), 3.0))


def test_a_staged_call_lets_its_twins_go_once_its_copies_back_are_queued(device):
    """After write_back (or release) the Staged holds no twin: a Work that outlives its call (a
    list of Works kept, DDP's futures) must not keep pinned memory (the copies to the host were
    still listed, holding every twin, until a review found it)."""
    read = device.device_tensor(torch.ones(2), "read")
    written = device.device_tensor(torch.ones(2), "written")
    for end in ("write_back", "release"):
        staged = staging.Staged(reads=[read], writes=[written])
        staged.landed()
        getattr(staged, end)()
        assert not staged.twins and not staged._to_host and not staged._written, end


# -- a group of the c10d backend, a world of one, in this process ------------------


@pytest.fixture
def group():
    options = backend.BackendOptions(transport="udp", communicator=dict(bind_address="127.0.0.1"))
    made = backend.ProcessGroupUD(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30), options, "staging")
    yield made
    made.shutdown()


def _flush(group):
    group._worker.submit(lambda: None, None).wait()  # rank-local: every queued call has run


def test_the_backend_stages_an_all_gather_into_tensor(device, plain_future, group):
    """c10d's all_gather_into_tensor on "device" tensors: the output is written through its twin
    and copied back, the shard (only read) is not, and wait() leaves the caller's stream waiting
    on done."""
    shard = device.device_tensor(torch.arange(6.0), "shard")
    output = device.device_tensor(torch.zeros(6), "output")
    group._allgather_base(output, shard).wait()
    assert torch.equal(output, torch.arange(6.0))
    assert [e[1] for e in device.entries("to device")] == ["output"]
    done = device.entries("record", "side")[-1][2]
    # the worker may still be completing the Work's future (its side-stream context) when wait()
    # returns, so the caller's wait is looked for after the copy back, not at the log's end
    copied_back = device.log.index(device.entries("to device")[-1])
    assert ("wait", "caller", done) in device.log[copied_back:]


def test_an_all_gather_into_a_tensor_of_another_dtype_is_refused(group):
    """The exact all-gather moves bytes: a float32 output for a float16 input was accepted and
    half of it left as it was (a review found it); it is a TypeError now, before any call."""
    with pytest.raises(TypeError, match="the output is torch.float32, the input torch.float16"):
        group._allgather_base(torch.zeros(4), torch.zeros(4, dtype=torch.float16))


def test_the_backend_names_a_tensor_it_cannot_serve():
    """The c10d checks (on the caller's thread) refuse a meta tensor with a ValueError that names
    its device; so do the API's (refuse_unsupported_torch, staged or not)."""
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"allreduce on 'ud': CPU and CUDA tensors only, got one on meta"):
        backend._check_tensors("allreduce", [meta])
    for staged in (False, True):
        with pytest.raises(ValueError, match="on meta"):
            tensors.refuse_unsupported_torch(meta, "a call", staged=staged)


def test_a_backend_call_refused_by_staging_still_starts_an_agreement_round(device, group):
    """A refused c10d call queues an agreement round in its place (ProcessGroupUD._refusing), so
    the other ranks' call meets one: a meta tensor with CudaDevice's own rules does (refused by
    the checks); tensors on two devices, refused when they are staged, should too."""
    before = group.communicator.sequence
    with pytest.raises(ValueError, match="CPU and CUDA tensors only"):
        group.allreduce([torch.empty(2, device="meta")])  # not the stand-in's: refused by _check_tensors
    _flush(group)
    assert group.communicator.sequence == before + 1  # the agreement round ran
    first = device.device_tensor(torch.ones(2), "first")
    second = device.device_tensor(torch.empty(2, device="meta"), "second")
    with pytest.raises(ValueError, match="share a device"):
        group.allreduce([first, second])
    _flush(group)
    assert group.communicator.sequence == before + 2, "no agreement round for a call refused by staging"


# -- the staging decorator ------------------------------------------------------------


@staging.stages(reads=("source",), writes=("target",))
def _copy_twice(source, target, scale=2.0, *, seen=None):
    if seen is not None:
        seen.extend([source, target])
    target.copy_(source * scale)
    return "done"


@pytest.mark.parametrize("how", ["positional", "keyword", "mixed"])
def test_the_decorator_stages_arguments_given_either_way(device, how):
    """staging.stages finds its arguments by name, passed by position or by keyword: the function
    sees twins, the written one is copied back, the read one is not."""
    source = device.device_tensor(torch.arange(3.0), "source")
    target = device.device_tensor(torch.zeros(3), "target")
    seen = []
    call = {"positional": lambda: _copy_twice(source, target, 3.0, seen=seen),
            "keyword": lambda: _copy_twice(target=target, source=source, scale=3.0, seen=seen),
            "mixed": lambda: _copy_twice(source, scale=3.0, target=target, seen=seen)}[how]
    assert call() == "done"
    assert seen[0] is not source and seen[1] is not target  # the twins
    assert torch.equal(target, torch.arange(3.0) * 3) and torch.equal(source, torch.arange(3.0))
    assert [e[1] for e in device.entries("pin")] == ["source", "target"]
    assert [e[1] for e in device.entries("to device")] == ["target"]
    assert device.entries("wait", "caller")


def test_the_decorator_leaves_a_call_of_host_tensors_alone(device):
    """No device tensor among the named arguments: the function gets the caller's tensors, and
    the device is not touched."""
    source, target, seen = torch.arange(3.0), torch.zeros(3), []
    assert _copy_twice(source, target=target, seen=seen) == "done"
    assert seen[0] is source and seen[1] is target and device.log == []


# -- through real Communicators: two ranks as threads of this process --------------


def _options(**extra):
    return options_module.build(bind_address="127.0.0.1", store_timeout_s=30, **extra)


@pytest.fixture
def pair():
    """Two Communicators of one world, on one in-memory store, made by two threads (each waits
    for the other in the rendezvous)."""
    store, comms = dist.HashStore(), [None, None]

    def make(rank):
        comms[rank] = Communicator(rank, 2, store, "udp", _options(), name="staging-pair")
    _both(lambda rank: make(rank))
    yield comms
    for comm in comms:
        comm.close()


@pytest.fixture
def solo():
    comm = Communicator(0, 1, dist.HashStore(), "udp", _options(), name="staging-solo")
    yield comm
    comm.close()


def _both(task, timeout_s=60):
    """task(rank) on two threads at once; returns what each returned or raised."""
    results = [None, None]

    def run(rank):
        try:
            results[rank] = task(rank)
        except BaseException as error:  # handed to the test
            results[rank] = error
    threads = [threading.Thread(target=run, args=(rank,), name=f"rank{rank}") for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a rank's call never ended"
    return results


def _raised(results):
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_an_allreduce_of_device_tensors_sums_and_writes_back(device, pair):
    """Communicator.allreduce on stand-in device tensors: each rank's tensor holds the sum, through
    one twin each, with the steps in order."""
    values = [device.device_tensor(torch.full((1000,), float(rank + 1)), f"rank{rank}") for rank in range(2)]
    _raised(_both(lambda rank: pair[rank].allreduce(values[rank], loss_budget=0.0)))
    for rank in range(2):
        assert torch.equal(values[rank], torch.full((1000,), 3.0))
        assert device.entries("pin", f"rank{rank}") == [("pin", f"rank{rank}")]
        assert device.entries("to device", f"rank{rank}") == [("to device", f"rank{rank}", "side")]


def test_gathers_and_exchanges_of_device_tensors(device, pair):
    """all_gather reads the shard's twin and writes the output's (the shard is not copied back);
    all_to_all with its output the tensor itself stages it once; chunk_mask sizes a device
    tensor as the host tensor of its size and dtype."""
    shards = [device.device_tensor(torch.full((8,), float(rank)), f"shard{rank}") for rank in range(2)]
    outputs = [device.device_tensor(torch.full((16,), -1.0), f"output{rank}") for rank in range(2)]
    _raised(_both(lambda rank: pair[rank].all_gather(shards[rank], outputs[rank], loss_budget=0.0)))
    want = torch.cat([torch.zeros(8), torch.ones(8)])
    for rank in range(2):
        assert torch.equal(outputs[rank], want)
        assert not device.entries("to device", f"shard{rank}")
        assert len(device.entries("to device", f"output{rank}")) == 1
    assert pair[0].chunk_mask("all_gather", outputs[0]).shape == pair[0].chunk_mask("all_gather", torch.zeros(16)).shape

    pieces = [device.device_tensor(torch.arange(4.0) + 10 * rank, f"pieces{rank}") for rank in range(2)]
    _raised(_both(lambda rank: pair[rank].all_to_all(pieces[rank], pieces[rank], loss_budget=0.0)))
    assert torch.equal(pieces[0], torch.tensor([0.0, 1.0, 10.0, 11.0]))
    assert torch.equal(pieces[1], torch.tensor([2.0, 3.0, 12.0, 13.0]))
    for rank in range(2):
        assert len(device.entries("pin", f"pieces{rank}")) == 1
        assert len(device.entries("to device", f"pieces{rank}")) == 1


def test_a_failed_call_leaves_the_device_tensor_as_it_was(device, pair):
    """Ranks that pass different sizes raise LayoutMismatch: nothing is copied back to either
    rank's device tensor, which keeps its values."""
    values = [device.device_tensor(torch.full((100 * (rank + 1),), float(rank + 1)), f"rank{rank}")
              for rank in range(2)]
    results = _both(lambda rank: pair[rank].allreduce(values[rank], deadline=10))
    assert all(isinstance(result, LayoutMismatch) for result in results), results
    for rank in range(2):
        assert torch.equal(values[rank], torch.full((100 * (rank + 1),), float(rank + 1)))
        assert device.entries("to host", f"rank{rank}") and not device.entries("to device", f"rank{rank}")
    assert not device.entries("wait", "caller")


def test_exact_gather_and_scatter_of_device_tensors(device, pair):
    """exact.gather to rank 1 with an output on both ranks: rank 0's keeps its values (its old
    values are staged, so the copy back writes them; staged as an output written whole, the twin's
    unfilled memory was copied over it); exact.scatter from rank 0 hands each rank its piece."""
    shards = [device.device_tensor(torch.full((4,), float(rank + 1)), f"shard{rank}") for rank in range(2)]
    outputs = [device.device_tensor(torch.full((8,), -7.0), f"output{rank}") for rank in range(2)]
    _raised(_both(lambda rank: exact.gather(pair[rank], shards[rank], outputs[rank], 1, deadline=10)))
    assert torch.equal(outputs[1], torch.tensor([1.0] * 4 + [2.0] * 4))
    assert torch.equal(outputs[0], torch.full((8,), -7.0)) and device.entries("to host", "output0")
    pieces = device.device_tensor(torch.arange(6.0), "pieces")
    received = [device.device_tensor(torch.full((3,), -1.0), f"received{rank}") for rank in range(2)]
    _raised(_both(lambda rank: exact.scatter(pair[rank], pieces if rank == 0 else None, received[rank], 0, deadline=10)))
    assert torch.equal(received[0], torch.arange(3.0)) and torch.equal(received[1], torch.arange(3.0, 6.0))
    assert not device.entries("to device", "pieces")


@pytest.mark.parametrize("op, want", [("sum", lambda a, b: a + b), ("max", torch.maximum)])
def test_the_exact_allreduce_of_device_tensors(device, pair, op, want):
    """ud_transport.exact.allreduce of int64 stand-in device tensors: the exact result on both
    ranks, staged once per rank (the exact layer's own calls run on the twin, not staged again)."""
    inputs = [torch.arange(37, dtype=torch.int64) * (3 - 2 * rank) + rank for rank in range(2)]
    values = [device.device_tensor(inputs[rank].clone(), f"rank{rank}") for rank in range(2)]
    _raised(_both(lambda rank: exact.allreduce(pair[rank], values[rank], op, deadline=10)))
    for rank in range(2):
        assert torch.equal(values[rank], want(inputs[0], inputs[1]))
        assert len(device.entries("pin", f"rank{rank}")) == 1
        assert len(device.entries("to device", f"rank{rank}")) == 1


def test_the_api_names_a_device_it_cannot_serve(solo):
    """A meta tensor (no stand-in: CudaDevice's rules) given to the lossy and the exact calls is
    refused with a ValueError that names its device."""
    meta = torch.empty(3, device="meta")
    calls = [lambda: solo.allreduce(meta), lambda: solo.broadcast(meta), lambda: solo.all_gather(meta, meta),
             lambda: exact.allreduce(solo, meta, "sum"), lambda: exact.broadcast(solo, meta)]
    for call in calls:
        with pytest.raises(ValueError, match="got one on meta"):
            call()


def test_an_exact_call_refused_by_staging_still_starts_an_agreement_round(device, solo):
    """An exact call refused before its first engine call starts an agreement round instead
    (exact._refused_in_step), so the other ranks' call meets one: an output too small does; a
    shard and an output on two devices, refused by staging, should too."""
    before = solo.sequence
    with pytest.raises(ValueError, match="output holds"):
        exact.all_gather(solo, torch.ones(4), torch.ones(2))
    assert solo.sequence == before + 1
    shard = device.device_tensor(torch.ones(4), "shard")
    output = device.device_tensor(torch.empty(4, device="meta"), "output")
    with pytest.raises(ValueError, match="share a device"):
        exact.all_gather(solo, shard, output)
    assert solo.sequence == before + 2, "no agreement round for a call refused by staging"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    """CudaDevice.check, on a machine or torch build without CUDA: a ValueError that says so
    (refuse_unsupported_torch and Staged call it for a CUDA tensor)."""
    with pytest.raises(ValueError, match="no CUDA"):
        staging.CudaDevice().check(torch.ones(1))
