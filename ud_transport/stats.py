"""What one collective call did."""
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class CollectiveStats:
    """Outcome of one call on one rank.

    The two halves of a call are reported apart, and `loss_budget` bounds each:
    `reduce_fraction` is the share of all ranks' contributions that reached
    their shard's owner (agreed by every rank; 1.0 for collectives without a
    reduce half), `gather_fraction` the least share of fresh (not stale)
    elements in any rank's output (agreed; 1.0 without a gather half)."""
    delivered_fraction: float  # share of all ranks' contributions present in this rank's result
    reduce_fraction: float
    gather_fraction: float
    own_reduce_fraction: float  # this rank's shard only
    own_gather_fraction: float  # this rank's output only
    chunks_total: int  # chunks this rank expected to receive
    chunks_lost: int  # of those, never arrived in time
    chunks_stale: int  # chunks of this rank's output that kept their old value (or, in allreduce, were filled)
    elapsed_s: float
    deadline_s: float
    agree_s: float  # time spent in the verdict round
    join_wait_s: float  # until every rank was known to be in the call (a late rank); the deadline counts from then
    sequence: int
    steps: int
    critical_path: int  # hops on the schedule's longest dependency chain
    datagrams_sent: int
    datagrams_received: int
    dropped_stale: int
    dropped_duplicate: int
    dropped_foreign: int
    dropped_invalid: int
    dropped_early: int
    injected_drops: int
    agree_messages_sent: int
    join_messages_sent: int  # JOIN requests and replies: who is in the call, whether a quiet sender is alive
    receive_overflow_drops: int  # datagrams the kernel dropped at this rank's full receive queue (self-inflicted loss)
    verdict_acks_presumed: int  # peers whose acknowledgement of our verdict we stopped waiting for (silent long after it went to them)
    steps_ended: int  # receive steps with missing chunks closed by the END marker (or all the sender announced),
    steps_superseded: int  # by data of a later step,
    steps_idle_closed: int  # by quiet after a gap,
    steps_timed_out: int  # or by their share of the deadline
    idle_waits: int
    credit_stalls: int
    agreed_value: int  # max over ranks of agree()'s value
    deadline_expired: bool
    silent_rank: int  # -1 when all peers were heard
    mismatched_rank: int  # -1 unless a rank called with another layout
    collective: str = ""
    algorithm: str = ""
    transport: str = ""

    @property
    def missing_fraction(self):
        """1 - delivered_fraction: the share of contributions that did not make it into the result."""
        return 1.0 - self.delivered_fraction

    def to_dict(self):
        """Every field by name (for logs and JSON)."""
        return asdict(self)

    @classmethod
    def from_native(cls, raw, **labels):
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        values["deadline_expired"] = bool(values["deadline_expired"])
        return cls(**values, **labels)


AllreduceStats = CollectiveStats  # the name before reduce_scatter, all_gather and broadcast existed
