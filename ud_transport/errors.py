"""Exceptions. On every one of them the caller's tensor keeps its values."""


class TransportError(RuntimeError):
    """Base class: a collective, or the communicator itself, could not complete.

    Raised as itself when the transport failed (here or at a peer), the rendezvous failed
    within ``Options.store_timeout_s``, the communicator is closed, or ``get_default()`` finds
    none; the subclasses name the other causes. Every rank of a failed call raises the same
    error. Picklable, with its attributes.

    Attributes
    ----------
    call : str or None
        The system or libibverbs call that failed underneath ("bind", "ibv_post_send"), as
        the C layer reported it; None when the error is not a failed call.
    errno : int or None
        That call's errno.
    object : str or None
        What the call was made on (an address, a device), as the C layer named it.

    Examples
    --------
    >>> try:                                                  # doctest: +SKIP
    ...     ud_transport.allreduce(gradient)
    ... except ud_transport.TransportError as error:
    ...     print(error, error.call, error.errno)
    """

    call = None
    errno = None
    object = None

    @classmethod
    def caused_by(cls, message, cause):
        """This error with the failed call's fields taken from `cause` (a NativeError,
        an OSError of the native layer, or anything without them)."""
        error = cls(message)
        call = getattr(cause, "call", None)
        if call:
            error.call, error.errno, error.object = call, getattr(cause, "errno", None), getattr(cause, "object", None)
        return error


class LossBudgetExceeded(TransportError):
    """More of the result was missing at the deadline than `loss_budget` allows.

    Raised by a lossy collective when ``1 - stats.reduce_fraction`` or
    ``1 - stats.gather_fraction`` exceeds the call's budget (the verdict every rank agreed
    on, so every rank raises it); by the exact collectives of the c10d backend when their
    repeats did not complete; by the torch integration under ``on_budget_miss="raise"``. The
    caller's tensors keep their values.

    Attributes
    ----------
    stats : CollectiveStats or None
        The failed call's stats: how much arrived (``reduce_fraction``,
        ``gather_fraction``, ``chunks_lost``).

    Examples
    --------
    >>> try:                                                       # doctest: +SKIP
    ...     ud_transport.allreduce(gradient, loss_budget=0.05)
    ... except ud_transport.LossBudgetExceeded as error:
    ...     print(error.stats.reduce_fraction)                      # gradient unchanged
    0.93
    """

    def __init__(self, message, stats):
        super().__init__(message)
        self.stats = stats

    def __reduce__(self):  # keep the stats when sent between processes
        return type(self), (str(self), self.stats)


class RankError(TransportError):
    """An error caused by one identifiable rank: the base of PeerTimeout and LayoutMismatch.

    Attributes
    ----------
    rank : int
        The rank blamed, the same on every rank.
    stats : CollectiveStats or None
        The failed call's stats.
    """

    def __init__(self, message, rank, stats=None):
        super().__init__(message)
        self.rank = rank
        self.stats = stats

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.stats)


class PeerTimeout(RankError):
    """A rank did not take part: it did not join the call within ``Options.join_timeout_s``,
    went silent past the deadline, or is gone (UDP: its port is closed).

    Attributes
    ----------
    rank : int
        The rank blamed (``stats.silent_rank``), the same on every rank.
    stats : CollectiveStats or None
        The failed call's stats.

    Examples
    --------
    >>> try:                                             # doctest: +SKIP
    ...     ud_transport.allreduce(gradient, deadline=5)
    ... except ud_transport.PeerTimeout as error:
    ...     print(f"rank {error.rank} is not answering")
    """


class LayoutMismatch(RankError):
    """Ranks called with different layouts: another collective, element count, dtype, op
    or root. A programming error; nothing of the result is applied.

    Attributes
    ----------
    rank : int
        A rank whose layout differs (``stats.mismatched_rank``), the same on every rank; -1
        where an all_to_all_pieces call's ranks disagree on the sizes of their pieces (no one
        rank to blame).
    stats : CollectiveStats or None
        The failed call's stats.

    Examples
    --------
    >>> try:                                             # doctest: +SKIP
    ...     ud_transport.allreduce(np.zeros(rank + 1, dtype=np.float32))
    ... except ud_transport.LayoutMismatch as error:
    ...     print(f"rank {error.rank} called with another layout")
    """
