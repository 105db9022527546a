"""What one collective call did."""
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AllreduceStats:
    delivered_fraction: float  # share of all ranks' contributions present in this rank's result
    chunks_total: int  # chunks this rank expected to receive
    chunks_lost: int  # of those, never arrived in time
    elapsed_s: float
    deadline_s: float
    sequence: int
    datagrams_sent: int
    datagrams_received: int
    dropped_stale: int
    dropped_duplicate: int
    dropped_foreign: int
    dropped_invalid: int
    dropped_early: int
    injected_drops: int
    steps_ended: int  # receive steps with missing chunks closed by the END marker,
    steps_superseded: int  # by data of a later step,
    steps_idle_closed: int  # by quiet after a gap,
    steps_timed_out: int  # or by their share of the deadline
    idle_waits: int
    credit_stalls: int
    deadline_expired: bool
    silent_rank: int  # -1 when all peers were heard
    transport: str = ""

    @property
    def missing_fraction(self):
        return 1.0 - self.delivered_fraction

    @classmethod
    def from_native(cls, raw, transport):
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        values["deadline_expired"] = bool(values["deadline_expired"])
        return cls(transport=transport, **values)
