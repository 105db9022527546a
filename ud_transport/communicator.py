"""A Communicator: one rank's handle on a group of ranks."""
import itertools
import logging
import os
import struct
import threading

from . import _native, rendezvous, transports
from .deadline import DeadlineEstimator
from .errors import LayoutMismatch, LossBudgetExceeded, PeerTimeout, TransportError
from .stats import AllreduceStats
from .tensors import estimator_code, op_code, view_of

log = logging.getLogger("ud_transport")

# Communicators are created in the same order on every rank, so a per-process
# counter names each one's keys in the shared store identically everywhere.
_creation_counter = itertools.count()


class Communicator:
    def __init__(self, rank, world_size, store, transport, options):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if world_size > _native.MAX_WORLD_SIZE:
            raise ValueError(f"world_size {world_size} exceeds the supported maximum {_native.MAX_WORLD_SIZE}")
        self.rank = rank
        self.world_size = world_size
        self.store = store  # the torch Store of the rendezvous, free for the caller's own use
        self.options = options
        self.transport_name = transports.choose(transport)
        self._lock = threading.Lock()
        self._deadlines = DeadlineEstimator(options.deadline_multiplier, options.deadline_floor_s, options.deadline_cap_s)
        self._engine = None
        prefix = f"ud_transport/comm{next(_creation_counter)}"
        timeout = options.store_timeout_s
        bind = options.bind_address or rendezvous.local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        session_id = rendezvous.agree_session_id(store, prefix, rank, timeout)
        endpoint = transports.open_transport(self.transport_name, bind, options, rank, session_id)
        # Everyone publishes its address and the largest datagram it can take;
        # all ranks then use the same chunk size, which fits everyone's MTU.
        mine = struct.pack("<I", endpoint.max_datagram_bytes) + endpoint.address
        everyone = rendezvous.exchange(store, f"{prefix}/address", rank, world_size, mine, timeout)
        if len({len(v) for v in everyone}) != 1:
            kinds = sorted({len(v) - 4 for v in everyone})
            raise TransportError(f"ranks opened different transports (address sizes {kinds} bytes): "
                                 "set the same transport (UD_TRANSPORT) on every rank")
        largest_payload = min(struct.unpack_from("<I", v)[0] for v in everyone) - _native.HEADER_BYTES
        chunk_bytes = options.chunk_bytes or largest_payload
        if chunk_bytes > largest_payload:
            raise ValueError(f"chunk_bytes {chunk_bytes} exceeds what one datagram carries here ({largest_payload})")
        chunk_bytes -= chunk_bytes % 8 if chunk_bytes >= 8 else 0  # whole elements of every dtype
        self.address = endpoint.address
        try:
            self._engine = _native.RingEngine(endpoint, rank, world_size, session_id, chunk_bytes, options.window_bytes,
                                              options.end_repeats, options.credit_refresh_us, options.reorder_grace_us,
                                              options.idle_close_us, options.busy_poll_us)
            self._engine.set_peers(b"".join(v[4:] for v in everyone), len(self.address))
        except (OSError, ValueError) as error:
            self.close()
            raise TransportError(str(error)) from error
        self.chunk_bytes = chunk_bytes
        log.info("rank %d/%d ready on %s, chunk %d bytes", rank, world_size, self.transport_name, chunk_bytes)

    # -- collectives ------------------------------------------------------

    def allreduce(self, tensor, *, op="sum", loss_budget=None, deadline=None, estimator=None):
        """Reduce `tensor` across ranks in place and return AllreduceStats.

        Lost datagrams are not retransmitted: the result is an unbiased
        estimate (see README). Raises LossBudgetExceeded if more than
        `loss_budget` of the contributions are missing at the deadline, and
        PeerTimeout if a rank was silent; the tensor is untouched then."""
        view = view_of(tensor)
        op_value = op_code(op)
        estimator_value = estimator_code(estimator or self.options.estimator)
        budget = self.options.default_loss_budget if loss_budget is None else float(loss_budget)
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"loss_budget must be in [0, 1], got {loss_budget!r}")
        if deadline is not None and not deadline > 0:
            raise ValueError(f"deadline must be a positive number of seconds, got {deadline!r}")
        with self._lock:
            if self._engine is None:
                raise TransportError("communicator is closed")
            deadline_s = float(deadline) if deadline is not None else self._deadlines.deadline_s(view.nbytes)
            status, raw, message = self._engine.allreduce(view.address, view.count, view.dtype_code, op_value,
                                                          estimator_value, budget, deadline_s)
        stats = AllreduceStats.from_native(raw, self.transport_name)
        if status == _native.STATUS_OK:
            if not stats.deadline_expired:
                self._deadlines.record(view.nbytes, stats.elapsed_s)
            return stats
        if status == _native.STATUS_LOSS_BUDGET:
            raise LossBudgetExceeded(f"rank {self.rank}: {message}", stats)
        if status == _native.STATUS_PEER_TIMEOUT:
            raise PeerTimeout(f"rank {self.rank}: {message}", stats.silent_rank, stats)
        if status == _native.STATUS_LAYOUT_MISMATCH:
            raise LayoutMismatch(f"rank {self.rank}: {message}", raw["mismatched_rank"], stats)
        if status == _native.STATUS_INVALID_ARGUMENT:
            raise ValueError(message)
        raise TransportError(f"rank {self.rank}: {message}")

    # -- lifetime ---------------------------------------------------------

    def close(self):
        """Release the socket and buffers. Safe to call more than once."""
        with self._lock:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    @property
    def closed(self):
        return self._engine is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else self.transport_name
        return f"<Communicator rank={self.rank} world_size={self.world_size} {state}>"
