"""Communicator options: keyword arguments to init(), or environment variables
for scripts. Keyword arguments win over the environment."""
import os
from dataclasses import dataclass, field, fields, replace

from . import _native, cpu_cache, environment

MIB = 1 << 20

# option name -> environment variable (the table is ud_transport.environment)
ENVIRONMENT = environment.fields_of("option")

ALGORITHMS = ("auto", "ring", "direct")

# The default credit window, in datagrams. Every datagram a rank is sent may sit in a receive ring
# before the kernel's packet work runs: a veth's holds 256 packets, small NIC rings 256-512. With
# 16 MiB in flight to a rank, three senders converging on it overflowed the veth ring behind a
# bridge in 11 of 300 calls at 4 ranks (MTU 1500); with 185-192 datagrams, in none
# (docs/semantics.md, "No self-inflicted loss").
WINDOW_DATAGRAMS = 192
# On verbs the default stays 16 MiB: on the SoftRoCE rig 192 datagrams made 2-rank calls twice as
# slow (1 MiB: 105 against 54 ms), and whether converging senders overflow a RoCE NIC cannot be
# measured here.
VERBS_WINDOW_BYTES = 16 * MIB
# A call is split into stripes only when each gets at least this much: below, the threads'
# start and the extra verdict rounds cost more than spreading the work saves.
STRIPE_MIN_BYTES = 1 * MIB
# What busy_poll_us=-1 spins for where a rank has a core of its own. A wake-up from poll costs
# tens of microseconds, and a small exact call waits for several datagrams in turn: at 2 ranks
# on loopback (2 cores) 50 us took the engine's time of an agree from 130 to 92-98 us. Where 8
# ranks share 2 cores, spinning (even yielding at each turn) made the calls no faster
# (docs/performance/exact_allreduce.md).
AUTO_BUSY_POLL_US = 50


def credit_window_bytes(window_bytes, chunk_bytes, transport="udp"):
    """The credit window a rank asks for: `window_bytes`, or for 0 the transport's default."""
    if window_bytes:
        return window_bytes
    return VERBS_WINDOW_BYTES if transport == "verbs" else WINDOW_DATAGRAMS * max(chunk_bytes, 1)


@dataclass(frozen=True)
class Options:
    """How a Communicator runs: keyword arguments of ``init()``, else environment variables,
    else these defaults.

    Each field's environment variable is the one ``ud_transport.environment.VARIABLES`` lists
    for it (docs/configuration.md, "Environment variables"); keyword arguments win over the environment.
    ``options.build(**keywords)`` makes the Options ``init()`` uses.

    Attributes
    ----------
    chunk_bytes : int, default 0
        Payload bytes per datagram; 0 takes the largest the path MTU allows on every rank.
        Rounded down to a multiple of 8 (whole elements of every dtype); more than one datagram
        carries is a ValueError when the Communicator opens. ``UD_CHUNK_BYTES``.
    window_bytes : int, default 0
        Bytes all senders together may have in flight to this rank (its credit window). 0 takes
        ``WINDOW_DATAGRAMS`` (192) chunks on UDP, fewer packets than a veth's 256-entry receive
        ring or a NIC's smallest rings hold, so senders converging on one rank cannot overflow
        them (docs/semantics.md, "No self-inflicted loss"); on verbs, 16 MiB. On UDP it is lowered, with a warning,
        to fit the receive buffer the kernel granted. ``UD_WINDOW_BYTES``.
    socket_buffer_bytes : int, default 67108864 (64 MiB)
        UDP send and receive buffer asked of the kernel. ``UD_SOCKET_BUFFER_BYTES``.
    end_repeats : int, default 3
        The most copies of each end-of-step marker (they can be lost too; fewer go where loss has
        been rare); 1 to ``_native.MAX_END_REPEATS``. Also the most copies of a rank's
        acknowledgement in the verdict round, which likewise sends fewer (docs/semantics.md).
    credit_refresh_us : int, default 2000
        Microseconds between resends of this rank's credit while it waits for data.
    reorder_grace_us : int, default 200
        Microseconds a step waits for stragglers after its sender's end marker.
    busy_poll_us : int, default -1
        Microseconds to spin for the next datagram before sleeping, yielding the core to any
        other thread that wants it at each turn; -1: AUTO_BUSY_POLL_US where this rank has a
        core of its own for each of its stripes (its fair share of its machine's CPUs, as
        ``stripes="auto"`` counts it, is at least its stripes), else 0 (ranks that share cores
        would spin in each other's way).
        ``UD_BUSY_POLL_US``.
    idle_close_us : int, default 20000
        Microseconds without arrivals after which a step still missing chunks asks its sender
        whether it is done with the step (it closes on the answer, never on the silence; 0: ask
        only at the step's share of the deadline).
    deadline_cap_s : float, default 30.0
        Seconds: the adaptive default deadline never exceeds this; also ``agree()``'s default
        deadline. ``UD_DEADLINE_CAP``.
    deadline_floor_s : float, default 1.0
        Seconds: the adaptive default deadline is never below this.
    deadline_multiplier : float, default 4.0
        The adaptive default deadline is this times the median time of recent calls, scaled to
        the call's size (the cap until a call has been timed).
    default_loss_budget : float, default 0.1
        The ``loss_budget`` of a call that passes None, in [0, 1]. ``UD_LOSS_BUDGET``.
    estimator : {"unbiased", "zero_fill"}, default "unbiased"
        The ``estimator`` of a call that passes None (see Estimator).
    algorithm : {"auto", "ring", "direct"}, default "auto"
        The schedule of a call that passes None; "auto" takes direct above two ranks, ring at
        two. ``UD_ALGORITHM``.
    copies : int, default 1
        The ``copies`` of a call that passes None: each data datagram goes out this many times
        (1 to ``_native.MAX_COPIES``), so a chunk is lost only if every copy is. ``UD_COPIES``.
    stripes : int or "auto", default "auto"
        UDP only: sockets, and threads, each rank runs a large allreduce or broadcast on. A call
        of at least ``STRIPE_MIN_BYTES`` per stripe is split into this many contiguous parts run
        at once, each on its own socket and thread, with one outcome (OK only if every part
        is; otherwise the tensor is put back whole) and merged stats; the loss budget holds
        for each part, so for the whole. The credit window is shared out among the parts (each
        keeps the engine's floor of 16 chunks, so above 12 stripes the parts together exceed
        the default 192 datagrams). More than 1 pays only where a rank has cores to spare: "auto"
        gives each rank one stripe per core of its fair share of its machine (the CPUs it may run
        on, shared evenly with the other ranks on the same kernel or LOCAL_WORLD_SIZE's, within
        its cgroup quota shared with the ranks under it), the
        least over all ranks, at most 4 (``stripe_choice``; docs/algorithms.md, "Stripes"). 1 on the verbs
        transport. Every rank must set the same. "auto" or 1 to ``_native.MAX_STRIPES``. ``UD_STRIPES``.
    agree_resend_us : int, default 1000
        Microseconds before the first resend of a verdict-round message (the interval doubles,
        up to 16x; JOIN requests up to 128x). Where rounds usually take longer and loss has been
        rare, a verdict is resent only after the usual round and four spreads, at most 16x.
    join_timeout_s : float, default 300.0
        Seconds a call waits for every rank to join it before a PeerTimeout names the absent
        one; the data deadline counts from the join. 0.001 to 4e6. ``UD_JOIN_TIMEOUT``.
    bind_address : str, default ""
        Local IPv4 address to bind; "" takes the one that reaches ``MASTER_ADDR``.
        ``UD_BIND_ADDRESS``.
    store_timeout_s : float, default 60.0
        Seconds within which every rendezvous failure (store unreachable, a rank missing or
        disagreeing) raises. ``UD_STORE_TIMEOUT``.
    inject : Bernoulli or GilbertElliott, default None
        A loss model applied to the datagrams this rank receives (each rank derives its own
        stream from the model's seed). ``init()`` reads ``UD_INJECT`` and ``UD_INJECT_SEED``
        when it is not given.
    device : str, default ""
        Verbs only: the RDMA device, e.g. "mlx5_0" or "rxe0"; "" takes ``UD_DEVICE``, else one
        is chosen (see ``python -m ud_transport info``).
    port : int, default 0
        Verbs only: the device port, 1-based; 0 takes ``UD_PORT``, else one is chosen.
    gid_index : int, default -1
        Verbs only: the source GID index (RoCE: the RoCEv2 GID of the interface that reaches
        the other ranks); -1 takes ``UD_GID_INDEX``, else one is chosen.
    receive_depth : int, default 0
        Verbs only: receives kept posted; 0 takes enough for `window_bytes`. At most what the
        device allows.
    in_place_min_bytes : int, default -1
        An allreduce of a tensor at least this many bytes sums in the caller's tensor, saving
        each chunk's original before its first change (put back if the call fails); a smaller
        one sums in the communicator's scratch and copies the result out at the end. -1 takes
        this rank's share of the CPU's largest cache (``ud_transport.cpu_cache``; at most 32 MiB
        per CPU sharing it, since a VM lists its host's whole cache), split evenly among the
        ranks on its machine (as the rendezvous counts them): in cache the copy at the end is
        cheaper, beyond it summing in place saves cache misses. 0: every allreduce
        in place. Either way the tensor holds the result after a successful call and its
        original values after a failed one. ``UD_IN_PLACE_MIN_BYTES``.

    Raises
    ------
    ValueError
        From ``validate()``, which ``options.build()`` and so ``init()`` call: a field out of
        range. (Constructing Options directly does not validate.)

    Examples
    --------
    >>> ud_transport.init(chunk_bytes=8192, deadline_cap_s=5.0)  # doctest: +SKIP
    >>> Options(window_bytes=1 << 20).validate().window_bytes
    1048576
    """
    chunk_bytes: int = 0
    window_bytes: int = 0
    socket_buffer_bytes: int = 64 * MIB
    end_repeats: int = 3
    credit_refresh_us: int = 2000
    reorder_grace_us: int = 200
    busy_poll_us: int = -1
    idle_close_us: int = 20000
    deadline_cap_s: float = 30.0
    deadline_floor_s: float = 1.0
    deadline_multiplier: float = 4.0
    default_loss_budget: float = 0.1
    estimator: str = "unbiased"
    algorithm: str = "auto"
    copies: int = 1
    stripes: object = "auto"
    agree_resend_us: int = 1000
    join_timeout_s: float = 300.0
    bind_address: str = ""
    store_timeout_s: float = 60.0
    inject: object = field(default=None)
    device: str = ""
    port: int = 0
    gid_index: int = -1
    receive_depth: int = 0
    in_place_min_bytes: int = -1

    def validate(self):
        """Returns self, or raises ValueError naming the first field out of range."""
        if self.chunk_bytes < 0:
            raise ValueError("chunk_bytes must be >= 0")
        if self.window_bytes < 0:
            raise ValueError(f"window_bytes must be >= 0 (0: {WINDOW_DATAGRAMS} chunks), got {self.window_bytes!r}")
        if self.socket_buffer_bytes <= 0:
            raise ValueError("socket_buffer_bytes must be positive")
        if not 0 <= self.default_loss_budget <= 1:
            raise ValueError(f"default_loss_budget must be in [0, 1], got {self.default_loss_budget!r}")
        for name in ("deadline_cap_s", "deadline_floor_s", "deadline_multiplier"):
            value = getattr(self, name)
            if not 0 < value <= 1e6:  # also refuses inf and nan, which the engine cannot turn into a time
                raise ValueError(f"{name} must be a positive number of at most 1e6, got {value!r}")
        if not 0.001 <= self.join_timeout_s <= 4e6:
            raise ValueError(f"join_timeout_s must be between 0.001 and 4e6 seconds, got {self.join_timeout_s!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        check_copies(self.copies)
        check_stripes(self.stripes)
        if not -1 <= self.in_place_min_bytes < 1 << 63:
            raise ValueError(f"in_place_min_bytes must be -1 (the CPU's largest cache) or a byte count, got {self.in_place_min_bytes!r}")
        if not -1 <= self.busy_poll_us <= 1_000_000:
            raise ValueError(f"busy_poll_us must be -1 (auto) or 0 to 1000000 microseconds, got {self.busy_poll_us!r}")
        if not 1 <= self.end_repeats <= _native.MAX_END_REPEATS:
            raise ValueError(f"end_repeats must be between 1 and {_native.MAX_END_REPEATS}, got {self.end_repeats!r}")
        return self

    def engine_options(self, chunk_bytes, window_bytes=None, ranks_here=1, core_share=0, engines=1):
        """The options the C engine takes, by field name (window_bytes: as fitted to the transport's
        buffers; ranks_here: the ranks sharing this machine, and so its cache; core_share: this
        rank's fair share of the machine's CPUs, whole ones; engines: the engines it runs at once,
        one a stripe)."""
        return {"chunk_bytes": chunk_bytes, "window_bytes": window_bytes or credit_window_bytes(self.window_bytes, chunk_bytes),
                "end_repeats": self.end_repeats,
                "credit_refresh_us": self.credit_refresh_us, "reorder_grace_us": self.reorder_grace_us,
                "busy_poll_us": self.resolved_busy_poll_us(core_share, engines), "idle_close_us": self.idle_close_us,
                "agree_resend_us": self.agree_resend_us, "join_timeout_ms": round(self.join_timeout_s * 1000),
                "in_place_min_bytes": self.resolved_in_place_min_bytes(ranks_here)}

    def resolved_busy_poll_us(self, core_share, engines=1):
        """busy_poll_us with -1 replaced: spin only where this rank has a core for each of its
        engines (a striped call runs one a thread, each of which would spin)."""
        if self.busy_poll_us >= 0:
            return self.busy_poll_us
        return AUTO_BUSY_POLL_US if core_share >= max(1, engines) else 0

    def resolved_in_place_min_bytes(self, ranks_here=1):
        """in_place_min_bytes with -1 replaced by this rank's share of the CPU's largest cache: the
        ranks on one machine share it (ranks_here of them), each with its tensors and scratch."""
        if self.in_place_min_bytes != -1:
            return self.in_place_min_bytes
        return cpu_cache.largest_cache_bytes() // max(1, ranks_here)


def check_copies(copies):
    """`copies` if it is an integer from 1 to _native.MAX_COPIES, else ValueError."""
    if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= _native.MAX_COPIES:
        raise ValueError(f"copies must be an integer from 1 to {_native.MAX_COPIES}, got {copies!r}")
    return copies


def check_stripes(stripes, transport="udp"):
    """`stripes` if it is "auto" or an integer from 1 to _native.MAX_STRIPES that `transport` can
    run, else ValueError."""
    if stripes == "auto":
        return stripes
    if isinstance(stripes, bool) or not isinstance(stripes, int) or not 1 <= stripes <= _native.MAX_STRIPES:
        raise ValueError(f"stripes must be \"auto\" or an integer from 1 to {_native.MAX_STRIPES}, got {stripes!r}")
    if stripes > 1 and transport != "udp":
        raise ValueError(f"stripes={stripes} needs the UDP transport; {transport} runs one stripe (UD_STRIPES=1)")
    return stripes


def parse_stripes(text):
    """UD_STRIPES's value: "auto", or the integer it spells (check_stripes judges its range)."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"UD_STRIPES must be \"auto\" or an integer from 1 to {_native.MAX_STRIPES}, got {text!r}") from None


def from_text(name, variable, text):
    """The value `variable` spells for option `name`; None (as if unset) when it is empty, as a
    shell's `UD_WINDOW_BYTES= python ...` sets it. A value of the wrong kind names the variable."""
    if not text.strip():
        return None
    if name == "stripes":
        return parse_stripes(text)
    kind = type(getattr(Options, name))
    if kind is str:
        return text
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{variable} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def build(**overrides):
    """Options from the environment, then `overrides` (unknown names are an error)."""
    known = {f.name: f for f in fields(Options)}
    unknown = set(overrides) - set(known)
    if unknown:
        raise TypeError(f"unknown ud_transport option(s): {', '.join(sorted(unknown))}")
    values = {}
    for name, variable in ENVIRONMENT.items():
        if variable in os.environ:
            value = from_text(name, variable, environment.read(variable))
            if value is not None:
                values[name] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(Options(), **values).validate()
