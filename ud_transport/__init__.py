"""ud_transport: collectives for distributed training over unreliable datagrams.

    import ud_transport
    ud_transport.init()                        # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    stats = ud_transport.allreduce(tensor, loss_budget=0.1)
"""
import inspect
import logging
import os

from . import log_switch, loss_models
from .communicator import Communicator
from .errors import LayoutMismatch, LossBudgetExceeded, PeerTimeout, TransportError
from .loss_models import Bernoulli, GilbertElliott
from .options import Options
from .stats import AllreduceStats, CollectiveStats
from .tensors import Estimator, ReduceOp

__all__ = [
    "init", "allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "all_to_all_pieces", "agree",
    "get_default", "close",
    "Communicator", "CollectiveStats", "AllreduceStats", "Options", "ReduceOp", "Estimator",
    "TransportError", "LossBudgetExceeded", "PeerTimeout", "LayoutMismatch", "Bernoulli", "GilbertElliott",
]
from ._version import __version__  # noqa: E402

logging.getLogger("ud_transport").addHandler(logging.NullHandler())
log_switch.apply_environment(logging.getLogger("ud_transport"))  # UD_LOG=debug|info|warning|error

_default = None


def init(rank=None, world_size=None, *, store=None, transport="auto", name=None, **options):
    """Create a Communicator and make it the default one (closing the previous default).

    Parameters
    ----------
    rank, world_size : int, optional
        None reads torchrun's ``RANK`` and ``WORLD_SIZE``.
    store : torch.distributed.Store, optional
        Where the ranks meet; None connects a TCPStore at ``MASTER_ADDR``:``MASTER_PORT``.
    transport : {"auto", "udp", "verbs"}, default "auto"
        "auto" takes verbs when an RDMA port is active, else UDP (``UD_TRANSPORT`` overrides).
    name : str, optional
        Keys the rendezvous in `store`, and is the communicator's ``family``: what a newcomer
        names to join it (``Communicator.join``, docs/elastic.md).
    **options
        Fields of ``ud_transport.Options``, e.g. ``chunk_bytes=``, ``deadline_cap_s=``,
        ``inject=Bernoulli(0.1, seed=1)``; unset ones come from the environment
        (docs/configuration.md, "Environment variables"), then the defaults.

    Returns
    -------
    Communicator

    Raises
    ------
    ValueError
        No rank or world size, or a rank outside the world (before any network activity).
    TypeError
        An unknown option.
    TransportError
        The rendezvous failed within ``store_timeout_s``, or the transport could not open.

    Examples
    --------
    >>> import ud_transport                                   # doctest: +SKIP
    >>> ud_transport.init()                                   # under torchrun  # doctest: +SKIP
    >>> ud_transport.allreduce(gradient, loss_budget=0.1)     # doctest: +SKIP
    """
    global _default
    from . import options as options_module
    from . import rendezvous

    rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None and "WORLD_SIZE" in os.environ else world_size
    if rank is None or world_size is None:
        raise ValueError("init() needs rank and world_size, or RANK and WORLD_SIZE in the environment")
    if not isinstance(rank, int) or not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        # before any network activity: a rank out of range would otherwise wait for a rendezvous that cannot complete
        raise ValueError(f"rank {rank!r} is not in a world of {world_size!r} (need integers, 0 <= rank < world_size)")
    if "inject" not in options:
        options["inject"] = loss_models.from_environment()
    resolved = options_module.build(**options)
    if store is None:
        store = rendezvous.store_from_environment(rank, world_size, resolved.store_timeout_s)
    communicator = Communicator(rank, world_size, store, transport, resolved, name=name)
    if _default is not None:
        _default.close()
    _default = communicator
    return communicator


def get_default():
    """The communicator ``init()`` made, which the module-level collectives use.

    Returns
    -------
    Communicator

    Raises
    ------
    TransportError
        There is none, or it was closed.

    Examples
    --------
    >>> ud_transport.init()                                      # doctest: +SKIP
    >>> ud_transport.get_default().shard_range(1000)  # rank 1 of 4  # doctest: +SKIP
    (250, 500)
    """
    if _default is None or _default.closed:
        raise TransportError("no default communicator: call ud_transport.init() first")
    return _default


def allreduce(tensor, loss_budget=None, *, op="sum", deadline=None, estimator=None, algorithm=None, copies=None,
              on_miss="raise", reduce_in_rank_order=False):
    """Allreduce on the default communicator (see Communicator.allreduce)."""
    return get_default().allreduce(tensor, op=op, loss_budget=loss_budget, deadline=deadline, estimator=estimator,
                                   algorithm=algorithm, copies=copies, on_miss=on_miss,
                                   reduce_in_rank_order=reduce_in_rank_order)


def reduce_scatter(tensor, output, loss_budget=None, **keywords):
    """Reduce-scatter on the default communicator (see Communicator.reduce_scatter)."""
    return get_default().reduce_scatter(tensor, output, loss_budget=loss_budget, **keywords)


def all_gather(shard, output, loss_budget=None, **keywords):
    """All-gather on the default communicator (see Communicator.all_gather)."""
    return get_default().all_gather(shard, output, loss_budget=loss_budget, **keywords)


def broadcast(tensor, src=0, loss_budget=None, **keywords):
    """Broadcast on the default communicator (see Communicator.broadcast)."""
    return get_default().broadcast(tensor, src, loss_budget=loss_budget, **keywords)


def all_to_all(tensor, output, loss_budget=None, **keywords):
    """All-to-all on the default communicator (see Communicator.all_to_all)."""
    return get_default().all_to_all(tensor, output, loss_budget=loss_budget, **keywords)


def all_to_all_pieces(tensor, output, sends, takes, loss_budget=None, **keywords):
    """All-to-all of pieces of their own sizes on the default communicator (see Communicator.all_to_all_pieces)."""
    return get_default().all_to_all_pieces(tensor, output, sends, takes, loss_budget=loss_budget, **keywords)


def agree(value, **keywords):
    """The maximum of `value` over all ranks (see Communicator.agree)."""
    return get_default().agree(value, **keywords)


def close():
    """Close the default communicator, if any, and forget it (safe to call more than once).

    The module-level collectives then raise TransportError until ``init()`` is called again.

    Examples
    --------
    >>> ud_transport.init()    # doctest: +SKIP
    >>> ud_transport.close()   # doctest: +SKIP
    """
    global _default
    if _default is not None:
        _default.close()
        _default = None


def _on_the_default(function, method):
    function.__doc__ = (f"{method.__name__} on the default communicator (made by ud_transport.init()).\n\n"
                        f"Same as ``ud_transport.get_default().{method.__name__}(...)``:\n\n" + inspect.getdoc(method))


for _function in (allreduce, reduce_scatter, all_gather, broadcast, all_to_all, all_to_all_pieces, agree):
    _on_the_default(_function, getattr(Communicator, _function.__name__))
del _function
