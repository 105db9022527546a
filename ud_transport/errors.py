"""Exceptions. On every one of them the caller's tensor keeps its values."""


class TransportError(RuntimeError):
    """Base class: a collective could not complete."""


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
