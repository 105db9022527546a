/* What the network lost lately: the data chunks that recent calls expected at this rank and
 * lost, and how the lost ones came (alone, or in runs of consecutive chunks), kept across calls
 * with a bounded memory, older counts halved. The verdict round reads it to judge whether some
 * peer may lose every copy of a last answer, copies that go out back to back (verdict.c,
 * answers_at_risk). */
#include <math.h>

#include "engine_internal.h"

/* The memory, in data chunks this rank expected: every count halved past twice this many. Long,
 * because a clean network earns its estimate slowly (below); a burst shows in its runs at once. */
#define LOSS_MEMORY_CHUNKS 65536.0

/* A share of chunks lost as the share of datagrams (a chunk is lost only when all `copies` are). */
static double per_copy(double share, uint32_t copies)
{
    return copies > 1 && share > 0.0 ? pow(share, 1.0 / copies) : share;
}

/* This call's chunks lost, as datagrams lost at the rate one copy of each would show. */
static double lost_per_copy(const struct call *c)
{
    double total = (double)c->stats->chunks_total;
    return total > 0.0 ? total * per_copy((double)c->stats->chunks_lost / total, c->data.copies) : 0.0;
}

/* An upper estimate of the share of datagrams lost lately: of the data chunks this rank expected
 * in recent calls and this one, one lost chunk added (a few clean chunks say little; a rank that
 * has seen no data, as in a barrier, counts as lossy), and at least what this call's verdict
 * agreed was missing; per copy. */
double udt_recent_loss(const struct call *c, const struct udt_comm *comm)
{
    double here = (comm->recent_chunks_lost + lost_per_copy(c) + 1.0) /
                  (comm->recent_chunks_seen + (double)c->stats->chunks_total + 1.0);
    /* what the others lost, ours included, as the verdict agreed it: loss on our way out too,
     * though one bad link shows there spread over the world's blocks */
    double agreed = 1.0 - (c->stats->reduce_fraction < c->stats->gather_fraction ? c->stats->reduce_fraction
                                                                                  : c->stats->gather_fraction);
    agreed = per_copy(agreed, c->data.copies);
    return here > agreed ? here : agreed;
}

/* An upper estimate of the chance that a datagram right after a lost one is lost too: of the
 * chunks senders skipped (gaps in a step's chunk indices), the share that followed a skipped one,
 * one such added. Independent loss gives about the loss rate; bursts give much more; no gap seen
 * gives 1 (nothing known), so only the loss rate, earned over clean chunks, bounds the risk. At
 * least `loss` (udt_recent_loss's). */
double udt_recent_loss_after_loss(const struct call *c, const struct udt_comm *comm, double loss)
{
    double chunks = comm->recent_skipped_chunks + (double)c->data.skipped_chunks;
    double runs = comm->recent_skipped_runs + (double)c->data.skipped_runs;
    double after = (chunks - runs + 1.0) / (chunks + 1.0);
    return after > loss ? after : loss;
}

/* A call that reached its verdict: its data chunks into the recent counts, unless a peer's silence
 * or the deadline took them (a whole block lost says nothing of the network's rate). */
void udt_remember_loss(const struct call *c, struct udt_comm *comm)
{
    if (c->stats->silent_rank >= 0 || c->stats->deadline_expired)
        return;
    comm->recent_chunks_lost += lost_per_copy(c);
    comm->recent_chunks_seen += (double)c->stats->chunks_total;
    comm->recent_skipped_runs += (double)c->data.skipped_runs;
    comm->recent_skipped_chunks += (double)c->data.skipped_chunks;
    while (comm->recent_chunks_seen > 2.0 * LOSS_MEMORY_CHUNKS) {
        comm->recent_chunks_seen /= 2.0;
        comm->recent_chunks_lost /= 2.0;
        comm->recent_skipped_runs /= 2.0;
        comm->recent_skipped_chunks /= 2.0;
    }
}
