"""Growing the default "ud" group: a replacement for a dead rank (or any new rank) joins the
ranks that are there, at a step boundary. torch has no API for it (shrink_group's inverse does
not exist); this one is in its style:

    group = ud_transport.torch.grow_group(1)            # every rank of the default group
    group = ud_transport.torch.join_group(store)        # the newcomer, with the job's store

Both end in torch's own init_process_group over the grown world, so the grown group is the
default group as any other: the ranks there keep their numbers, newcomers come after them in
the order they called join_group. Like shrink_group on the default group, growing destroys the
other groups (their ranks mean what they meant in the old world; make them again)."""
import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import membership, seats
from .backend import ProcessGroupUD

FAMILY = "c10d-default"  # where the default group's newcomers are seated, in the job's store


def grow_group(newcomers, *, store=None, seat_timeout=None):
    """Grow the default "ud" group by `newcomers` ranks that call ``join_group``.

    Every rank of the default group calls it with the same count at the same point; it returns
    when every newcomer has taken its seat (up to `seat_timeout`) and every rank and newcomer has
    met (up to the group's timeout).

    Parameters
    ----------
    newcomers : int
        At least 1.
    store : torch.distributed.Store, optional
        The job's store (the newcomers are given it); None takes the default group's. Seats and
        the meeting are keyed in the store under its prefixes (``PrefixStore`` wrappers are
        looked through), named by the group's session.
    seat_timeout : datetime.timedelta, optional
        How long rank 0 waits for the newcomers to take their seats (the other ranks wait twice
        as long for its outcome); None takes the default group's timeout (init_process_group's,
        30 minutes unless given), as a replacement process may take minutes to start.

    Returns
    -------
    ProcessGroupUD
        The new default group (``dist.group.WORLD``), of the old size plus `newcomers`.

    Raises
    ------
    ValueError
        `newcomers` below 1, a world past the supported maximum, or the default group is not a
        "ud" group.
    TypeError
        `seat_timeout` is not a timedelta.
    TransportError
        A newcomer did not take its seat within `seat_timeout`: the default group is then
        as it was (nothing was destroyed) and the seats are withdrawn, so a newcomer that comes
        later waits for the next grow. Or, after the seats were taken, not every rank and
        newcomer met within the timeout (the old group is destroyed by then).

    Examples
    --------
    >>> group = grow_group(1)  # doctest: +SKIP
    >>> model = DDP(module)   # broadcasts rank 0's parameters to the newcomer  # doctest: +SKIP
    """
    group = c10d._get_default_group()
    if not isinstance(group, ProcessGroupUD):
        raise ValueError(f"grow_group grows a default group on backend 'ud', not on {dist.get_backend()!r}")
    membership.check_growth(group.size(), newcomers)
    if seat_timeout is not None and not isinstance(seat_timeout, datetime.timedelta):
        raise TypeError(f"seat_timeout must be a datetime.timedelta, got {type(seat_timeout).__name__}")
    store = _root(store if store is not None else c10d._get_default_store())
    rank, size, session = group.rank(), group.size(), group.communicator.session_id
    timeout, options = group._timeout, group.config
    attempt, group.grows_tried = group.grows_tried, group.grows_tried + 1
    waited = seat_timeout if seat_timeout is not None else timeout
    seconds = waited.total_seconds() if isinstance(waited, datetime.timedelta) else group.communicator.options.store_timeout_s
    key = seats.settle_grow(store, FAMILY, session, attempt, rank, size, newcomers, seconds)
    dist.destroy_process_group()  # only now: a grow whose newcomers did not come leaves the group standing
    return _meet(store, key, rank, size + newcomers, timeout, options)


def join_group(store, *, timeout=datetime.timedelta(minutes=30), pg_options=None, wait_s=600.0):
    """Join the job's default "ud" group as a new rank when its ranks next call ``grow_group``;
    this process must have no default group yet.

    Parameters
    ----------
    store : torch.distributed.Store
        The job's store (one that outlives every rank: under torchrun, the agent's), bare or
        wrapped in prefixes (they are looked through).
    timeout : datetime.timedelta
        The group's timeout, as ``init_process_group`` takes it.
    pg_options : BackendOptions, optional
        The group's options; they should match the other ranks'.
    wait_s : float, default 600
        How long to wait for a grow to seat this rank.

    Returns
    -------
    ProcessGroupUD
        The default group, in which this rank comes after the ranks that were there.

    Raises
    ------
    RuntimeError
        This process already has a default group.
    TransportError
        No grow seated it within `wait_s`, or the meeting failed.

    Examples
    --------
    >>> group = join_group(dist.TCPStore(host, port, is_master=False))  # doctest: +SKIP
    """
    if dist.is_initialized():
        raise RuntimeError("join_group: this process already has a default group (destroy it first)")
    store = _root(store)
    seat = seats.take_seat(store, FAMILY, wait_s)
    return _meet(store, seat.key, seat.rank, seat.world_size, timeout, pg_options)


def _meet(store, key, rank, world_size, timeout, options):
    dist.init_process_group("ud", store=dist.PrefixStore(key, store), rank=rank, world_size=world_size,
                            timeout=timeout, pg_options=options)
    return dist.group.WORLD


def _root(store):
    """The store under every prefix: c10d wraps the one init_process_group was given (in
    "default_pg/" under env://, in the group's name always, in a grow's key after a grow), and a
    newcomer may hold it bare or wrapped otherwise, so seats and meetings are keyed in the root."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store
