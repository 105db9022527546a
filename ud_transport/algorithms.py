"""Which schedule runs a call: "ring", "direct", or "auto".

The ring sends each block to one neighbour per step: a partial sum travels
N-1 hops, so one lost datagram removes several contributions and every
all-gather hole is copied downstream; what arrives shrinks as the world
grows. The direct (transpose) exchange sends each block straight to its
owner and back: one hop per half, so a loss costs one contribution at one
owner or one chunk at one receiver, whatever the world size.

`auto` takes direct whenever there are more than two ranks (at two ranks the
two schedules are the same exchange). The table behind this choice is in
docs/algorithms.md, "Ring and direct" (`python -m ud_transport simulate` and
`python -m ud_transport bench --algorithm ring,direct` measure it)."""
from . import _native

CODES = {"ring": _native.ALGORITHM_RING, "direct": _native.ALGORITHM_DIRECT}


def resolve(algorithm, world_size):
    """The concrete algorithm name for a call."""
    if algorithm == "auto":
        return "direct" if world_size > 2 else "ring"
    if algorithm not in CODES:
        raise ValueError(f"algorithm must be one of auto, {', '.join(CODES)}; got {algorithm!r}")
    return algorithm
