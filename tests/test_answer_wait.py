"""The rank that answers last in a verdict round cannot be acknowledged, so under loss it stays a
while to answer again should every copy of its answer be lost (docs/semantics.md, "How the
verdict round ends"). It stays only where recent loss makes that likely enough to matter
(native/recent_loss.c, udt_answers_at_risk): rare independent loss no longer holds
every call that lost a chunk, while heavy loss and bursts, which take copies sent back to back
together, still do. Injected loss on every datagram, answers included."""
import ud_transport

import tasks
from conftest import get_cluster

WORLD, COUNT, CHUNK_BYTES = 4, 960, 32  # 120 chunks: each rank expects 180 a direct allreduce


def _calls(model, calls):
    cluster = get_cluster(WORLD, chunk_bytes=CHUNK_BYTES, inject=model)
    per_rank = cluster.run(tasks.calls_with_copies, "allreduce", COUNT, calls, 1, "direct")
    return [[stats for _, _, stats in rows] for rows in per_rank]


def _lossy(stats):
    """Calls the earlier rule held: every one that lost a datagram."""
    return [s for s in stats if s.chunks_lost or s.injected_drops]


def test_rare_independent_loss_does_not_hold_the_last_answer():
    """At 1% every copy of an answer (three) is lost about once in a million. Once a rank has seen
    enough chunks to tell, calls that lost one, each of which stayed under the earlier rule,
    return without staying."""
    per_rank = _calls(ud_transport.Bernoulli(0.01, seed=43), calls=60)
    # by call 40 a rank has expected 7,200 chunks and seen about 72 lost; it would take six lost
    # right after a lost one (0.7 expected) to judge the loss bursty enough to stay
    later = [s for stats in per_rank for s in stats[40:]]
    assert len(_lossy(later)) >= 20, [s.injected_drops for s in later]
    assert sum(s.answer_waits for s in later) == 0, [(s.chunks_lost, s.answer_waits) for s in later]
    assert all(s.verdict_acks_presumed == 0 for stats in per_rank for s in stats)


def test_heavy_loss_still_holds_the_last_answer():
    """At 30% an answer's three copies are all lost in about 3% of answers: ranks stay."""
    per_rank = _calls(ud_transport.Bernoulli(0.3, seed=47), calls=10)
    stats = [s for rows in per_rank for s in rows]
    assert sum(s.answer_waits for s in stats) >= len(stats) // 2, [(s.chunks_lost, s.answer_waits) for s in stats]


def test_bursts_still_hold_the_last_answer():
    """Bursts of about 20 datagrams that lose 80% (1.6% on average, near the rate above): a lost
    datagram's neighbours are lost too, so copies sent back to back go together, and ranks that
    lost a datagram in a call still stay in most of them."""
    model = ud_transport.GilbertElliott(good_to_bad=0.001, bad_to_good=0.05, loss_in_good=0.0, loss_in_bad=0.8, seed=53)
    per_rank = _calls(model, calls=40)
    later = _lossy([s for stats in per_rank for s in stats[20:]])
    assert later, "no burst came"
    assert sum(s.answer_waits for s in later) >= len(later) / 2, [(s.injected_drops, s.answer_waits) for s in later]
