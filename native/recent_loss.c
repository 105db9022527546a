/* What the network lost lately toward this rank: the data chunks that recent calls expected and
 * lost, kept across calls with a bounded memory. The verdict round reads it to judge whether some
 * peer may lose every copy of a last answer (verdict.c, answers_at_risk). */
#include <math.h>

#include "engine_internal.h"

/* The memory, in data chunks this rank expected: both counts halved past twice this many, so a
 * change in the network shows within a few thousand chunks. */
#define LOSS_MEMORY_CHUNKS 8192.0

/* An upper estimate of the share of datagrams lost toward this rank lately: recent calls' data
 * chunks and this call's, with one lost chunk added (a few clean chunks say little; a rank that
 * has seen no data, as in a barrier, counts as lossy), per copy (a chunk is lost only when all
 * `copies` are). */
double udt_recent_loss(const struct call *c, const struct udt_comm *comm)
{
    double share = (comm->recent_chunks_lost + (double)c->stats->chunks_lost + 1.0) /
                   (comm->recent_chunks_seen + (double)c->stats->chunks_total + 1.0);
    return c->data.copies > 1 ? pow(share, 1.0 / c->data.copies) : share;
}

/* A call that reached its verdict: its data chunks into the recent counts. */
void udt_remember_loss(const struct call *c, struct udt_comm *comm)
{
    comm->recent_chunks_lost += (double)c->stats->chunks_lost;
    comm->recent_chunks_seen += (double)c->stats->chunks_total;
    while (comm->recent_chunks_seen > 2.0 * LOSS_MEMORY_CHUNKS) {
        comm->recent_chunks_seen /= 2.0;
        comm->recent_chunks_lost /= 2.0;
    }
}
