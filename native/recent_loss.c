/* What the network lost lately toward this rank: the data chunks that recent calls expected and
 * lost, and how the lost ones came (alone, or in runs of consecutive chunks), kept across calls
 * with a bounded memory. The verdict round reads it to judge whether some peer may lose every
 * copy of a last answer, copies that go out back to back (verdict.c, answers_at_risk). */
#include <math.h>

#include "engine_internal.h"

/* The memory, in data chunks this rank expected: every count halved past twice this many. Long,
 * because a clean network earns its estimate slowly (below); a burst shows in its runs at once. */
#define LOSS_MEMORY_CHUNKS 65536.0

/* An upper estimate of the share of datagrams lost toward this rank lately: recent calls' data
 * chunks and this call's, one lost chunk added (a few clean chunks say little; a rank that has
 * seen no data, as in a barrier, counts as lossy), per copy (a chunk is lost only when all
 * `copies` are). */
double udt_recent_loss(const struct call *c, const struct udt_comm *comm)
{
    double share = (comm->recent_chunks_lost + (double)c->stats->chunks_lost + 1.0) /
                   (comm->recent_chunks_seen + (double)c->stats->chunks_total + 1.0);
    return c->data.copies > 1 ? pow(share, 1.0 / c->data.copies) : share;
}

/* An upper estimate of the chance that a datagram right after a lost one is lost too: of the
 * chunks senders skipped (gaps in a step's chunk indices), the share that followed a skipped one,
 * one such added. Independent loss gives about the loss rate; bursts give much more; no gap seen
 * gives 1 (nothing known), so only the loss rate, earned over clean chunks, bounds the risk. */
double udt_recent_loss_after_loss(const struct call *c, const struct udt_comm *comm)
{
    double chunks = comm->recent_skipped_chunks + (double)c->data.skipped_chunks;
    double runs = comm->recent_skipped_runs + (double)c->data.skipped_runs;
    double after = (chunks - runs + 1.0) / (chunks + 1.0), loss = udt_recent_loss(c, comm);
    return after > loss ? after : loss;
}

/* A call that reached its verdict: its data chunks into the recent counts. */
void udt_remember_loss(const struct call *c, struct udt_comm *comm)
{
    comm->recent_chunks_lost += (double)c->stats->chunks_lost;
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
