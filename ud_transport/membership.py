"""Who is in a group after a rank dies or a rank comes: the checks a shrink's exclusion list
and a grow's count must pass (the same as torch.distributed.shrink_group's), and where the
survivors meet (newcomers are seated by ud_transport.seats).

The survivors of a group meet under keys named by the old group's session and what changed,
so every survivor that excludes the same ranks meets the others, and a group made again on the
same store reads nothing of another. Nothing here sends a datagram."""


def exclusion(ranks_to_exclude, rank, world_size):
    """The ranks to exclude, sorted, checked as torch.distributed.shrink_group checks them (the
    same errors for a caller who comes without torch's wrapper).

    Raises
    ------
    TypeError
        Not a list or tuple of integers.
    ValueError
        Empty, a rank twice, out of range, or every rank.
    RuntimeError
        `rank` itself is excluded: only the ranks that remain take part.
    """
    if not isinstance(ranks_to_exclude, (list, tuple)):
        raise TypeError(f"ranks_to_exclude must be a list, got {type(ranks_to_exclude).__name__}")
    if not ranks_to_exclude:
        raise ValueError("ranks_to_exclude cannot be empty: name at least one rank to exclude")
    for rank_excluded in ranks_to_exclude:
        if isinstance(rank_excluded, bool) or not isinstance(rank_excluded, int):
            raise TypeError(f"ranks_to_exclude must hold integers, got {rank_excluded!r}")
        if not 0 <= rank_excluded < world_size:
            raise ValueError(f"rank {rank_excluded} is out of bounds for a group of {world_size}")
    excluded = sorted(set(ranks_to_exclude))
    if len(excluded) != len(ranks_to_exclude):
        raise ValueError(f"ranks_to_exclude names a rank twice: {list(ranks_to_exclude)}")
    if len(excluded) >= world_size:
        raise ValueError(f"cannot exclude all {world_size} ranks of the group: at least one must remain")
    if rank in excluded:
        raise RuntimeError(f"rank {rank} is in ranks_to_exclude and must not call shrink: only the ranks that "
                           "remain take part")
    return excluded


def check_growth(world_size, newcomers):
    """Refuse a grow by `newcomers` (not an integer of at least 1, or a world past the maximum)
    before anything is offered in the store.

    Raises
    ------
    ValueError
    """
    from . import _native

    if isinstance(newcomers, bool) or not isinstance(newcomers, int) or newcomers < 1:
        raise ValueError(f"newcomers must be an integer of at least 1, got {newcomers!r}")
    if world_size + newcomers > _native.MAX_WORLD_SIZE:
        raise ValueError(f"{world_size} + {newcomers} ranks exceed the supported maximum {_native.MAX_WORLD_SIZE}")


def survivors(excluded, world_size):
    """The ranks that remain, in order: survivor i is rank i of the shrunk group."""
    return [rank for rank in range(world_size) if rank not in excluded]


def shrink_key(session_id, excluded):
    """Where the survivors of the group with `session_id` that exclude `excluded` meet."""
    return f"shrink/{session_id:016x}/{'-'.join(map(str, excluded))}"
