"""How long a rank waits in the verdict round before it reads a peer's silence as loss.

A rank sends its verdict again for want of a peer's after agree_resend_us (1 ms), or, where rounds
here usually take longer and loss is rare, after as long as they usually take and four spreads (as
TCP times a retransmission). Only evidence of loss makes the rank that answered last stay for its
peers: a chunk lost, a verdict asked for again before deciding, a copy of its own that found the
socket full, a peer asking again for what it sent an interval before. Asking a slow peer for its
acknowledgement is no such evidence (native/verdict.c; native/recent_loss.c).

The simulator runs the real engines on a virtual clock, so these figures are exact, not timings:
`delay_ns` delivers every datagram that long after it was sent (a long path, or ranks that wait
for a core, as 8 ranks on 2 cores do), `send_ns_per_datagram` paces a sender like a full socket."""
import statistics

from ud_transport import _native

WORLD, DELAY_NS = 8, 1_500_000  # one way, longer than the first resend interval (1 ms)


def _barriers(calls, loss=0.0, seed=1):
    return _native.simulate(WORLD, _native.COLLECTIVE_AGREE, _native.ALGORITHM_DIRECT, 0, 1024, calls, deadline_s=2.0,
                            loss_budget=1.0, delay_ns=DELAY_NS, loss_kind=1 if loss else 0, loss=loss, seed=seed)


def _slowest(call):
    return max(stats["elapsed_s"] for _, stats, _, _ in call)


def test_a_round_slower_than_the_resend_interval_is_waited_for():
    """Every verdict takes 1.5 ms to arrive. At first a rank knows nothing of the loss here and
    resends after 1 ms; with the old rule the resends and acknowledgement asks read as loss and
    every rank stayed 2 ms after its last answer (5.75 ms a barrier). Once its rounds have shown
    the loss to be rare (ten clean rounds of 7 verdicts), a rank waits the usual round, nobody
    stays, and a barrier takes its two trips (3 ms) with fewer messages."""
    rows = _barriers(16)
    first, later = rows[0], rows[10:]
    assert all(status == 0 for call in rows for status, _, _, _ in call)
    assert _slowest(first) >= 5e-3 and all(stats["answer_waits"] for _, stats, _, _ in first)
    for call in later:
        assert _slowest(call) <= 2 * DELAY_NS * 1e-9 + 1e-4, [stats["elapsed_s"] for _, stats, _, _ in call]
        assert not any(stats["answer_waits"] or stats["verdict_acks_presumed"] for _, stats, _, _ in call)
        sent = sum(stats["agree_messages_sent"] for _, stats, _, _ in call)
        assert sent < 0.8 * sum(stats["agree_messages_sent"] for _, stats, _, _ in first), sent


def test_heavy_loss_keeps_the_quick_resend():
    """At 10% loss some verdict of a round of 7 is lost in about half the rounds. Resending after
    1 ms (agree_resend_us) recovers it within that interval of a clean call's time; waiting the
    usual round and its spreads first (1.5 ms and more here) cost a median call two intervals
    (7.75 ms against 6.75 in this simulation). The rounds' losses keep the estimate high, so a rank
    keeps the quick resend: the median call stays within one interval of the clean first calls'."""
    clean = statistics.median(_slowest(call) for call in _barriers(10))
    lossy = []
    for seed in (1, 2, 3):
        for call in _barriers(30, loss=0.1, seed=seed):
            assert all(status == 0 for status, _, _, _ in call)
            lossy.append(_slowest(call))
    assert statistics.median(lossy) <= clean + 1e-3 + 1e-6, (clean, statistics.median(lossy))


def test_a_root_whose_answers_found_its_socket_full_stays_for_its_peers():
    """A paced root (50 us a datagram) scatters to 7 ranks; the acknowledgements it sends as it
    decides find its socket full and never leave. It has every peer's acknowledgement, so nothing
    else tells it of loss; it must stay to answer the peers that ask again, or they wait 64 ms for
    a presumed acknowledgement (which they did while asking for an acknowledgement counted as
    loss only by the asker's own resends: the root had none)."""
    rows = _native.simulate(WORLD, _native.COLLECTIVE_SCATTER, _native.ALGORITHM_DIRECT, WORLD * 16 * 128, 1024, 3,
                            deadline_s=1.0, loss_budget=0.0, send_ns_per_datagram=50_000)
    for index, call in enumerate(rows):
        for rank, (status, stats, _, _) in enumerate(call):
            where = f"call {index}, rank {rank}: {stats}"
            assert status == 0 and stats["verdict_acks_presumed"] == 0, where
            assert stats["agree_s"] < 16e-3, where
        assert call[0][1]["answer_waits"] == 1, call[0][1]


def _allreduces(calls, loss=0.0, seed=1):
    # 1 MiB in 1 KiB chunks: each rank takes in about 2,000 chunks a call, so the loss it has seen
    # falls below 1 in 56,000 within some 30 clean calls
    return _native.simulate(WORLD, _native.COLLECTIVE_ALLREDUCE, _native.ALGORITHM_DIRECT, 1 << 18, 1024, calls,
                            deadline_s=2.0, loss_budget=0.1, delay_ns=100_000, loss_kind=1 if loss else 0, loss=loss,
                            seed=seed)


def _agree_sent(call):
    return [stats["agree_messages_sent"] for _, stats, _, _ in call]


def test_acknowledgements_take_fewer_copies_once_loss_is_rare():
    """A rank acknowledges its 7 peers as it decides, in as many copies as keep the chance that
    the call's 56 answers lose every copy of one below one call in a thousand at the loss it has
    seen (native/recent_loss.c, udt_answer_copies), at most end_repeats (3). In the first call
    it has seen only that call's 3,584 clean chunks (an estimate of 1 in 3,585): two copies.
    After some 56,000 clean datagrams, one: each rank sends its verdict and one acknowledgement
    to each peer, nothing more (with three copies of each, as before, 28 messages)."""
    rows = _allreduces(40)
    assert all(status == 0 for call in rows for status, _, _, _ in call)
    assert _agree_sent(rows[0]) == [(WORLD - 1) * 3] * WORLD, _agree_sent(rows[0])
    assert _agree_sent(rows[-1]) == [(WORLD - 1) * 2] * WORLD, _agree_sent(rows[-1])


def test_acknowledgements_keep_every_copy_under_loss():
    """At 1% loss every call loses chunks, so every acknowledgement goes in all three copies, and
    every rank of every call returns the same outcome."""
    rows = _allreduces(20, loss=0.01)
    for call in rows:
        assert len({status for status, _, _, _ in call}) == 1, [status for status, _, _, _ in call]
        assert min(_agree_sent(call)) >= (WORLD - 1) * 4, _agree_sent(call)


def test_rare_loss_with_fewer_copies_keeps_one_outcome():
    """Rare loss (1 datagram in 5,000): a rank whose call lost nothing acknowledges in fewer
    copies than end_repeats (counted: some rank-calls must). Every rank of every call returns the
    same outcome, and no call waits out a presumption or its deadline. (Whether a lost single
    copy came up here is not counted: random loss cannot aim at one.)"""
    fewer = 0
    for seed in (1, 2, 3):
        for call in _allreduces(40, loss=2e-4, seed=seed):
            assert len({status for status, _, _, _ in call}) == 1, [status for status, _, _, _ in call]
            assert not any(stats["verdict_acks_presumed"] or stats["deadline_expired"] for _, stats, _, _ in call)
            fewer += sum(sent < (WORLD - 1) * 4 for sent in _agree_sent(call))
    assert fewer > 0
