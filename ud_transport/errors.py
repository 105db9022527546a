"""Exceptions. On every one of them the caller's tensor keeps its values."""


class TransportError(RuntimeError):
    """Base class: a collective could not complete.

    When a system or libibverbs call failed underneath, `call` names it ("bind",
    "ibv_post_send"), `errno` is its errno and `object` what it was called on, as
    the C layer reported them; otherwise the three are None."""

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
    """More of the result was missing at the deadline than loss_budget allows."""

    def __init__(self, message, stats):
        super().__init__(message)
        self.stats = stats

    def __reduce__(self):  # keep the stats when sent between processes
        return type(self), (str(self), self.stats)


class RankError(TransportError):
    """An error caused by one identifiable rank (`.rank`)."""

    def __init__(self, message, rank, stats=None):
        super().__init__(message)
        self.rank = rank
        self.stats = stats

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.stats)


class PeerTimeout(RankError):
    """A rank sent nothing within the deadline."""


class LayoutMismatch(RankError):
    """Ranks called the same collective with different sizes, dtypes or ops."""
