# cython: language_level=3, boundscheck=False, wraparound=False
"""Entry points of the native engine. Python decides sizes, budgets and
deadlines; everything per packet happens in C with the GIL released.
Links no RDMA library: the verbs transport lives in the optional ud_transport._verbs
and reaches the engine through Transport.adopt."""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from cpython.exc cimport PyErr_CheckSignals
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_SetName

from native cimport *
from transport_io cimport *

HEADER_BYTES = UDT_WIRE_HEADER_BYTES
WIRE_MAGIC = UDT_WIRE_MAGIC
WIRE_VERSION = UDT_WIRE_VERSION
MAX_WORLD_SIZE = UDT_MAX_WORLD
MAX_END_REPEATS = UDT_MAX_END_REPEATS
MAX_COPIES = UDT_MAX_COPIES
MAX_STRIPES = UDT_MAX_STRIPES

STATUS_OK = UDT_OK
STATUS_LOSS_BUDGET = UDT_ERR_LOSS_BUDGET
STATUS_PEER_TIMEOUT = UDT_ERR_PEER_TIMEOUT
STATUS_INVALID_ARGUMENT = UDT_ERR_INVALID_ARGUMENT
STATUS_TRANSPORT = UDT_ERR_TRANSPORT
STATUS_NO_MEMORY = UDT_ERR_NO_MEMORY
STATUS_LAYOUT_MISMATCH = UDT_ERR_LAYOUT_MISMATCH
STATUS_INTERRUPTED = UDT_ERR_INTERRUPTED

OP_SUM = UDT_OP_SUM
OP_MEAN = UDT_OP_MEAN
ESTIMATOR_UNBIASED = UDT_ESTIMATOR_UNBIASED
ESTIMATOR_ZERO_FILL = UDT_ESTIMATOR_ZERO_FILL
DTYPE_FLOAT32 = UDT_FLOAT32
DTYPE_FLOAT64 = UDT_FLOAT64
DTYPE_FLOAT16 = UDT_FLOAT16
DTYPE_BFLOAT16 = UDT_BFLOAT16
DTYPE_INT32 = UDT_INT32
LOSS_NONE = UDT_LOSS_NONE
LOSS_BERNOULLI = UDT_LOSS_BERNOULLI
LOSS_GILBERT_ELLIOTT = UDT_LOSS_GILBERT_ELLIOTT


include "native_error.pxi"

from collections import namedtuple as _namedtuple

NativeError = _namedtuple("NativeError", "message call errno object detail")
NativeError.__doc__ = """An error of the C layer: `call` is the failed system call ("" when a check of
the library failed), `errno` its errno (0 if none), `object` what it was called on, `detail`
advice or ""; `message` says it all in one sentence."""


cdef object native_error(const udt_error *e):
    return NativeError(*native_error_fields(e))


class NativeCallError(OSError):
    """A system call of the C layer failed (socket, bind, sendmmsg, ...): `call`, `errno`,
    `object` and `detail` as values; str() is the C layer's one-sentence message."""

    def __init__(self, call, errno_value, obj, detail, message):
        super().__init__(errno_value, message)
        self.call, self.object, self.detail, self.message = call, obj, detail, message

    def __str__(self):
        return self.message

    def __reduce__(self):  # keep the fields when sent between processes
        return type(self), (self.call, self.errno, self.object, self.detail, self.message)


cdef object exception_from(const udt_error *e, default=OSError):
    """NativeCallError when a call failed, else `default` with the library's message."""
    error = native_error(e)
    if error.call:
        return NativeCallError(error.call, error.errno, error.object, error.detail, error.message)
    return default(error.message)


UDP_GSO = UDT_UDP_GSO
UDP_GRO = UDT_UDP_GRO
UDP_RCVBUF_FORCED = UDT_UDP_RCVBUF_FORCED
UDP_GSO_REFUSED = UDT_UDP_GSO_REFUSED
UDP_DROPS_COUNTED = UDT_UDP_DROPS_COUNTED
UDP_PORTS_WATCHED = UDT_UDP_PORTS_WATCHED
UDP_PATH_MTU_IGNORED = UDT_UDP_PATH_MTU_IGNORED


cdef class Transport:
    """A datagram transport not yet handed to an engine."""
    cdef udt_transport *ptr
    cdef udt_transport *udp_ptr  # the UDP transport inside ptr (ptr owns it; a loss wrapper may sit between), or NULL

    def __dealloc__(self):
        if self.ptr is not NULL:
            udt_transport_destroy(self.ptr)
            self.ptr = NULL

    def close(self):
        """Release the socket (or queue pair) now; one an Engine took is the Engine's to close."""
        if self.ptr is not NULL:
            udt_transport_destroy(self.ptr)
            self.ptr = NULL
            self.udp_ptr = NULL

    @staticmethod
    def udp(str bind_address, int port, uint32_t socket_buffer_bytes):
        cdef udt_error error
        cdef Transport t = Transport.__new__(Transport)
        encoded = bind_address.encode()
        cdef const char *address = encoded
        memset(&error, 0, sizeof(error))
        t.ptr = udt_udp_open(address, <uint16_t>port, socket_buffer_bytes, &error)
        if t.ptr is NULL:
            raise exception_from(&error)
        t.udp_ptr = t.ptr
        return t

    @staticmethod
    def adopt(object capsule):
        """Own a transport another extension opened (ud_transport._verbs: VerbsTransport.detach()).
        A PyCapsule carrying the struct udt_transport * is the hand-over rather than a Cython
        subclass across modules: the engine already drives every transport through the vtable
        in transport.h, so _native needs no verbs symbol, header or library, and the capsule's
        name check refuses anything else. Renaming the capsule marks it taken, so its destructor
        (in _verbs) destroys only a transport nobody adopted."""
        cdef Transport t = Transport.__new__(Transport)
        cdef udt_transport *ptr = <udt_transport *>PyCapsule_GetPointer(capsule, UDT_TRANSPORT_CAPSULE)
        PyCapsule_SetName(capsule, UDT_TRANSPORT_CAPSULE_ADOPTED)
        t.ptr = ptr
        return t

    def inject_loss(self, int kind, double loss=0.0, double good_to_bad=0.0, double bad_to_good=0.0,
                    double loss_in_good=0.0, double loss_in_bad=0.0, uint64_t seed=0):
        """Wrap this transport's receive path in a seeded loss model."""
        cdef udt_loss_model model
        self._check_open()
        model.kind = kind
        model.loss = loss
        model.good_to_bad = good_to_bad
        model.bad_to_good = bad_to_good
        model.loss_in_good = loss_in_good
        model.loss_in_bad = loss_in_bad
        model.seed = seed
        wrapped = udt_lossy_wrap(self.ptr, &model)
        if wrapped is NULL:
            raise MemoryError("cannot allocate the loss-injection wrapper")
        self.ptr = wrapped

    def _check_open(self):
        if self.ptr is NULL:
            raise ValueError("transport already handed to an engine or closed")

    @property
    def address(self):
        self._check_open()
        return bytes(self.ptr.address[:self.ptr.address_bytes])

    @property
    def max_datagram_bytes(self):
        self._check_open()
        return self.ptr.max_datagram_bytes

    # ---- UDP only (0, "" or an error on other transports) ----
    cdef udt_transport *_udp(self) except NULL:
        self._check_open()
        if self.udp_ptr is NULL:
            raise ValueError("not a UDP transport")
        return self.udp_ptr

    @property
    def udp_features(self):
        """UDP_GSO | UDP_GRO | UDP_RCVBUF_FORCED | UDP_GSO_REFUSED bits in effect; 0 if not UDP."""
        self._check_open()
        return udt_udp_features(self.udp_ptr) if self.udp_ptr is not NULL else 0

    @property
    def receive_buffer_bytes(self):
        """SO_RCVBUF as the kernel granted it (twice what was asked, capped by net.core.rmem_max
        unless UDP_RCVBUF_FORCED); 0 if not UDP."""
        self._check_open()
        return udt_udp_receive_buffer_bytes(self.udp_ptr) if self.udp_ptr is not NULL else 0

    @property
    def send_buffer_bytes(self):
        self._check_open()
        return udt_udp_send_buffer_bytes(self.udp_ptr) if self.udp_ptr is not NULL else 0

    def describe(self):
        """One line: GSO/GRO state, buffers granted and asked, largest datagram ("" if not UDP)."""
        cdef char text[256]
        self._check_open()
        if self.udp_ptr is NULL:
            return ""
        udt_udp_describe(self.udp_ptr, text, sizeof(text))
        return text.decode(errors="replace")

    def disable(self, uint32_t features):
        """Turn UDP_GSO and/or UDP_GRO off (to measure or test the plain path)."""
        if udt_udp_disable(self._udp(), features) != 0:
            raise ValueError("not a UDP transport")

    def udp_counters(self):
        """sendmmsg/recvmmsg and GSO/GRO counters since the transport opened."""
        cdef udt_udp_counters_struct counters
        udt_udp_counters(self._udp(), &counters)
        return counters


COLLECTIVE_ALLREDUCE = UDT_ALLREDUCE
COLLECTIVE_REDUCE_SCATTER = UDT_REDUCE_SCATTER
COLLECTIVE_ALL_GATHER = UDT_ALL_GATHER
COLLECTIVE_BROADCAST = UDT_BROADCAST
COLLECTIVE_AGREE = UDT_AGREE
COLLECTIVE_ALL_TO_ALL = UDT_ALL_TO_ALL
COLLECTIVE_SCATTER = UDT_SCATTER
COLLECTIVE_GATHER = UDT_GATHER
ALGORITHM_RING = UDT_ALGORITHM_RING
ALGORITHM_DIRECT = UDT_ALGORITHM_DIRECT

ENGINE_OPTION_NAMES = ("chunk_bytes", "window_bytes", "end_repeats", "credit_refresh_us", "reorder_grace_us",
                       "busy_poll_us", "idle_close_us", "agree_resend_us", "join_timeout_ms", "in_place_min_bytes")


cdef udt_engine_options engine_options(dict values) except *:
    """Options by field name; a missing or unknown name is an error, not a silent default."""
    cdef udt_engine_options options
    names = set(values)
    if names != set(ENGINE_OPTION_NAMES):
        raise TypeError(f"engine options must be exactly {ENGINE_OPTION_NAMES}; "
                        f"missing {sorted(set(ENGINE_OPTION_NAMES) - names)}, unknown {sorted(names - set(ENGINE_OPTION_NAMES))}")
    options.chunk_bytes = values["chunk_bytes"]
    options.window_bytes = values["window_bytes"]
    options.end_repeats = values["end_repeats"]
    options.credit_refresh_us = values["credit_refresh_us"]
    options.reorder_grace_us = values["reorder_grace_us"]
    options.busy_poll_us = values["busy_poll_us"]
    options.idle_close_us = values["idle_close_us"]
    options.agree_resend_us = values["agree_resend_us"]
    options.join_timeout_ms = values["join_timeout_ms"]
    options.in_place_min_bytes = values["in_place_min_bytes"]
    return options


cdef void fill_args(udt_collective_args *args, int collective, int algorithm, uintptr_t input, uintptr_t output,
                    uint64_t count, int dtype, int op, int estimator, uint32_t root, uint32_t agree_value,
                    double loss_budget, double deadline_s, uintptr_t chunk_mask, uint64_t chunk_mask_bytes,
                    uint32_t copies, uint32_t direct_output=0, uint32_t layout_salt=0, uint32_t write_on_budget_miss=0,
                    uint32_t reduce_in_rank_order=0, uintptr_t piece_counts=0):
    args.collective = collective
    args.algorithm = algorithm
    args.input = <const void *>input
    args.output = <void *>output
    args.count = count
    args.dtype = dtype
    args.op = op
    args.estimator = estimator
    args.root = root
    args.agree_value = agree_value
    args.loss_budget = loss_budget
    args.deadline_s = deadline_s
    args.chunk_mask = <uint8_t *>chunk_mask
    args.chunk_mask_bytes = chunk_mask_bytes
    args.copies = copies
    args.direct_output = direct_output
    args.layout_salt = layout_salt
    args.write_on_budget_miss = write_on_budget_miss
    args.reduce_in_rank_order = reduce_in_rank_order
    args.piece_counts = <const uint64_t *>piece_counts


cdef int run_signal_handlers(void *arg) noexcept nogil:
    """The engine's wait hook (udt_comm_set_wait_hook) while a call holds the main thread: the
    process's signal handlers run here, and one that raises (Ctrl-C's KeyboardInterrupt) ends
    the call, its output as it was; run() raises what it raised."""
    with gil:
        return (<Engine>arg).handle_signals()


cdef class Engine:
    """One rank's collective engine; owns its transport."""
    cdef udt_comm *comm
    cdef udt_transport *udp_ptr  # the UDP transport the engine owns (inside a loss wrapper, maybe), or NULL
    cdef readonly uint32_t rank, world_size, chunk_bytes
    cdef object signal_error  # what a signal's handler raised during the call (run_signal_handlers)

    cdef int handle_signals(self) noexcept:
        try:
            PyErr_CheckSignals()
        except BaseException as error:
            self.signal_error = error
            return 1
        return 0

    def __cinit__(self, Transport transport, uint32_t rank, uint32_t world_size, uint64_t session_id, dict options):
        cdef udt_error error
        cdef udt_engine_options native_options = engine_options(options)
        transport._check_open()
        memset(&error, 0, sizeof(error))
        self.comm = udt_comm_create(transport.ptr, rank, world_size, session_id, &native_options, &error)
        if self.comm is NULL:
            raise exception_from(&error, ValueError)
        self.udp_ptr = transport.udp_ptr
        transport.ptr = NULL  # the engine owns it now
        transport.udp_ptr = NULL
        self.rank = rank
        self.world_size = world_size
        self.chunk_bytes = native_options.chunk_bytes

    def __dealloc__(self):
        self.close()

    def close(self):
        if self.comm is not NULL:
            udt_comm_destroy(self.comm)
            self.comm = NULL
            self.udp_ptr = NULL

    def udp_counters(self):
        """Its UDP transport's counters since it opened (Transport.udp_counters), ICMP errors read
        and forged ones dropped among them; {} on other transports."""
        cdef udt_udp_counters_struct counters
        if self.comm is NULL:
            raise ValueError("engine is closed")
        if self.udp_ptr is NULL:
            return {}
        udt_udp_counters(self.udp_ptr, &counters)
        return counters

    def interrupt(self):
        """End the call another thread runs on this engine (within 100 ms), and every later one,
        as STATUS_INTERRUPTED (engine.h: udt_comm_interrupt). Holds the GIL, as close() does, so
        the two cannot cross."""
        if self.comm is not NULL:
            udt_comm_interrupt(self.comm)

    def set_peers(self, bytes addresses, uint32_t address_bytes):
        if self.comm is NULL:
            raise ValueError("engine is closed")
        cdef const uint8_t *data = addresses
        if udt_comm_set_peers(self.comm, data, len(addresses), address_bytes) < 0:
            raise exception_from(udt_comm_error(self.comm), ValueError)

    @property
    def sequence(self):
        """The sequence number of the last call started (udt_comm_sequence): one more per call,
        on every rank alike."""
        if self.comm is NULL:
            raise ValueError("engine is closed")
        return udt_comm_sequence(self.comm)

    def set_sequence(self, uint32_t sequence):
        """Tests only: make the next call's sequence number sequence + 1 (modulo 2**32),
        the same on every rank, to exercise the wrap without 2**32 calls."""
        if self.comm is NULL:
            raise ValueError("engine is closed")
        if udt_comm_set_sequence(self.comm, sequence) != 0:
            raise RuntimeError("cannot set the sequence number during a call")

    def run(self, *, int collective, int algorithm, double deadline_s, uintptr_t input=0, uintptr_t output=0,
            uint64_t count=0, int dtype=0, int op=0, int estimator=0, uint32_t root=0, uint32_t agree_value=0,
            double loss_budget=0.0, uintptr_t chunk_mask=0, uint64_t chunk_mask_bytes=0, uint32_t copies=1,
            uint32_t direct_output=0, uint32_t layout_salt=0, uint32_t write_on_budget_miss=0,
            uint32_t reduce_in_rank_order=0, uintptr_t piece_counts=0, bint signals=False):
        """Run one collective, its arguments named (struct udt_collective_args). Returns (status, stats dict, NativeError or None when
        status is STATUS_OK). The output (and the chunk mask, if given: see
        chunk_mask_bytes) holds the result only when status is STATUS_OK; otherwise it
        holds what it held before (an allreduce in place is put back: engine.h), except
        that with direct_output an all_gather, broadcast or all_to_all may leave it partly written.
        layout_salt: folded into the layout every rank must share (engine.h).
        reduce_in_rank_order: an allreduce's owners sum each element in rank order, in double
        precision, rounding once (engine.h; float32 or float64, direct, loss budget 0).
        piece_counts: an all_to_all's pieces, each of its own size: the address of 2 * world_size
        uint64 element counts, sent to each rank then taken from each (engine.h), kept alive
        by the caller through the call.
        signals: the caller is the main thread, where Python runs signal handlers: a call that
        waits runs them every UDT_WAIT_HOOK_INTERVAL_MS, and one that raises (KeyboardInterrupt)
        ends the call, its output as it was, and is raised here."""
        if self.comm is NULL:
            raise ValueError("engine is closed")
        cdef udt_collective_args args
        cdef udt_collective_stats stats
        cdef int status
        fill_args(&args, collective, algorithm, input, output, count, dtype, op, estimator, root, agree_value, loss_budget,
                  deadline_s, chunk_mask, chunk_mask_bytes, copies, direct_output, layout_salt, write_on_budget_miss,
                  reduce_in_rank_order, piece_counts)
        if signals:
            udt_comm_set_wait_hook(self.comm, run_signal_handlers, <void *>self)
        else:
            udt_comm_set_wait_hook(self.comm, NULL, NULL)
        with nogil:
            status = udt_collective(self.comm, &args, &stats)
        if self.signal_error is not None:
            error, self.signal_error = self.signal_error, None
            raise error
        return status, stats, native_error(udt_comm_error(self.comm)) if status != UDT_OK else None


def run_striped(list engines, list inputs, list outputs, list counts, list weights, *, int collective, int algorithm,
                int dtype, int op, int estimator, uint32_t root, double loss_budget, double deadline_s,
                uint32_t copies=1, uint32_t write_on_budget_miss=0, bint signals=False):
    """Run one collective as len(engines) stripes at once, stripe k being counts[k] elements
    at inputs[k] / outputs[k] on engines[k] (engine.h: udt_collective_striped). Returns
    (status, merged stats dict, index of the stripe whose status it is, NativeError or None
    when status is STATUS_OK). Every stripe's output holds its result only on STATUS_OK.
    signals: as Engine.run's, for stripe 0, which runs on the calling thread; its interruption
    ends the other stripes too, and the handler's exception is raised here. Heard only while
    stripe 0 runs: once it has its verdict the thread waits for the other stripes unhooked."""
    cdef uint32_t n = len(engines)
    if not 1 <= n <= UDT_MAX_STRIPES or not len(inputs) == len(outputs) == len(counts) == len(weights) == n:
        raise ValueError(f"1 to {UDT_MAX_STRIPES} stripes, with an input, output, count and weight each")
    cdef udt_comm *comms[UDT_MAX_STRIPES]
    cdef udt_collective_args args[UDT_MAX_STRIPES]
    cdef udt_collective_stats stats[UDT_MAX_STRIPES]
    cdef double shares[UDT_MAX_STRIPES]
    cdef udt_collective_stats merged
    cdef uint32_t failed = 0
    cdef int status
    cdef Engine engine
    for k in range(n):
        engine = engines[k]
        if engine.comm is NULL:
            raise ValueError("engine is closed")
        comms[k] = engine.comm
        shares[k] = weights[k]
        fill_args(&args[k], collective, algorithm, inputs[k], outputs[k], counts[k], dtype, op, estimator, root, 0,
                  loss_budget, deadline_s, 0, 0, copies, 0, 0, write_on_budget_miss)
        udt_comm_set_wait_hook(engine.comm, NULL, NULL)  # stripes 1.. run on threads of their own
    cdef Engine first = engines[0]
    if signals:
        udt_comm_set_wait_hook(first.comm, run_signal_handlers, <void *>first)
    with nogil:
        status = udt_collective_striped(comms, args, stats, shares, n, &merged, &failed)
    if first.signal_error is not None:
        error, first.signal_error = first.signal_error, None
        raise error
    engine = engines[failed]
    return status, merged, failed, native_error(udt_comm_error(engine.comm)) if status != UDT_OK else None


# Pure helpers, exported so tests and the simulator check the C arithmetic itself.
def chunk_mask_bytes(int collective, int algorithm, uint64_t count, int dtype, uint32_t rank, uint32_t world_size,
                     uint32_t chunk_bytes):
    """Bytes of the chunk mask a call can fill (0: none for this collective and algorithm):
    reduce_scatter, world_size rows of this rank's shard's chunks (1: that rank's contribution
    reached the chunk; direct schedule or two ranks); all_gather, broadcast, allreduce,
    all_to_all, scatter, gather, one per chunk of the tensor (the output; 1: fresh, or outside
    this rank's result: a scatter's other blocks, a gather's off its root)."""
    return udt_chunk_mask_bytes(collective, algorithm, count, dtype, rank, world_size, chunk_bytes)


def _facts_of(int collective):
    cdef const udt_collective_facts_struct *f = udt_collective_facts(collective)
    return {"name": f.name.decode(), "moves_data": bool(f.moves_data), "reduces": bool(f.reduces),
            "gathers": bool(f.gathers), "input_is_shard": bool(f.input_is_shard),
            "output_is_shard": bool(f.output_is_shard), "sends_input": bool(f.sends_input),
            "holds_own_block": bool(f.holds_own_block), "root_holds_all": bool(f.root_holds_all),
            "rotates": bool(f.rotates), "may_sum_in_place": bool(f.may_sum_in_place),
            "equal_blocks": bool(f.equal_blocks), "mask_by_sender": bool(f.mask_by_sender),
            "wants": ("all", "own block", "all at the root")[f.wants]}


# What each collective is (native/schedule.c's one table), by its code: the Python layer reads
# these, never a copy of them.
COLLECTIVE_FACTS = {code: _facts_of(code) for code in range(UDT_COLLECTIVE_COUNT)}


def budget_missed(double reduce_fraction, double gather_fraction, double loss_budget):
    """Whether agreed fractions miss `loss_budget`: the engine's rule (udt_budget_missed, engine.h),
    the one definition every layer asks."""
    return bool(udt_budget_missed(reduce_fraction, gather_fraction, loss_budget))


def wire_element_bytes(int dtype):
    """Bytes of one element of a dtype (a DTYPE_* code) in the caller's tensor and on the wire."""
    if not 0 <= dtype < UDT_DTYPE_COUNT:
        raise ValueError(f"no dtype with code {dtype}")
    return udt_wire_elem_bytes(dtype)


def block_start(uint64_t count, uint32_t world_size, uint32_t block):
    return udt_block_start(count, world_size, block)


def schedule(int collective, int algorithm, uint32_t rank, uint32_t world_size, uint32_t root=0, uint32_t rotation=0):
    """One rank's schedule as (summary dict, list of step dicts), from the C builders."""
    cdef udt_schedule summary
    cdef uint32_t count = udt_schedule_steps(collective, algorithm, world_size)
    cdef udt_step *steps = <udt_step *>malloc((count + 1) * sizeof(udt_step))
    cdef uint32_t *scratch = <uint32_t *>malloc((world_size + 1) * sizeof(uint32_t))
    try:
        if steps is NULL or scratch is NULL:
            raise MemoryError()
        if udt_schedule_build(collective, algorithm, rank, world_size, root, rotation, &summary, steps, scratch) != 0:
            raise ValueError(f"no schedule for collective {collective}, algorithm {algorithm}, rank {rank} of {world_size}, root {root}")
        return summary, [steps[i] for i in range(summary.steps)]
    finally:
        free(steps)
        free(scratch)

def float_to_half_bits(float value):
    return udt_float_to_half(value)

def half_bits_to_float(uint16_t bits):
    return udt_half_to_float(bits)

def float_to_bfloat16_bits(float value):
    return udt_float_to_bfloat16(value)

def copy_uncached(unsigned char[::1] dst, const unsigned char[::1] src):
    """dst[:] = src with the engine's cache-bypassing copy (for tests of its edges)."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError(f"copy_uncached: {src.shape[0]} bytes into {dst.shape[0]}")
    if dst.shape[0]:
        with nogil:
            udt_copy_uncached(&dst[0], &src[0], dst.shape[0])
            udt_uncached_fence()


# ---- the simulator: many engines in one process on a virtual clock ----
include "simulator.pxi"
