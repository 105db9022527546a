"""The rank that answers last in a verdict round cannot be acknowledged, so under loss it stays a
while to answer again should every copy of its answer be lost (docs/semantics.md, "How the
verdict round ends"). It stays only where the recent loss rate makes that likely enough to matter
(native/verdict.c, answers_at_risk): rare loss no longer holds every call that lost a chunk, and
heavy loss still does. Injected i.i.d. loss on every datagram, answers included."""
import ud_transport

import tasks
from conftest import get_cluster

WORLD, COUNT, CHUNK_BYTES = 4, 960, 32  # 120 chunks: each rank expects 180 a direct allreduce


def _rows(loss, seed, calls):
    cluster = get_cluster(WORLD, chunk_bytes=CHUNK_BYTES, inject=ud_transport.Bernoulli(loss, seed=seed))
    return [stats for rows in cluster.run(tasks.calls_with_copies, "allreduce", COUNT, calls, 1, "direct")
            for _, _, stats in rows]


def test_rare_loss_does_not_hold_the_last_answer():
    """At 1% every copy of an answer (three) is lost about once in a million: calls that lost a
    chunk, each of which stayed under the earlier rule, return without staying."""
    stats = _rows(0.01, seed=43, calls=30)
    lossy = [s for s in stats if s.chunks_lost or s.injected_drops]
    assert len(lossy) >= 10, [s.chunks_lost for s in stats]
    assert all(s.answer_waits == 0 for s in stats), [(s.chunks_lost, s.answer_waits) for s in stats]
    assert all(s.verdict_acks_presumed == 0 for s in stats)


def test_heavy_loss_still_holds_the_last_answer():
    """At 30% an answer's three copies are all lost in about 3% of answers: ranks stay."""
    stats = _rows(0.3, seed=47, calls=10)
    assert sum(s.answer_waits for s in stats) >= len(stats) // 2, [(s.chunks_lost, s.answer_waits) for s in stats]
