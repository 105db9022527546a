"""What one collective call did."""
import functools
from dataclasses import asdict, dataclass, fields

# Counters shown by repr() when nonzero: datagrams that did not count, and why.
NOTABLE_DROPS = ("injected_drops", "receive_overflow_drops", "dropped_stale", "dropped_duplicate", "dropped_foreign",
                 "dropped_invalid", "dropped_early")


# repr=False: the generated repr lists every field; ours is one readable line
@dataclass(frozen=True, repr=False)
class CollectiveStats:
    """Outcome of one collective call on one rank, returned by every collective.

    The two halves of a call are reported apart, and `loss_budget` bounds each:
    `reduce_fraction` is the share of all ranks' contributions that reached
    their shard's owner (agreed by every rank; 1.0 for collectives without a
    reduce half), `gather_fraction` the least share of fresh (not stale)
    elements in any rank's output (agreed; 1.0 without a gather half).
    Frozen, comparable with ``==`` and picklable; ``to_dict()`` gives every
    field, ``repr()`` one line with the key values (and the rank blamed, the
    deadline expiring and nonzero drop counters, when there are any).

    Attributes
    ----------
    delivered_fraction : float
        Share of all ranks' contributions present in this rank's result.
    reduce_fraction : float
        Agreed: share of all contributions that reached their shard's owner.
    gather_fraction : float
        Agreed: the least share of fresh elements in any rank's output.
    own_reduce_fraction : float
        `reduce_fraction` for this rank's shard only (not agreed).
    own_gather_fraction : float
        `gather_fraction` for this rank's output only (not agreed).
    chunks_total : int
        Chunks this rank expected to receive.
    chunks_lost : int
        Of those, the ones that never arrived in time.
    chunks_stale : int
        Chunks of this rank's output whose final value did not arrive: kept their old value
        (all_gather, broadcast) or were filled (allreduce: see Estimator).
    elapsed_s : float
        Seconds from the call's start to its end: join wait, verdict round and the write of the
        result into the tensor (or its put-back) included.
    deadline_s : float
        Seconds the data phase was allowed (given, or the adaptive default).
    agree_s : float
        Seconds spent in the verdict round.
    join_wait_s : float
        Seconds until every rank was known to be in the call; the deadline counts from then.
    output_s : float
        Seconds spent after the verdict writing the result into the tensor (or putting the tensor
        back); part of ``elapsed_s``. Summing in the scratch, it is one copy of the tensor.
    sequence : int
        The call's number on this communicator (wraps at 2**32).
    steps : int
        Steps of the schedule.
    critical_path : int
        Hops on the schedule's longest dependency chain.
    datagrams_sent : int
        Every datagram this rank sent: data, markers, credits, JOIN and verdict messages.
    payload_bytes_sent : int
        The data payloads among them, in bytes (every copy; headers not counted): what the
        collective moved from this rank.
    datagrams_received : int
        Valid data datagrams used.
    dropped_stale : int
        Datagrams dropped as belonging to an earlier call or a step already closed.
    dropped_duplicate : int
        Datagrams dropped as copies of a chunk already received.
    redundant_copies : int
        With ``copies`` > 1: the later copies of chunks already received (expected, not drops).
    dropped_foreign : int
        Datagrams dropped for a wrong magic, version, session or source.
    dropped_invalid : int
        Datagrams dropped as truncated, out of range or with inconsistent lengths.
    dropped_early : int
        Datagrams dropped because they would have overwritten data not yet sent.
    injected_drops : int
        Received datagrams the injected loss model (``Options.inject``) discarded.
    agree_messages_sent : int
        Verdict-round messages sent.
    join_messages_sent : int
        JOIN requests and replies: who is in the call, whether a quiet sender is alive.
    credits_sent : int
        CREDIT datagrams sent, every copy (flow control: how far each sender may go). One copy
        each where loss has been rare for long, two otherwise.
    ends_sent : int
        END markers sent, every copy (a step's last word to its receiver, which needs it only where
        a chunk of the step was lost). As few as one each where loss has been rare, up to
        ``Options.end_repeats`` otherwise.
    receive_overflow_drops : int
        Datagrams the kernel dropped at this rank's full receive queue (self-inflicted loss:
        lower ``Options.window_bytes`` or raise ``net.core.rmem_max``).
    send_calls, receive_calls : int
        System calls this rank's transport made during the call: every ``sendmmsg`` (one the
        full socket refused too), and each ``recvmmsg`` that returned datagrams (UDP; 0 on verbs).
        ``datagrams_sent / send_calls`` is the batching the kernel got: one call carries up to
        32 datagrams, in GSO messages of up to 64 KB each.
    verdict_acks_presumed : int
        Peers whose acknowledgement of this rank's verdict was presumed (silent long after it
        went to them).
    verdicts_relayed : int
        Peers' verdicts this rank took from another rank that passed them on, because none of
        the peer's own copies reached it (a partial partition, or the peer died after sending).
    answer_waits : int
        1 when this rank was to stay after its last answer of the verdict round, in case a peer
        lost every copy of it: only where recent loss makes that likely enough to matter
        (docs/semantics.md, "How the verdict round ends"); a striped call sums its stripes.
    steps_ended, steps_superseded, steps_answered, steps_timed_out : int
        Receive steps with missing chunks, by how they closed: by the sender's END marker (its
        verdict message, or all it announced having come), by data of a later step, by the
        sender's answer to a JOIN request saying it sends nothing more of the step (asked at the
        step's share of the deadline, or after ``Options.idle_close_us`` without arrivals), or by
        the call's deadline.
    idle_waits : int
        Times the engine slept waiting for the network.
    credit_stalls : int
        Times sending stopped at a receiver's credit limit (``Options.window_bytes``).
    agreed_value : int
        The maximum over ranks of ``agree()``'s value (0 for other collectives).
    deadline_expired : bool
        The data phase reached its deadline.
    budget_missed : bool
        Agreed: more than the call's ``loss_budget`` was missing (the engine's one rule,
        ``ud_transport._native.budget_missed``). Only a call made with ``on_miss="return"``
        returns with it set; otherwise a miss raises LossBudgetExceeded, whose ``.stats`` has it.
    in_place : bool
        An allreduce that summed in the caller's tensor (at least ``Options.in_place_min_bytes``),
        not in the scratch.
    silent_rank : int
        A rank not heard from (the one a PeerTimeout names); -1 when every peer was heard.
    mismatched_rank : int
        A rank that called with another layout; -1 when none did.
    stripes : int
        Parts the call ran as at once, each on its own socket and thread (``Options.stripes``);
        1 for a call that was not split. Counters are summed over the stripes, times are the
        longest stripe's, fractions are weighted by each stripe's share of the tensor.
    stripes_vetoed : int
        Stripes whose own verdict was OK but that failed with the call because another stripe
        failed (the tensor is put back whole).
    collective : str
        "allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "scatter",
        "gather" or "agree" (what each is: ``ud_transport.collectives.FACTS``).
    algorithm : str
        The schedule that ran: "ring" or "direct".
    transport : str
        "udp" or "verbs".

    Examples
    --------
    >>> stats = ud_transport.allreduce(gradient, loss_budget=0.1)  # doctest: +SKIP
    >>> stats                                                      # doctest: +SKIP
    CollectiveStats(allreduce ring udp, reduce_fraction=0.9981, gather_fraction=1, chunks_lost=3/1536, elapsed=4.12 ms)
    >>> stats.to_dict()["chunks_lost"]                             # doctest: +SKIP
    3
    """
    delivered_fraction: float
    reduce_fraction: float
    gather_fraction: float
    own_reduce_fraction: float
    own_gather_fraction: float
    chunks_total: int
    chunks_lost: int
    chunks_stale: int
    elapsed_s: float
    deadline_s: float
    agree_s: float
    join_wait_s: float
    output_s: float
    sequence: int
    steps: int
    critical_path: int
    datagrams_sent: int
    payload_bytes_sent: int
    datagrams_received: int
    dropped_stale: int
    dropped_duplicate: int
    redundant_copies: int
    dropped_foreign: int
    dropped_invalid: int
    dropped_early: int
    injected_drops: int
    agree_messages_sent: int
    join_messages_sent: int
    credits_sent: int
    ends_sent: int
    receive_overflow_drops: int
    send_calls: int
    receive_calls: int
    verdict_acks_presumed: int
    verdicts_relayed: int
    answer_waits: int
    steps_ended: int
    steps_superseded: int
    steps_answered: int
    steps_timed_out: int
    idle_waits: int
    credit_stalls: int
    agreed_value: int
    deadline_expired: bool
    in_place: bool
    silent_rank: int
    mismatched_rank: int
    stripes: int
    stripes_vetoed: int
    budget_missed: bool = False
    collective: str = ""
    algorithm: str = ""
    transport: str = ""

    @property
    def missing_fraction(self):
        """1 - delivered_fraction: the share of contributions that did not make it into the result."""
        return 1.0 - self.delivered_fraction

    def to_dict(self):
        """Every field by name, for logs and JSON.

        Returns
        -------
        dict
            ``{field name: value}`` for every field, in declaration order;
            ``CollectiveStats(**stats.to_dict()) == stats``.

        Examples
        --------
        >>> import json
        >>> json.dumps(stats.to_dict())  # doctest: +SKIP
        '{"delivered_fraction": 1.0, "reduce_fraction": 1.0, ...}'
        """
        return asdict(self)

    def __repr__(self):
        labels = " ".join(label for label in (self.collective, self.algorithm, self.transport) if label)
        parts = [labels] if labels else []
        parts += [f"reduce_fraction={self.reduce_fraction:.6g}", f"gather_fraction={self.gather_fraction:.6g}",
                  f"chunks_lost={self.chunks_lost}/{self.chunks_total}", f"elapsed={self.elapsed_s * 1e3:.2f} ms"]
        if self.deadline_expired:
            parts.append("deadline_expired")
        blamed = [name for name in ("silent_rank", "mismatched_rank") if getattr(self, name) != -1]
        parts += [f"{name}={getattr(self, name)}" for name in blamed + [n for n in NOTABLE_DROPS if getattr(self, n)]]
        return f"{type(self).__name__}({', '.join(parts)})"

    @classmethod
    def from_native(cls, raw, **labels):
        """The stats of the C engine's result dict (extra keys ignored) with the labels
        (`collective`, `algorithm`, `transport`) the engine does not know."""
        values = {name: raw[name] for name in _field_names(cls) if name in raw}
        values["deadline_expired"] = bool(values["deadline_expired"])
        values["in_place"] = bool(values["in_place"])
        values["budget_missed"] = bool(values.get("budget_missed", 0))
        values.update(labels)
        if values.keys() != _field_set(cls):  # a field missing, or a label it has not: the dataclass says which
            return cls(**values)
        # every field given: set them as __init__ would, without its per-field object.__setattr__
        # of a frozen dataclass (~15 us of a small call's ~50 us of Python, on the build machine)
        stats = object.__new__(cls)
        stats.__dict__.update(values)
        return stats


@functools.cache
def _field_names(cls):
    return tuple(f.name for f in fields(cls))


@functools.cache
def _field_set(cls):
    return frozenset(_field_names(cls))


AllreduceStats = CollectiveStats  # the name before reduce_scatter, all_gather and broadcast existed
