"""Seeded loss injection, applied inside the C transport layer.

Pass one to ``init(..., inject=...)``, or set ``UD_INJECT`` for scripts:
``UD_INJECT="bernoulli:0.1"`` or ``UD_INJECT="gilbert_elliott:0.01,0.3,0.0,0.8"``
(good->bad, bad->good, loss in good, loss in bad) with ``UD_INJECT_SEED``.
"""
from dataclasses import dataclass

from . import _native, environment

_BERNOULLI = _native.LOSS_BERNOULLI
_GILBERT_ELLIOTT = _native.LOSS_GILBERT_ELLIOTT


def _check_probability(name, value):
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")


@dataclass(frozen=True)
class Bernoulli:
    """Each received datagram is lost independently with probability `p` (the model of
    Weintraub et al.).

    Dropped below the engine, which cannot tell it from the network; counted in
    ``CollectiveStats.injected_drops``.

    Attributes
    ----------
    p : float in [0, 1]
        Loss probability per datagram.
    seed : int, default 0
        Seed of the random stream; each rank derives its own from it, so a run repeats.

    Raises
    ------
    ValueError
        `p` outside [0, 1].

    Examples
    --------
    >>> ud_transport.init(inject=Bernoulli(0.1, seed=1))  # doctest: +SKIP
    >>> Bernoulli(0.1).mean_loss
    0.1
    """

    p: float
    seed: int = 0

    def __post_init__(self):
        _check_probability("p", self.p)

    @property
    def mean_loss(self):
        """The long-run fraction of datagrams lost: p."""
        return self.p

    def native_parameters(self):
        """Keyword arguments of the C transport's loss wrapper (Transport.inject_loss)."""
        return dict(kind=_BERNOULLI, loss=self.p)


@dataclass(frozen=True)
class GilbertElliott:
    """Two-state bursty loss: a good state with rare loss and a bad state with
    heavy loss (DBLP's microbursts lose 60-90% for a few iterations).

    Each rank's receiver starts in the good state; per received datagram it first changes
    state with the transition probability, then loses the datagram with that state's loss
    probability. Counted in ``CollectiveStats.injected_drops``.

    Attributes
    ----------
    good_to_bad : float in [0, 1], default 0.001
        Probability per datagram of entering the bad state.
    bad_to_good : float in [0, 1], default 0.05
        Probability per datagram of leaving it (mean burst: 1 / bad_to_good datagrams).
    loss_in_good : float in [0, 1], default 0.0
        Loss probability in the good state.
    loss_in_bad : float in [0, 1], default 0.8
        Loss probability in the bad state.
    seed : int, default 0
        Seed of the random stream; each rank derives its own from it, so a run repeats.

    Raises
    ------
    ValueError
        A probability outside [0, 1], or both transition probabilities 0.

    Examples
    --------
    >>> bursts = GilbertElliott(good_to_bad=0.01, bad_to_good=0.09, loss_in_bad=0.8, seed=7)
    >>> round(bursts.mean_loss, 3)
    0.08
    >>> ud_transport.init(inject=bursts)  # doctest: +SKIP
    """

    good_to_bad: float = 0.001
    bad_to_good: float = 0.05
    loss_in_good: float = 0.0
    loss_in_bad: float = 0.8
    seed: int = 0

    def __post_init__(self):
        for name in ("good_to_bad", "bad_to_good", "loss_in_good", "loss_in_bad"):
            _check_probability(name, getattr(self, name))
        if self.good_to_bad + self.bad_to_good == 0:
            raise ValueError("good_to_bad and bad_to_good cannot both be 0")

    @property
    def mean_loss(self):
        """The long-run fraction of datagrams lost: the stationary share of each state times its loss."""
        bad_share = self.good_to_bad / (self.good_to_bad + self.bad_to_good)
        return bad_share * self.loss_in_bad + (1 - bad_share) * self.loss_in_good

    def native_parameters(self):
        """Keyword arguments of the C transport's loss wrapper (Transport.inject_loss)."""
        return dict(kind=_GILBERT_ELLIOTT, good_to_bad=self.good_to_bad, bad_to_good=self.bad_to_good,
                    loss_in_good=self.loss_in_good, loss_in_bad=self.loss_in_bad)


def rank_seed(seed, rank):
    """Different, reproducible streams per rank from one user seed."""
    return (int(seed) * 0x9E3779B97F4A7C15 + (rank + 1) * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF


def from_string(text, seed=0):
    """Parse 'none', 'bernoulli:P' or 'gilbert_elliott:G2B,B2G,LG,LB'."""
    text = text.strip()
    if not text or text == "none":
        return None
    name, _, params = text.partition(":")
    values = [float(v) for v in params.split(",") if v.strip()]
    if name in ("bernoulli", "b"):
        if len(values) != 1:
            raise ValueError(f"bernoulli takes one probability, got {text!r}")
        return Bernoulli(values[0], seed=seed)
    if name in ("gilbert_elliott", "ge"):
        if len(values) != 4:
            raise ValueError(f"gilbert_elliott takes good_to_bad,bad_to_good,loss_in_good,loss_in_bad, got {text!r}")
        return GilbertElliott(*values, seed=seed)
    raise ValueError(f"unknown loss model {name!r}: use bernoulli:P or gilbert_elliott:G2B,B2G,LG,LB")


def from_environment():
    text = environment.read("UD_INJECT", "")
    return from_string(text, seed=int(environment.read("UD_INJECT_SEED", "0") or 0)) if text else None
