"""A Communicator: one rank's handle on a group of ranks."""
import inspect
import itertools
import logging
import operator
import os
import struct
import threading

from . import _native, algorithms, collectives, membership, rendezvous, seats, staging, stripe_choice, transports
from ._version import __version__
from .deadline import DeadlineEstimator
from .errors import LayoutMismatch, LossBudgetExceeded, PeerTimeout, TransportError
from .options import STRIPE_MIN_BYTES, check_copies, check_stripes, credit_window_bytes
from .stats import CollectiveStats
from .tensors import DTYPE_CODES, estimator_code, memory_meets, op_code, view_of

log = logging.getLogger("ud_transport")

ON_MISS = ("raise", "return")  # what a call that misses its loss budget does (see on_miss)



def agree_number(value, what="agree_value"):
    """`value` as the 32-bit number a call's verdict agrees (ValueError for anything else; a bool
    is 0 or 1)."""
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer in [0, 2**32), got {value!r}") from None
    if not 0 <= number < 2**32:
        raise ValueError(f"{what} must be an integer in [0, 2**32), got {value!r}")
    return number


def _seconds(deadline):
    """None, or a positive number of seconds from a number or a datetime.timedelta."""
    if deadline is None:
        return None
    seconds = deadline.total_seconds() if hasattr(deadline, "total_seconds") else deadline
    try:
        seconds = float(seconds)
    except (TypeError, ValueError):
        raise TypeError(f"deadline must be seconds or a datetime.timedelta, got {deadline!r}") from None
    if not 0 < seconds <= 1e6:
        raise ValueError(f"deadline must be a positive number of seconds (at most 1e6), got {deadline!r}")
    return seconds


# Shared sections of the collectives' docstrings (filled in by _documented).
_CALL_PARAMETERS = """loss_budget : float in [0, 1], optional
            The most of the result that may be missing: the fraction of contributions that did not
            reach their owners, and the fraction of some rank's result not refreshed. None takes
            ``Options.default_loss_budget`` (0.1). 0 asks for an exact call (it fails rather than
            estimate).
        deadline : float or datetime.timedelta, optional
            Seconds the data phase may last, counted from when every rank is in the call. None
            adapts: 4x what recent calls of this size took, between 1 s and
            ``Options.deadline_cap_s``.
        {algorithm}copies : int, optional
            Times each data datagram is sent, 1 to 4 (None takes ``Options.copies``, 1): the
            copies follow each step, so a chunk is lost only if every copy is (i.i.d. loss p
            becomes p**copies) for copies times the bytes. Redundancy, not retransmission:
            nothing waits for a loss to be noticed.
        on_miss : {"raise", "return"}, default "raise"
            What a call that misses its budget does: raise LossBudgetExceeded (the tensor keeps
            its values), or write its estimate anyway and return with ``stats.budget_missed``
            set, for a caller with its own policy for a miss (every rank alike: every rank must
            pass the same)."""
_CALL_RAISES = """Returns
        -------
        CollectiveStats
            The agreed fractions (``delivered_fraction``, ``reduce_fraction``,
            ``gather_fraction``), times and per-call counters, the same on every rank.

        Raises
        ------
        LossBudgetExceeded
            More than ``loss_budget`` was missing at the deadline (``.stats`` says how much),
            unless ``on_miss="return"``.
        PeerTimeout
            A rank did not join, went silent, or is gone (``.rank`` names it).
        LayoutMismatch
            Ranks called with another collective, size, dtype, op or root (``.rank``).
        TransportError
            The transport failed (``.call``, ``.errno``, ``.object`` name a failed system call),
            or the communicator is closed.
        TypeError, ValueError
            Bad arguments, before anything is sent.

        Every rank raises the same error, and the caller's tensors keep their values on any error."""


_ALGORITHM_PARAMETER = """algorithm : {"auto", "ring", "direct"}, optional
            The schedule; None takes ``Options.algorithm``. Every rank must pass the same.
        """


def _documented(method):
    """Fill in the parameters and returns every collective shares (`algorithm` only where the
    method takes one: all_to_all, scatter and gather have one schedule)."""
    takes_algorithm = "algorithm" in inspect.signature(method).parameters
    parameters = _CALL_PARAMETERS.replace("{algorithm}", _ALGORITHM_PARAMETER if takes_algorithm else "")
    method.__doc__ = method.__doc__.replace("{call_parameters}", parameters).replace("{call_raises}", _CALL_RAISES)
    return method


# Communicators are created in the same order on every rank, so a per-process
# counter names each one's keys in the shared store identically everywhere.
_creation_counter = itertools.count()


class Communicator:
    """One rank's endpoint of a group of ranks that run collectives over unreliable datagrams.

    Usually made by ``ud_transport.init()``. Collectives are serialized per communicator and
    run in C with the GIL released; lost datagrams are never retransmitted (see docs/semantics.md,
    "When a datagram is lost").

    Parameters
    ----------
    rank, world_size : int
        This rank and the number of ranks, 0 <= rank < world_size <= 4096.
    store : torch.distributed.Store
        Where the ranks meet: addresses, the session id and an identity check are exchanged.
    transport : {"auto", "udp", "verbs"}
        "auto" picks verbs when an RDMA port is active, else UDP (``UD_TRANSPORT`` overrides).
    options : Options
        From ``ud_transport.options.build(...)``.
    name : str, optional
        Keys this communicator's rendezvous in `store`. Without one, communicators are numbered
        in creation order (the same on every rank only if every rank creates the same ones:
        name those that differ).

    Attributes
    ----------
    family : str
        `name`, or the number it was given without one; kept by the communicators ``shrink``
        and ``grow`` make from this one, and what a newcomer names to ``join`` them.
    stripes : int
        The sockets and threads a large allreduce or broadcast runs on: ``options.stripes``, or
        what "auto" agreed on at the rendezvous (the same on every rank; 1 on verbs).
    ranks_on_this_machine : int
        Ranks of this communicator on this rank's machine (its own included; more where
        torchrun's LOCAL_WORLD_SIZE says so), from the rendezvous: they share its cores and cache.
    core_share : int
        This rank's fair share of its machine's CPUs, in whole CPUs (0 where the ranks there
        outnumber them): ``Options.busy_poll_us=-1`` spins only where it is at least the stripes.
    layout_mismatches : int
        Calls that ended in LayoutMismatch. Every rank of such a call raises it, so the count is
        the same on every rank (unless a rank could not learn the call's outcome and raised
        PeerTimeout at its deadline: see the README's limits): state kept per rank across calls
        (``ud_transport.exact``'s backoff) is reset by it where ranks whose calls differed may
        have updated it differently.

    Raises
    ------
    TransportError
        The rendezvous failed within ``options.store_timeout_s`` (a rank missing or disagreeing),
        or the transport could not open (``.call``/``.errno``/``.object`` say which call failed).
    ValueError
        A rank outside the world, or a world larger than supported.

    Examples
    --------
    >>> comm = ud_transport.Communicator(rank, 4, store, "udp", options.build())  # doctest: +SKIP
    >>> with comm:                                                                 # doctest: +SKIP
    ...     stats = comm.allreduce(gradient, loss_budget=0.1)
    """

    def __init__(self, rank, world_size, store, transport, options, *, name=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if world_size > _native.MAX_WORLD_SIZE:
            raise ValueError(f"world_size {world_size} exceeds the supported maximum {_native.MAX_WORLD_SIZE}")
        self.rank = rank
        self.world_size = world_size
        self.store = store  # the torch Store of the rendezvous, free for the caller's own use
        self.options = options
        self.transport_name = transports.choose(transport)
        stripes = check_stripes(options.stripes, self.transport_name)
        self._lock = threading.Lock()
        self._deadlines = DeadlineEstimator(options.deadline_multiplier, options.deadline_floor_s, options.deadline_cap_s)
        self._engine = None
        self._stripes = []  # this rank's engines, one per stripe; the first is self._engine
        self._overflow_warned = False
        self._calling = None  # the thread running a call on this communicator (its ident), else None
        self._close_after_call = False  # close() came from a signal's handler inside that call
        self.family = name or f"comm{next(_creation_counter)}"  # kept by the groups shrink() and grow() make
        self._grows_tried = 0  # grows tried on this group, the same count on every rank: names each grow's keys
        self.layout_mismatches = 0
        prefix = f"ud_transport/{self.family}"
        timeout = options.store_timeout_s
        bind = options.bind_address or rendezvous.local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        identity = rendezvous.identity_record(world_size, __version__, _native.WIRE_VERSION, stripes,
                                              self.transport_name)
        # the round the ranks met in: its keys are this meeting's alone (a group made again on the
        # same store, or after a rank's failed try, does not read the session or addresses of another)
        prefix = rendezvous.meet(store, prefix, rank, world_size, identity, timeout)
        machines = self._exchange_machines(prefix, timeout)
        if stripes == "auto":  # every rank takes the same count from the same records; verbs runs one
            stripes = stripe_choice.agreed_stripes(machines) if self.transport_name == "udp" else 1
        self.ranks_on_this_machine = stripe_choice.ranks_sharing_machine(machines, rank)
        self.core_share = stripe_choice.core_shares(machines)[rank]  # whole CPUs: whether its engine may spin
        self.stripes = stripes  # sockets and threads a large allreduce or broadcast runs on
        session_id = rendezvous.agree_session_id(store, prefix, rank, timeout)
        self.session_id = session_id  # drawn by rank 0; every datagram of this communicator carries it
        endpoints = []
        try:
            self._open_stripes(endpoints, bind, options, prefix, timeout, stripes)
        except BaseException:
            for engine in self._stripes:
                engine.close()
            for endpoint in endpoints:
                endpoint.close()  # the sockets no engine took (an engine's own are closed above)
            self._stripes = []
            raise
        self._engine = self._stripes[0]
        log.info("rank %d/%d ready on %s, chunk %d bytes, window %d bytes%s%s", rank, world_size, self.transport_name,
                 self.chunk_bytes, self.window_bytes, f" ({self.transport_description})" if self.transport_description else "",
                 f", {stripes} stripes (window each)" if stripes > 1 else "")

    def _exchange_machines(self, prefix, timeout):
        """Every rank's machine and CPUs (stripe_choice.Record), in rank order: what stripes="auto"
        and the in-place threshold (a share of the cache the ranks on one machine split) go by."""
        mine = stripe_choice.encode(stripe_choice.this_process())
        everyone = rendezvous.exchange(self.store, f"{prefix}/cores", self.rank, self.world_size, mine, timeout)
        return [stripe_choice.decode(record) for record in everyone]

    def _open_stripes(self, endpoints, bind, options, prefix, timeout, stripes):
        """Open this rank's sockets (one per stripe) into `endpoints`, meet the other ranks' and
        make an engine for each into self._stripes; sets chunk_bytes, window_bytes and the rest."""
        rank, world_size, store = self.rank, self.world_size, self.store
        # Everyone publishes each of its sockets' address and the largest datagram it can take;
        # all ranks then use the same chunk size, which fits everyone's MTU.
        addresses = []
        for stripe in range(stripes):
            endpoint = transports.open_transport(self.transport_name, bind, options, rank, self.session_id, stripe)
            endpoints.append(endpoint)
            mine = struct.pack("<I", endpoint.max_datagram_bytes) + endpoint.address
            key = f"{prefix}/address" + (f"/{stripe}" if stripe else "")
            addresses.append(rendezvous.exchange(store, key, rank, world_size, mine, timeout))
        if len({len(v) for everyone in addresses for v in everyone}) != 1:
            kinds = sorted({len(v) - 4 for everyone in addresses for v in everyone})
            raise TransportError(f"ranks opened different transports (address sizes {kinds} bytes): "
                                 "set the same transport (UD_TRANSPORT) on every rank")
        largest_payload = min(struct.unpack_from("<I", v)[0] for everyone in addresses for v in everyone) \
            - _native.HEADER_BYTES
        chunk_bytes = options.chunk_bytes or largest_payload
        if chunk_bytes > largest_payload:
            raise ValueError(f"chunk_bytes {chunk_bytes} exceeds what one datagram carries here ({largest_payload})")
        chunk_bytes -= chunk_bytes % 8 if chunk_bytes >= 8 else 0  # whole elements of every dtype
        endpoint = endpoints[0]
        self.address = endpoint.address
        # The window must fit what the kernel granted, not what was asked (UDP; 0 for verbs).
        self.receive_buffer_bytes = endpoint.receive_buffer_bytes
        self.transport_description = endpoint.describe()
        # Stripes share the window: the receive ring in front of a rank is one for all its sockets
        # (each stripe still gets the engine's floor of 16 chunks).
        self.window_bytes = max(credit_window_bytes(options.window_bytes, chunk_bytes, self.transport_name) // stripes, 1)
        if self.receive_buffer_bytes:
            forced = bool(endpoint.udp_features & _native.UDP_RCVBUF_FORCED)
            self.window_bytes = transports.fit_window(self.window_bytes, self.receive_buffer_bytes,
                                                      options.socket_buffer_bytes, forced,
                                                      chunk_bytes + _native.HEADER_BYTES)
        try:
            for endpoint, everyone in zip(endpoints, addresses):
                engine = _native.Engine(endpoint, rank, world_size, self.session_id,
                                        options.engine_options(chunk_bytes, self.window_bytes, self.ranks_on_this_machine,
                                                               self.core_share, len(endpoints)))
                self._stripes.append(engine)
                engine.set_peers(b"".join(v[4:] for v in everyone), len(self.address))
        except (OSError, ValueError) as error:
            raise TransportError.caused_by(str(error), error) from error
        self.chunk_bytes = chunk_bytes

    # -- collectives ------------------------------------------------------

    def shard_range(self, count, rank=None):
        """Elements [start, stop) of `rank`'s shard when `count` elements are split over the ranks.

        Shards are as even as possible and equal when `count` divides by the world size.

        Parameters
        ----------
        count : int
            Elements of the full tensor.
        rank : int, optional
            Whose shard; None is this rank.

        Returns
        -------
        (int, int)
            start and stop.

        Examples
        --------
        >>> comm.shard_range(10)  # rank 1 of 4  # doctest: +SKIP
        (2, 5)
        """
        rank = self.rank if rank is None else rank
        return (_native.block_start(count, self.world_size, rank), _native.block_start(count, self.world_size, rank + 1))

    def chunk_elements(self, dtype):
        """Elements of `dtype` one datagram carries: the size of every chunk but a block's last.

        Parameters
        ----------
        dtype : str, numpy.dtype or torch.dtype

        Returns
        -------
        int

        Raises
        ------
        TypeError
            A dtype the collectives do not take.

        Examples
        --------
        >>> comm.chunk_elements("float32")  # 1472-byte payloads on an MTU 1500 path  # doctest: +SKIP
        357
        """
        name = str(dtype).replace("torch.", "")
        if name not in DTYPE_CODES:
            raise TypeError(f"unsupported dtype {dtype!r}: one of {', '.join(DTYPE_CODES)}")
        return self.chunk_bytes // _native.wire_element_bytes(DTYPE_CODES[name])

    def chunk_ranges(self, count, dtype, block=None):
        """The ``[start, stop)`` element range of every chunk of a `count`-element tensor, block by
        block (block b is rank b's shard), in the order of a chunk mask's entries.

        Parameters
        ----------
        count : int
        dtype : str, numpy.dtype or torch.dtype
        block : int, optional
            Only this block's chunks (a reduce_scatter mask's row); None: every block.

        Returns
        -------
        list of (int, int)

        Examples
        --------
        >>> for (start, stop), fresh in zip(comm.chunk_ranges(n, "float32"), mask):  # doctest: +SKIP
        ...     pass
        """
        starts, stops = self.chunk_bounds(count, dtype, block)
        return list(zip(starts.tolist(), stops.tolist()))

    def chunk_bounds(self, count, dtype, block=None):
        """``chunk_ranges`` as two arrays, for tensors of many chunks: every chunk's first element
        and the element past its last.

        Parameters
        ----------
        count : int
        dtype : str, numpy.dtype or torch.dtype
        block : int, optional
            Only this block's chunks; None: every block.

        Returns
        -------
        (numpy.ndarray, numpy.ndarray) of int64

        Examples
        --------
        >>> starts, stops = comm.chunk_bounds(n, "float32")  # doctest: +SKIP
        """
        import numpy as np

        step = self.chunk_elements(dtype)
        starts, stops = [], []
        for b in range(self.world_size) if block is None else [block]:
            start, stop = self.shard_range(count, b)
            first = np.arange(start, stop, step, dtype=np.int64)
            starts.append(first)
            stops.append(np.minimum(first + step, stop))
        return np.concatenate(starts), np.concatenate(stops)

    def chunk_mask(self, collective, tensor, *, algorithm=None, takes=None):
        """A zeroed mask for the `chunk_mask` argument of one call, of the shape that call fills.

        Parameters
        ----------
        collective : {"reduce_scatter", "all_gather", "broadcast", "all_to_all", "scatter", "gather"}
        tensor : numpy.ndarray or torch.Tensor
            The full tensor of the call (reduce_scatter's input, all_gather's, all_to_all's and
            gather's output, broadcast's and scatter's tensor).
        algorithm : {"ring", "direct", "auto"}, optional
            The call's algorithm (None: the default, as the call resolves it).
        takes : sequence of int, optional
            An ``all_to_all_pieces`` call's: the elements `tensor` (its output) takes from each
            rank; the mask has one entry per chunk of each piece, in rank order.

        Returns
        -------
        numpy.ndarray of uint8
            reduce_scatter: (world_size, chunks of this rank's shard); the others: (chunks of the
            tensor,).

        Raises
        ------
        ValueError
            No mask for this collective and algorithm (a ring reduce_scatter of more than two
            ranks sums contributions on the way, so a chunk's arrival does not name them).

        Examples
        --------
        >>> mask = comm.chunk_mask("reduce_scatter", grad, algorithm="direct")  # doctest: +SKIP
        """
        import numpy as np

        codes = {"reduce_scatter": _native.COLLECTIVE_REDUCE_SCATTER, "all_gather": _native.COLLECTIVE_ALL_GATHER,
                 "broadcast": _native.COLLECTIVE_BROADCAST, "all_to_all": _native.COLLECTIVE_ALL_TO_ALL,
                 "scatter": _native.COLLECTIVE_SCATTER, "gather": _native.COLLECTIVE_GATHER}
        if collective not in codes:
            raise ValueError(f"chunk masks are offered for {sorted(codes)}, not {collective!r}")
        if takes is not None:
            if collective != "all_to_all":
                raise ValueError("takes: only an all_to_all has pieces of their own sizes")
            step = self.chunk_elements(tensor.dtype)
            return np.zeros(sum(-(-int(taken) // step) for taken in takes), dtype=np.uint8)
        view = view_of(tensor if not staging.on_device(tensor) else tensor.new_empty(0, device="cpu"))
        count = tensor.numel() if staging.on_device(tensor) else view.count  # its size alone: nothing is staged
        algorithm_name = algorithms.resolve(algorithm or self.options.algorithm, self.world_size)
        if collective in ("all_to_all", "scatter", "gather"):
            if collective == "all_to_all":
                self._check_all_to_all_count(count)
            algorithm_name = "direct"  # their only schedule
        size = _native.chunk_mask_bytes(codes[collective], algorithms.CODES[algorithm_name], count, view.dtype_code,
                                        self.rank, self.world_size, self.chunk_bytes)
        if size == 0 and count:
            raise ValueError(f"no chunk mask for a {algorithm_name} {collective} of {self.world_size} ranks: "
                             "use algorithm='direct'")
        return np.zeros((self.world_size, size // self.world_size) if collective == "reduce_scatter" else size,
                        dtype=np.uint8)

    @_documented
    @staging.stages(writes=("tensor",))
    def allreduce(self, tensor, *, op="sum", loss_budget=None, deadline=None, estimator=None, algorithm=None, copies=None,
                  layout_salt=0, on_miss="raise", reduce_in_rank_order=False):
        """Reduce `tensor` across ranks, in place.

        Lost datagrams are not retransmitted: the result is an unbiased estimate. Each shard's
        owner rescales what reached it by N / contributions; where the owner's result does not
        reach a rank, that rank keeps its own partial rescaled the same way (unbiased, noisier),
        or zero with ``estimator="zero_fill"``. The ranks agree on one verdict per call.
        While the call runs the tensor may hold partial sums (from ``Options.in_place_min_bytes``
        up the call sums in it, saving each chunk's original before it first writes it); when it
        raises, the tensor holds the values it was given.

        Parameters
        ----------
        tensor : numpy.ndarray or torch.Tensor
            Contiguous, writable, on the CPU or a CUDA device (staged: docs/gpu.md); float32,
            float64, float16, bfloat16 (accumulated in float32) or int32. Every rank passes the
            same size and dtype.
        op : {"sum", "mean", "avg"}, ReduceOp or torch.distributed.ReduceOp, default "sum"
        estimator : {"unbiased", "zero_fill"} or Estimator, optional
            How a hole is filled; None takes ``Options.estimator``.
        layout_salt : int, default 0
            Folded into the call's layout, which every rank checks: ranks whose calls differ in
            it raise LayoutMismatch (``ud_transport.exact`` says what its call is this way).
        reduce_in_rank_order : bool, default False
            Each block's owner keeps every rank's contribution apart and sums them in rank order
            in double precision (a mean divided before it), rounding once: the same bits on
            every rank and from run to run, those ``ud_transport.exact.allreduce`` gives. Needs
            float32 or float64 and ``loss_budget=0``, and runs on the direct algorithm (ValueError
            for another; ``None`` and ``"auto"`` take it); the owner keeps a row of its block
            per peer.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> stats = comm.allreduce(gradient, loss_budget=0.1)  # doctest: +SKIP
        >>> stats.delivered_fraction                             # doctest: +SKIP
        0.993
        """
        view = view_of(tensor)
        return self._run(_native.COLLECTIVE_ALLREDUCE, view, view, view.count, op=op, loss_budget=loss_budget,
                         deadline=deadline, estimator=estimator, algorithm=algorithm, copies=copies,
                         layout_salt=layout_salt, on_miss=on_miss, reduce_in_rank_order=reduce_in_rank_order)

    @_documented
    @staging.stages(reads=("tensor",), writes=("output",))
    def reduce_scatter(self, tensor, output, *, op="sum", loss_budget=None, deadline=None, estimator=None, algorithm=None,
                       chunk_mask=None, copies=None, on_miss="raise", layout_salt=0, reduce_in_rank_order=False):
        """Reduce `tensor` across ranks; this rank's shard of the result lands in `output`.

        Each chunk of the shard is scaled by N / the contributions that reached it (unbiased).
        `tensor` is not changed; `output` only on success.

        Parameters
        ----------
        tensor : numpy.ndarray or torch.Tensor
            The full tensor, the same size on every rank (dtypes as for allreduce).
        output : numpy.ndarray or torch.Tensor
            This rank's shard, ``shard_range(tensor's count)`` long, of the same dtype.
        op : {"sum", "mean", "avg"}, ReduceOp or torch.distributed.ReduceOp, default "sum"
        estimator : {"unbiased", "zero_fill"} or Estimator, optional
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("reduce_scatter", tensor)``: on success, row p says which chunks of
            this rank's shard rank p's contribution reached (1) or missed (0). Offered where each
            contribution travels alone (``algorithm="direct"``, or two ranks); error feedback
            uses it (a sender keeps what missed and adds it to its next call).
        layout_salt : int, default 0
            Folded into the call's layout, as for allreduce.
        reduce_in_rank_order : bool, default False
            The shard is the sum of every rank's contribution in rank order in float64, rounded
            once, as for allreduce (the same needs).
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> start, stop = comm.shard_range(grad.numel())              # doctest: +SKIP
        >>> comm.reduce_scatter(grad, shard_out, loss_budget=0.1)     # doctest: +SKIP
        """
        source, target = view_of(tensor), view_of(output)
        start, stop = self.shard_range(source.count)
        self._check_pair(source, target, stop - start, "output", "this rank's shard of tensor")
        return self._run(_native.COLLECTIVE_REDUCE_SCATTER, source, target, source.count, op=op, loss_budget=loss_budget,
                         deadline=deadline, estimator=estimator, algorithm=algorithm, chunk_mask=chunk_mask, copies=copies,
                         on_miss=on_miss, layout_salt=layout_salt, reduce_in_rank_order=reduce_in_rank_order)

    @_documented
    @staging.stages(reads=("shard",), writes=("output",))
    def all_gather(self, shard, output, *, loss_budget=None, deadline=None, algorithm=None, chunk_mask=None, copies=None,
                   direct_output=False, layout_salt=0, on_miss="raise"):
        """Gather every rank's shard into `output`, the full tensor.

        Rank r's shard goes to ``output[start:stop]`` of ``shard_range(len(output), r)``. Where a
        chunk of another rank's shard does not arrive, `output` keeps what it held before
        (stale-value retention); ``stats.chunks_stale`` counts them.

        Parameters
        ----------
        shard : numpy.ndarray or torch.Tensor
            This rank's shard.
        output : numpy.ndarray or torch.Tensor
            The full tensor, the same dtype; its old values are what a lost chunk leaves.
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("all_gather", output)``: on success, 1 for every chunk of `output`
            that is fresh, 0 where it kept its old value (``chunk_ranges`` maps chunks to elements).
        direct_output : bool, default False
            Write chunks into `output` as they arrive rather than at the end: one copy fewer,
            but a call that fails may leave `output` partly written. For a caller that keeps
            its own copy to put back (``ud_transport.exact`` does).
        layout_salt : int, default 0
            A value (32 bits) every rank must pass alike, checked with the layout: a rank that
            passes another raises LayoutMismatch, as for another size. ``ud_transport.exact``
            passes the byte count of what it moves as padded 32-bit words.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> comm.all_gather(params[start:stop], params, loss_budget=0.05)  # doctest: +SKIP
        """
        source, target = view_of(shard), view_of(output)
        start, stop = self.shard_range(target.count)
        self._check_pair(target, source, stop - start, "shard", "this rank's shard of output")
        return self._run(_native.COLLECTIVE_ALL_GATHER, source, target, target.count, loss_budget=loss_budget,
                         deadline=deadline, algorithm=algorithm, chunk_mask=chunk_mask, copies=copies,
                         direct_output=direct_output, layout_salt=layout_salt, on_miss=on_miss)

    @_documented
    @staging.stages(writes=("tensor",))
    def broadcast(self, tensor, src=0, *, loss_budget=None, deadline=None, algorithm=None, chunk_mask=None, copies=None,
                  direct_output=False, layout_salt=0, on_miss="raise"):
        """Copy rank `src`'s tensor into every rank's, in place.

        Lossy the same way as all_gather: a chunk that does not arrive keeps its old value.

        Parameters
        ----------
        tensor : numpy.ndarray or torch.Tensor
            The same size and dtype on every rank.
        src : int, default 0
            The rank whose values are sent.
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("broadcast", tensor)``: on success, 1 for every chunk of `tensor`
            that took `src`'s value in this call (as for all_gather).
        direct_output : bool, default False
            As for all_gather: chunks are written as they arrive, and a call that fails may
            leave `tensor` partly written (never at `src`).
        layout_salt : int, default 0
            As for all_gather: checked with the layout on every rank.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> comm.broadcast(weights, src=0, loss_budget=0.0)  # doctest: +SKIP
        """
        return self._from_root(_native.COLLECTIVE_BROADCAST, tensor, src, loss_budget=loss_budget, deadline=deadline,
                               algorithm=algorithm, chunk_mask=chunk_mask, copies=copies, direct_output=direct_output,
                               layout_salt=layout_salt, on_miss=on_miss)

    def _from_root(self, collective, tensor, src, **call):
        """A broadcast or a scatter of `tensor`, in place, from rank `src`."""
        if not 0 <= int(src) < self.world_size:
            raise ValueError(f"src {src} is not a rank of a world of {self.world_size}")
        view = view_of(tensor)
        return self._run(collective, view, view, view.count, root=int(src), **call)

    @_documented
    @staging.stages(writes=("tensor",))
    def scatter(self, tensor, src=0, *, loss_budget=None, deadline=None, chunk_mask=None, copies=None,
                direct_output=False, layout_salt=0, on_miss="raise"):
        """Hand each rank its block of rank `src`'s tensor: block r (``shard_range(len(tensor), r)``)
        of `src`'s tensor goes into block r of rank r's, in place; the rank's other blocks keep
        their values.

        Each block crosses the network once, from `src` to its rank, and no rank receives
        another's (a broadcast moves every block to every rank). Lossy as broadcast: a chunk
        that does not arrive keeps its old value; ``gather_fraction`` is the least share of its
        own block any rank received.

        Parameters
        ----------
        tensor : numpy.ndarray or torch.Tensor
            The same size and dtype on every rank; only read at `src`.
        src : int, default 0
            The rank whose blocks are sent.
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("scatter", tensor)``: on success, 1 for every chunk of this rank's
            block that took `src`'s value, and for every chunk of the other blocks (not this
            rank's to receive).
        direct_output : bool, default False
            As for broadcast.
        layout_salt : int, default 0
            As for all_gather: checked with the layout on every rank.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> comm.scatter(pieces.reshape(-1), src=0, loss_budget=0.0)  # doctest: +SKIP
        """
        return self._from_root(_native.COLLECTIVE_SCATTER, tensor, src, loss_budget=loss_budget, deadline=deadline,
                               algorithm="direct", chunk_mask=chunk_mask, copies=copies, direct_output=direct_output,
                               layout_salt=layout_salt, on_miss=on_miss)

    @_documented
    @staging.stages(reads=("shard",), writes=("output",))
    def gather(self, shard, output, dst=0, *, loss_budget=None, deadline=None, chunk_mask=None, copies=None,
               direct_output=False, layout_salt=0, on_miss="raise"):
        """Gather every rank's shard into rank `dst`'s `output`, as all_gather does into every
        rank's: rank r's shard goes to ``output[start:stop]`` of ``shard_range(len(output), r)``.
        Elsewhere `output` takes only the rank's own shard.

        Each shard crosses the network once, to `dst`; no other rank receives anything. Lossy as
        all_gather: a chunk that does not arrive keeps what `output` held; ``gather_fraction`` is
        the share of the shards that reached `dst`.

        Parameters
        ----------
        shard : numpy.ndarray or torch.Tensor
            This rank's shard.
        output : numpy.ndarray or torch.Tensor
            The full tensor, the same dtype, on every rank.
        dst : int, default 0
            The rank that gathers.
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("gather", output)``: on success, at `dst` 1 for every chunk of
            `output` that is fresh; elsewhere all 1 (nothing is for it to receive).
        direct_output : bool, default False
            As for all_gather.
        layout_salt : int, default 0
            As for all_gather: checked with the layout on every rank.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> comm.gather(metrics, table, dst=0, loss_budget=0.0)  # doctest: +SKIP
        """
        if not 0 <= int(dst) < self.world_size:
            raise ValueError(f"dst {dst} is not a rank of a world of {self.world_size}")
        source, target = view_of(shard), view_of(output)
        start, stop = self.shard_range(target.count)
        self._check_pair(target, source, stop - start, "shard", "this rank's shard of output")
        return self._run(_native.COLLECTIVE_GATHER, source, target, target.count, root=int(dst), loss_budget=loss_budget,
                         deadline=deadline, algorithm="direct", chunk_mask=chunk_mask, copies=copies,
                         direct_output=direct_output, layout_salt=layout_salt, on_miss=on_miss)

    @_documented
    @staging.stages(reads=("tensor",), writes=("output",))
    def all_to_all(self, tensor, output, *, loss_budget=None, deadline=None, chunk_mask=None, copies=None,
                   direct_output=False, layout_salt=0, on_miss="raise", agree_value=0):
        """Exchange pieces: block q of this rank's `tensor` goes to rank q, and block p of `output`
        receives rank p's block for this rank (blocks as ``shard_range``: world_size equal parts).

        Each piece travels once, straight from its sender to its receiver (in round k rank r sends
        to r + k and hears from r - k). Lossy as all_gather: a chunk that does not arrive keeps
        what `output` held; this rank's own block is copied from `tensor`.

        Parameters
        ----------
        tensor : numpy.ndarray or torch.Tensor
            What this rank sends, world_size blocks of one length; only read.
        output : numpy.ndarray or torch.Tensor
            Of `tensor`'s size and dtype. It may be `tensor` itself: the sends read `tensor`,
            and what arrives waits in the scratch until the call succeeds.
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("all_to_all", output)``: on success, 1 for every chunk of `output`
            that is fresh (block p: rank p's piece).
        direct_output : bool, default False
            As for all_gather: chunks are written into `output` as they arrive, and a call that
            fails may leave it partly written; `output` must then not overlap `tensor`.
        layout_salt : int, default 0
            As for all_gather: checked with the layout on every rank.
        agree_value : int, default 0
            A 32-bit value agreed with the call's verdict, as ``agree`` agrees one: the largest
            any rank passed is ``stats.agreed_value`` on every rank, at no extra round. For
            example, whether every rank's call is the one the others assumed.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> comm.all_to_all(tokens_by_expert, received, loss_budget=0.0)  # doctest: +SKIP
        """
        source, target = view_of(tensor), view_of(output)
        self._check_pair(source, target, source.count, "output", "tensor")
        self._check_all_to_all_count(source.count)
        agree_value = agree_number(agree_value)
        if direct_output and memory_meets(source.address, source.nbytes, target.address, target.nbytes):
            raise ValueError("all_to_all with direct_output needs an output apart from the tensor it sends")
        return self._run(_native.COLLECTIVE_ALL_TO_ALL, source, target, source.count, loss_budget=loss_budget,
                         deadline=deadline, algorithm="direct", chunk_mask=chunk_mask, copies=copies,
                         direct_output=direct_output, layout_salt=layout_salt, on_miss=on_miss,
                         agree_value=agree_value)

    @_documented
    @staging.stages(reads=("tensor",), writes=("output",))
    def all_to_all_pieces(self, tensor, output, sends, takes, *, loss_budget=None, deadline=None, chunk_mask=None,
                          copies=None, direct_output=False, layout_salt=0, on_miss="raise", agree_value=0):
        """all_to_all with pieces of their own sizes, as a mixture of experts routes its tokens:
        the first ``sends[0]`` elements of `tensor` go to rank 0, the next ``sends[1]`` to rank 1
        and so on, and `output` takes ``takes[p]`` elements from each rank p, in rank order.

        Every rank passes only its own sizes, and nothing is exchanged to learn the others': the
        call's verdict carries a checksum of them, so that where what one rank sends another is
        not what that rank takes, the call fails with LayoutMismatch on every rank. No piece is
        padded, and each travels once. Lossy as ``all_to_all``.

        Parameters
        ----------
        tensor : numpy.ndarray or torch.Tensor
            What this rank sends, ``sum(sends)`` elements; only read.
        output : numpy.ndarray or torch.Tensor
            ``sum(takes)`` elements of `tensor`'s dtype, apart from `tensor` (a rank's own piece
            sits elsewhere in each: ValueError where they overlap).
        sends, takes : sequence of int
            world_size element counts each. This rank's own piece is copied from `tensor`;
            where ``sends[rank]`` and ``takes[rank]`` differ, it disagrees with itself, and the
            call fails as any disagreement does: alike on every rank.
        chunk_mask : numpy.ndarray of uint8, optional
            From ``chunk_mask("all_to_all", output, takes=takes)``: on success, 1 for every chunk
            of `output` that is fresh (rank p's piece's chunks after rank p - 1's).
        direct_output, layout_salt, agree_value
            As for ``all_to_all``.
        {call_parameters}

        {call_raises}

        Examples
        --------
        >>> comm.all_to_all_pieces(tokens, received, [3, 0, 5, 2], [3, 4, 1, 0], loss_budget=0.0)  # doctest: +SKIP
        """
        source, target = view_of(tensor), view_of(output)
        self._check_pair(source, target, target.count, "output", "tensor")
        pieces = self._pieces(sends, takes, source.count, target.count)
        agree_value = agree_number(agree_value)
        # an output over the input is refused by the engine (a rank's own piece sits elsewhere in each)
        return self._run(_native.COLLECTIVE_ALL_TO_ALL, source, target, target.count, loss_budget=loss_budget,
                         deadline=deadline, algorithm="direct", chunk_mask=chunk_mask, copies=copies,
                         direct_output=direct_output, layout_salt=layout_salt, on_miss=on_miss,
                         agree_value=agree_value, pieces=pieces)

    def _pieces(self, sends, takes, sent, taken):
        """The engine's piece_counts: `sends` then `takes`, checked against the tensors' sizes."""
        import numpy as np

        counts = [list(sends), list(takes)]
        for name, values, total in (("sends", counts[0], sent), ("takes", counts[1], taken)):
            if len(values) != self.world_size or any(type(v) is bool or int(v) != v or v < 0 for v in values):
                raise ValueError(f"{name} must be {self.world_size} counts of elements, not {values}")
            if sum(int(v) for v in values) != total:
                raise ValueError(f"{name} sum to {sum(int(v) for v in values)} elements; the "
                                 f"{'tensor' if name == 'sends' else 'output'} has {total}")
        return np.array([int(v) for v in counts[0] + counts[1]], dtype=np.uint64)

    def _check_all_to_all_count(self, count):
        if count % self.world_size:
            raise ValueError(f"all_to_all moves {self.world_size} equal blocks: {count} elements do not divide by "
                             f"{self.world_size} ranks (pad each rank's pieces to one length)")

    def agree(self, value, *, deadline=None):
        """The largest `value` over all ranks, the same on every rank.

        ``agree(flag)`` is "any rank says so". Messages are repeated until acknowledged, so the
        answer is exact under loss.

        Parameters
        ----------
        value : int in [0, 2**32) or bool
        deadline : float or datetime.timedelta, optional
            None takes ``Options.deadline_cap_s``.

        Returns
        -------
        int or bool
            The maximum, of `value`'s type when it is a bool.

        Raises
        ------
        PeerTimeout
            A rank was not heard from by the deadline (or is gone).
        ValueError
            `value` outside [0, 2**32).

        Examples
        --------
        >>> comm.agree(loss_spiked)  # True on every rank if any rank passed True  # doctest: +SKIP
        True
        """
        number = int(value)
        if not 0 <= number < 2**32:
            raise ValueError(f"agree() takes an integer in [0, 2**32), got {value!r}")
        stats = self._run(_native.COLLECTIVE_AGREE, None, None, 0, agree_value=number, loss_budget=0.0,
                          deadline=deadline if deadline is not None else self.options.deadline_cap_s)
        return type(value)(stats.agreed_value) if isinstance(value, bool) else stats.agreed_value

    def _mask_buffer(self, chunk_mask, collective, algorithm_name, count, dtype_code, pieces=None):
        """(address, bytes) of a caller's chunk mask checked against what the call fills; (0, 0) for none."""
        if chunk_mask is None:
            return 0, 0
        import numpy as np

        if not isinstance(chunk_mask, np.ndarray) or chunk_mask.dtype != np.uint8 or not chunk_mask.flags.c_contiguous \
                or not chunk_mask.flags.writeable:
            raise TypeError("chunk_mask must be a writable, contiguous numpy uint8 array (see Communicator.chunk_mask)")
        if pieces is not None:
            step = self.chunk_bytes // _native.wire_element_bytes(dtype_code)
            want = int(sum(-(-int(taken) // step) for taken in pieces[self.world_size:]))
        else:
            want = _native.chunk_mask_bytes(collective, algorithms.CODES[algorithm_name], count, dtype_code, self.rank,
                                            self.world_size, self.chunk_bytes)
        if want == 0 and count:
            raise ValueError(f"no chunk mask for this call (none for a {algorithm_name} schedule here: use "
                             "algorithm='direct')")
        if chunk_mask.nbytes != want:
            raise ValueError(f"chunk_mask has {chunk_mask.nbytes} bytes; this call fills {want}")
        if want == 0:  # a tensor of no elements: its empty mask has nothing to fill
            return 0, 0
        return chunk_mask.ctypes.data, want

    @staticmethod
    def _check_pair(full, part, part_count, part_name, description):
        if part.dtype_code != full.dtype_code:
            raise TypeError(f"{part_name} has dtype {part.dtype_name}, the tensor {full.dtype_name}")
        if part.count != part_count:
            raise ValueError(f"{part_name} has {part.count} elements; {description} has {part_count}")

    def _stripes_for(self, collective, nbytes, mask_address):
        """The engines a call runs on as stripes, or None to run it on one. The same on every
        rank: it depends only on what every rank passes alike."""
        count = len(self._stripes)
        if count > 1 and collective in (_native.COLLECTIVE_ALLREDUCE, _native.COLLECTIVE_BROADCAST) \
                and not mask_address and nbytes >= count * STRIPE_MIN_BYTES:
            return self._stripes
        return None

    @staticmethod
    def _stripe_layout(view, count):
        """(inputs, outputs, counts, weights) of `count` contiguous stripes of an in-place view."""
        bounds = [view.count * k // count for k in range(count + 1)]
        addresses = [view.address + start * view.element_bytes for start in bounds[:-1]]
        counts = [stop - start for start, stop in zip(bounds, bounds[1:])]
        return addresses, addresses, counts, [part / view.count for part in counts]

    def _run(self, collective, source, target, count, *, op="sum", loss_budget=None, deadline=None, estimator=None,
             algorithm=None, root=0, agree_value=0, chunk_mask=None, copies=None, direct_output=False, layout_salt=0,
             on_miss="raise", reduce_in_rank_order=False, pieces=None):
        resolved = self._resolve_call(op=op, loss_budget=loss_budget, estimator=estimator, algorithm=algorithm, root=root,
                                      agree_value=agree_value, copies=copies, direct_output=direct_output,
                                      layout_salt=layout_salt, on_miss=on_miss, reduce_in_rank_order=reduce_in_rank_order)
        deadline_s = _seconds(deadline)
        mask_address, mask_bytes = self._mask_buffer(chunk_mask, collective, resolved["algorithm_name"], count,
                                                     target.dtype_code if target else 0, pieces)
        return self._run_resolved(collective, source, target, count, deadline_s=deadline_s, mask_address=mask_address,
                                  mask_bytes=mask_bytes, pieces=pieces, **resolved)

    def _resolve_call(self, *, op="sum", loss_budget=None, estimator=None, algorithm=None, root=0, agree_value=0,
                      copies=None, direct_output=False, layout_salt=0, on_miss="raise", reduce_in_rank_order=False):
        """A call's arguments (all but its buffers, mask and deadline) checked and resolved against
        the options, as _run_resolved takes them."""
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, got {on_miss!r}")
        if reduce_in_rank_order and algorithm in (None, "auto"):
            algorithm = "direct"  # the only schedule whose owners hear each contribution alone (as ring at 2 ranks)
        return dict(algorithm_name=algorithms.resolve(algorithm or self.options.algorithm, self.world_size),
                    op_value=op_code(op), estimator_value=estimator_code(estimator or self.options.estimator),
                    copies=check_copies(self.options.copies if copies is None else copies),
                    # its range: the engine's
                    budget=self.options.default_loss_budget if loss_budget is None else float(loss_budget),
                    root=root, agree_value=agree_value, direct_output=direct_output, layout_salt=layout_salt,
                    on_miss=on_miss, reduce_in_rank_order=reduce_in_rank_order)

    def _run_resolved(self, collective, source, target, count, *, algorithm_name, op_value, estimator_value, root,
                      agree_value, budget, deadline_s, mask_address, mask_bytes, copies, direct_output, layout_salt,
                      on_miss, reduce_in_rank_order, pieces=None):
        """_run once its arguments are checked and resolved to the engine's (a caller that made the
        same call before may keep them: ud_transport.exact's messages): the call, its stats, and
        its status as the exception _run documents. `deadline_s`: None for the estimator's."""
        nbytes = target.nbytes if target is not None else 0
        with self._lock:
            self._require_open()
            if deadline_s is None:
                deadline_s = self._deadlines.deadline_s(nbytes)
            # stripes agree no value: only collectives that never stripe (agree, all_to_all) take one
            stripes = (None if direct_output or layout_salt or reduce_in_rank_order or pieces is not None
                       else self._stripes_for(collective, nbytes, mask_address))
            signals = threading.current_thread() is threading.main_thread()  # Ctrl-C ends a call that waits
            self._calling = threading.get_ident()  # close() from a signal's handler in this call waits for its end
            try:
                if stripes:
                    status, raw, _, native_error = _native.run_striped(
                        stripes, *self._stripe_layout(target, len(stripes)), collective=collective,
                        algorithm=algorithms.CODES[algorithm_name], dtype=target.dtype_code, op=op_value,
                        estimator=estimator_value, root=root, loss_budget=budget, deadline_s=deadline_s,
                        copies=copies, write_on_budget_miss=on_miss == "return", signals=signals)
                else:
                    status, raw, native_error = self._engine.run(
                        collective=collective, algorithm=algorithms.CODES[algorithm_name],
                        input=source.address if source else 0, output=target.address if target else 0, count=count,
                        dtype=target.dtype_code if target else 0, op=op_value, estimator=estimator_value, root=root,
                        agree_value=agree_value, loss_budget=budget, deadline_s=deadline_s, chunk_mask=mask_address,
                        chunk_mask_bytes=mask_bytes, copies=copies, direct_output=bool(direct_output),
                        layout_salt=int(layout_salt) & 0xFFFFFFFF, write_on_budget_miss=on_miss == "return",
                        reduce_in_rank_order=bool(reduce_in_rank_order),
                        piece_counts=pieces.ctypes.data if pieces is not None else 0, signals=signals)
            finally:
                self._calling = None
                if self._close_after_call:
                    self._close_engines()
        stats = CollectiveStats.from_native(raw, collective=collectives.NAMES[collective], algorithm=algorithm_name,
                                            transport=self.transport_name)
        if stats.receive_overflow_drops and not self._overflow_warned:
            self._overflow_warned = True  # once per communicator: the counter stays in every call's stats
            log.warning("rank %d: the kernel dropped %d datagrams at this rank's full receive queue in one call "
                        "(receive buffer %d bytes, window %d bytes): lower window_bytes, or raise net.core.rmem_max "
                        "(sysctl -w net.core.rmem_max=67108864)", self.rank, stats.receive_overflow_drops,
                        self.receive_buffer_bytes, self.window_bytes)
        message = native_error.message if native_error is not None else ""
        if status == _native.STATUS_OK:
            # a broadcast's root is only read: marked written, autograd refused the backward of a
            # graph that saved it (a pipeline stage's output, sent by send)
            if target is not None and collective != _native.COLLECTIVE_AGREE and not (
                    collective in (_native.COLLECTIVE_BROADCAST, _native.COLLECTIVE_SCATTER) and root == self.rank
                    and source is target):
                target.written()
            if not stats.deadline_expired and nbytes:
                with self._lock:  # callers on several threads: the estimator's window is not theirs to share
                    self._deadlines.record(nbytes, stats.elapsed_s - stats.join_wait_s - stats.output_s)  # not a late rank, not the copy out
            return stats
        if status == _native.STATUS_LOSS_BUDGET:
            raise LossBudgetExceeded(f"rank {self.rank}: {message}", stats)
        if status == _native.STATUS_PEER_TIMEOUT:
            raise PeerTimeout(f"rank {self.rank}: {message}", stats.silent_rank, stats)
        if status == _native.STATUS_LAYOUT_MISMATCH:
            with self._lock:
                self.layout_mismatches += 1
            raise LayoutMismatch(f"rank {self.rank}: {message}", stats.mismatched_rank, stats)
        if status == _native.STATUS_INVALID_ARGUMENT:
            raise ValueError(message)
        raise TransportError.caused_by(f"rank {self.rank}: {message}", native_error)

    @property
    def sequence(self):
        """The sequence number of the last call started here: one more for every call (failed ones
        too), on every rank alike while the ranks make the same calls; modulo 2**32.

        Returns
        -------
        int

        Raises
        ------
        TransportError
            The communicator is closed.

        Examples
        --------
        >>> before = comm.sequence; comm.agree(0); comm.sequence - before  # doctest: +SKIP
        1
        """
        with self._lock:
            self._require_open()
            return self._engine.sequence

    def udp_counters(self):
        """What this rank's UDP sockets counted since they opened, summed over stripes: system
        calls and GSO/GRO use, and the ICMP errors read (`icmp_errors`), of which
        `icmp_unverified` were port unreachable messages quoting a datagram that did not carry
        this communicator's session id (forged: dropped, see SECURITY.md) and `icmp_too_big` were
        "fragmentation needed" quoting one of ours (a link on the path is narrower than our
        datagrams and drops them: lower the `mtu` option), and the messages the network refused
        and that were skipped as loss (`send_refused`).

        Returns
        -------
        dict of str to int
            Empty on transports other than UDP.

        Raises
        ------
        TransportError
            The communicator is closed.

        Examples
        --------
        >>> comm.udp_counters()["icmp_unverified"]  # doctest: +SKIP
        0
        """
        with self._lock:
            self._require_open()
            total = {}
            for engine in self._stripes:
                for name, value in engine.udp_counters().items():
                    total[name] = total.get(name, 0) + value
            return total

    # -- membership: after a rank dies, or when new ranks come ------------------

    def shrink(self, ranks_to_exclude):
        """A new Communicator of this one's ranks but `ranks_to_exclude`, renumbered in order (the
        survivor of lowest rank becomes rank 0), for going on after a rank dies.

        Only the survivors take part, meeting through this communicator's store under keys named
        by its session and the exclusion: nothing is asked of the excluded ranks. This one stays
        open: close it (``interrupt()`` first if another thread may be in a call on it).

        Parameters
        ----------
        ranks_to_exclude : list of int
            Ranks of this communicator, none twice, not this rank, not every rank: the same list
            on every survivor (a ``PeerTimeout``'s ``.rank`` is the same on every rank).

        Returns
        -------
        Communicator

        Raises
        ------
        TypeError, ValueError, RuntimeError
            An exclusion torch.distributed.shrink_group would refuse (this rank among them is a
            RuntimeError).
        TransportError
            This communicator is closed, or the survivors did not all meet within
            ``store_timeout_s`` (one that did not call shrink, or the store is gone: it must
            outlive the dead ranks).

        Examples
        --------
        >>> comm = comm.shrink([error.rank])  # after a PeerTimeout  # doctest: +SKIP
        """
        excluded = membership.exclusion(ranks_to_exclude, self.rank, self.world_size)
        if self.closed:
            raise TransportError("communicator is closed: it cannot shrink")
        remaining = membership.survivors(excluded, self.world_size)
        return self._regrouped(remaining.index(self.rank), len(remaining),
                               membership.shrink_key(self.session_id, excluded))

    def grow(self, newcomers):
        """A new Communicator of this one's ranks (same numbers) and `newcomers` new ranks after
        them, each of which calls ``Communicator.join`` with this one's store and ``family``.

        Every rank of this communicator calls it with the same count, at the same point (a step
        boundary); newcomers are seated in the order they called ``join`` and may come before or
        after. This one stays open: close it.

        Parameters
        ----------
        newcomers : int
            At least 1; the grown world at most the supported maximum.

        Returns
        -------
        Communicator

        Raises
        ------
        ValueError
            `newcomers` below 1, or a world too large.
        TransportError
            This communicator is closed; a newcomer did not take its seat within
            ``store_timeout_s`` (this communicator is then as it was, and the seats are withdrawn:
            a newcomer that comes later waits for the next grow); or the ranks and newcomers did
            not all meet within ``store_timeout_s``.

        Examples
        --------
        >>> comm = comm.grow(1)  # a replacement has called Communicator.join  # doctest: +SKIP
        """
        membership.check_growth(self.world_size, newcomers)
        if self.closed:
            raise TransportError("communicator is closed: it cannot grow")
        attempt, self._grows_tried = self._grows_tried, self._grows_tried + 1
        key = seats.settle_grow(self.store, self.family, self.session_id, attempt, self.rank, self.world_size,
                                newcomers, self.options.store_timeout_s)
        return self._regrouped(self.rank, self.world_size + newcomers, key)

    @classmethod
    def join(cls, store, family, *, transport="auto", options=None, timeout_s=600.0):
        """Join a group of `family` as a new rank, when its ranks next call ``grow``.

        Parameters
        ----------
        store : torch.distributed.Store
            The store the group's ranks made their communicator with.
        family : str
            The group's ``family`` (the ``name`` its first communicator was given).
        transport : {"auto", "udp", "verbs"}
        options : Options, optional
            None builds them from the environment.
        timeout_s : float, default 600
            How long to wait for a grow to seat this rank.

        Returns
        -------
        Communicator
            Ranked after the group's ranks.

        Raises
        ------
        TransportError
            No grow seated it within `timeout_s` (a grow that withdrew its seats, another
            newcomer not having come, does not count: this one waits for the next), or the
            meeting failed.

        Examples
        --------
        >>> comm = Communicator.join(store, "job")  # doctest: +SKIP
        """
        if options is None:
            from . import options as options_module

            options = options_module.build()
        seat = seats.take_seat(store, family, timeout_s)
        joined = cls(seat.rank, seat.world_size, store, transport, options, name=f"{family}/{seat.key}")
        joined.family = family
        return joined

    def _regrouped(self, rank, world_size, key):
        regrouped = Communicator(rank, world_size, self.store, self.transport_name, self.options,
                                 name=f"{self.family}/{key}")
        regrouped.family = self.family
        return regrouped

    # -- lifetime ---------------------------------------------------------

    def _require_open(self):
        """TransportError once close() ran (call it holding the lock)."""
        if self._engine is None:
            raise TransportError("communicator is closed")

    def interrupt(self):
        """End the call another thread is running on this communicator within 100 ms, and every
        later one, with TransportError ("interrupted"); the tensor keeps its values. For closing a
        communicator whose call waits on a peer that may never come, without waiting out
        join_timeout_s. Safe from any thread, during a call or not; close() still releases.

        Examples
        --------
        >>> comm.interrupt(); comm.close()  # doctest: +SKIP
        """
        for engine in list(self._stripes):  # not under the lock: the call holds it
            engine.interrupt()

    def close(self):
        """Release the socket and buffers. Safe to call more than once.

        Peers still in a call with this rank see it as gone (UDP: its port is closed). From a
        signal's handler that runs inside a call on this communicator (a call on the main thread
        runs them while it waits), it interrupts that call, which then raises TransportError
        ("interrupted"), and releases as the call ends.

        Examples
        --------
        >>> comm.close()  # doctest: +SKIP
        """
        if self._calling == threading.get_ident():
            # a signal's handler, run inside this thread's own call (the engine's wait hook), which
            # holds the lock: end the call now and release when it has ended
            self._close_after_call = True
            self.interrupt()
            return
        with self._lock:
            self._close_engines()

    def _close_engines(self):
        """close() itself, the lock held."""
        for engine in self._stripes:  # stripe 0 is self._engine
            engine.close()
        self._stripes = []
        self._engine = None

    @property
    def closed(self):
        """Whether close() was called (collectives then raise TransportError)."""
        return self._engine is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else self.transport_name
        return f"<Communicator rank={self.rank} world_size={self.world_size} {state}>"
