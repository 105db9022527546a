"""What the ranks of tests/test_messages.py run (importable by the cluster's workers)."""
import torch

from ud_transport import exact
from ud_transport.errors import LossBudgetExceeded

# (element count, dtype name, contiguous): small_broadcast() takes the contiguous ones of whole
# 32-bit words itself; the others (3 bytes, a strided view) go to broadcast(), which must pair with it
CASES = [(1024, "float32", True), (3, "uint8", True), (2, "float16", True), (700, "int32", True),
         (40, "float64", False), (1, "int64", True)]


def _tensors(comm, src, count, dtype_name, contiguous, round_):
    dtype = getattr(torch, dtype_name)
    sent = (torch.arange(count) % 89 + 7 + round_).to(dtype)
    old = torch.full((count,), -3, dtype=dtype)
    mine = sent.clone() if comm.rank == src else old.clone()
    if not contiguous:  # every other element of a tensor twice its size
        holder = torch.zeros(2 * count, dtype=dtype)
        holder[::2] = mine
        mine = holder[::2]
    return sent, old, mine


def messages(comm, src, rounds, takes_message):
    """Each case of CASES `rounds` times, from `src`: by small_broadcast() where takes_message(rank,
    round) says so, else by broadcast(). Per message (whether the tensor ended with the root's
    values, how many engine calls it took, their collectives, the payload bytes this rank sent in
    the first, and whether small_broadcast() left it to broadcast(): None where broadcast() was
    called itself); then the (byte count, src, claim) of each plan small_broadcast() made."""
    exact._first_call_copying.pop(comm, None)  # as on a new communicator: on every rank alike
    out = []
    handed_over = []
    plain = exact.broadcast

    def counted(*arguments, **keywords):  # what small_broadcast() hands to broadcast()
        handed_over.append(True)
        return plain(*arguments, **keywords)
    exact.broadcast = counted
    try:
        for round_ in range(rounds):
            for count, dtype_name, contiguous in CASES:
                sent, _, mine = _tensors(comm, src, count, dtype_name, contiguous, round_)
                handed_over.clear()
                if takes_message(comm.rank, round_):
                    stats = exact.small_broadcast(comm, mine, src, deadline=10.0)
                    left = bool(handed_over)
                else:
                    stats, left = plain(comm, mine, src, deadline=10.0), None
                out.append((torch.equal(mine, sent), len(stats), {s.collective for s in stats},
                            stats[0].payload_bytes_sent, left))
    finally:
        exact.broadcast = plain
    return out, sorted(key for key, plan in exact._broadcast_plans.get(comm, {}).items() if plan is not None)


def by_message_on_even_rounds_of_rank_0(rank, round_):
    return rank != 0 or round_ % 2 == 0


def failed_messages(comm, src, rounds, attempts):
    """Messages of CASES that may make at most `attempts` engine calls each, under loss: per
    message (what it raised, or "no error"; whether the tensor ended with the root's values, or
    else kept its own)."""
    out = []
    for round_ in range(rounds):
        for count, dtype_name, contiguous in CASES:
            sent, old, mine = _tensors(comm, src, count, dtype_name, contiguous, round_)
            try:
                exact.small_broadcast(comm, mine, src, attempts=attempts, deadline=10.0)
                outcome = "no error"
            except LossBudgetExceeded:
                outcome = "LossBudgetExceeded"
            want = sent if outcome == "no error" or comm.rank == src else old
            out.append((outcome, torch.equal(mine, want)))
    return out
