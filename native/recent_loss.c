/* What the network lost lately: the data chunks that recent calls expected at this rank and
 * lost, and how the lost ones came (alone, or in runs of consecutive chunks), kept across calls
 * with a bounded memory, older counts halved. The verdict round reads it to judge whether some
 * peer may lose every copy of a last answer, copies that go out back to back
 * (udt_answers_at_risk). And how long verdict rounds lately waited for the last peer's verdict, so
 * that a rank reads a peer's silence as loss only past that (udt_verdict_resend_base_ns). */
#include <math.h>

#include "engine_internal.h"

/* The memory, in data chunks this rank expected: every count halved past twice this many. Long,
 * because a clean network earns its estimate slowly (below); a burst shows in its runs at once. */
#define LOSS_MEMORY_CHUNKS 65536.0
/* the longest first verdict resend interval, in agree_resend_us: as long as the backoff's longest */
#define ROUND_WAIT_MAX_INTERVALS 16.0
/* where more rounds than this lose one of their verdicts, a resend waits only agree_resend_us */
#define LOSSY_ROUND_SHARE 0.1

/* A rank that answered last stays a while in case every copy of that answer was lost (verdict.c,
 * ANSWER_WAIT_INTERVALS). That stay is for loss that may take every copy of a last answer, and only then is it paid: when
 * the n(n - 1) answers of a call, each with every copy lost at the recent rates (udt_answers_at_risk),
 * would leave some peer without its answer in more than this share of calls. Under independent
 * loss, at 8 ranks, that stays at 3% and above and not at 2% or below; under bursts, at 1%
 * too. Before, any call that lost a chunk or resent a verdict message stayed: at 1% loss a 4-rank
 * 1 MiB call spent 2.7 ms in its verdict round where 0.7 did (docs/performance/verdict_round.md). */
#define ANSWER_LOSS_RISK 1e-3

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

/* An upper estimate of the share of datagrams lost lately toward this rank: of the data chunks it
 * expected in recent calls and this one, one lost chunk added (a few clean chunks say little; a
 * rank that has seen no data, as in a barrier, counts as lossy); per copy. */
static double loss_seen(const struct call *c, const struct udt_comm *comm)
{
    return (comm->recent_chunks_lost + lost_per_copy(c) + 1.0) / (comm->recent_chunks_seen + (double)c->stats->chunks_total + 1.0);
}

/* The same, and at least what this call's verdict agreed was missing (once decided). */
static double recent_loss(const struct call *c, const struct udt_comm *comm)
{
    double here = loss_seen(c, comm);
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
 * least `loss` (recent_loss's). */
static double recent_loss_after_loss(const struct call *c, const struct udt_comm *comm, double loss)
{
    double chunks = comm->recent_skipped_chunks + (double)c->data.skipped_chunks;
    double runs = comm->recent_skipped_runs + (double)c->data.skipped_runs;
    double after = (chunks - runs + 1.0) / (chunks + 1.0);
    return after > loss ? after : loss;
}

/* Evidence of loss in this call: a chunk lost, a verdict asked for again before deciding, a message
 * of ours missing, a drop the injector made. */
int udt_call_showed_loss(const struct call *c, const struct udt_comm *comm)
{
    return c->stats->chunks_lost || c->verdict.verdict_resends || c->verdict.ours_missing ||
           comm->transport->counter_injected_drops != c->drops_before;
}

/* Whether some rank of the call may have lost every copy of some peer's last answer in more than
 * ANSWER_LOSS_RISK of calls: the first copy lost at the recent loss rate, each next one (sent
 * right after) at the recent rate of a loss after a loss, where this call showed loss
 * (`call_lossy`); with every copy lost independently at the rate this rank saw (not this call's
 * agreed share: a small call that lost one chunk would read as heavy loss), in any call. So where
 * loss is heavy a rank stays whatever its call saw (at 10%, three copies are all lost in one
 * answer in a thousand: 8 ranks' 56 answers lose one in 5% of calls), and where it may come in
 * bursts, only after a call that showed some. */
int udt_answers_at_risk(const struct call *c, const struct udt_comm *comm, int call_lossy)
{
    double loss = recent_loss(c, comm), every_copy_lost = loss, rate = loss_seen(c, comm), independently = rate;
    double after_loss = recent_loss_after_loss(c, comm, loss);
    uint32_t copies = c->verdict.ack_copies ? c->verdict.ack_copies : comm->options.end_repeats;
    for (uint32_t k = 1; k < copies; k++) {
        every_copy_lost *= after_loss;
        independently *= rate;
    }
    double answers = (double)c->n * (double)(c->n - 1);
    return answers * (call_lossy ? every_copy_lost : independently) > ANSWER_LOSS_RISK;
}

/* How many copies the acknowledgement at deciding takes (each a datagram to every peer): all of an
 * END marker's where this call showed loss; else the fewest with which the call's n(n - 1)
 * answers, every copy lost independently at the rate this rank saw lately, would leave a peer
 * without its answer in at most ANSWER_LOSS_RISK of calls, so that udt_answers_at_risk lets us
 * go; on a network that lost nothing for long, one. A peer that lacks it asks, and is answered. */
/* The fewest copies, at most `most`, that bring `risk` (what one copy leaves) to `allowed` or
 * below, each further copy lost independently at `rate`. */
static uint32_t fewest_copies(double risk, double rate, double allowed, uint32_t most)
{
    uint32_t copies = 1;
    for (; copies < most && risk > allowed; copies++)
        risk *= rate;
    return copies;
}

uint32_t udt_answer_copies(const struct call *c, const struct udt_comm *comm, int call_lossy)
{
    uint32_t most = comm->options.end_repeats;
    if (call_lossy)
        return most;
    double rate = loss_seen(c, comm);
    return fewest_copies((double)c->n * (double)(c->n - 1) * rate, rate, ANSWER_LOSS_RISK, most);
}

/* A credit goes in one copy where the share of datagrams lost toward this rank lately (loss_seen,
 * an upper estimate) is below this and this call has skipped no chunk: a lost credit then stalls
 * its sender until the refresh (credit_refresh_us) for about one credit in ten thousand, and a
 * 4-rank 16 MiB call's ~200 credits a rank go out once instead of twice. */
#define CREDIT_ONE_COPY_LOSS 1e-4

/* How many copies a credit takes (CREDIT_ONE_COPY_LOSS): one on a network that lost nothing for
 * long, else `most`. A rank that has seen fewer than ten thousand chunks lately takes `most`. */
uint32_t udt_credit_copies(const struct call *c, const struct udt_comm *comm, uint32_t most)
{
    return c->data.skipped_chunks == 0 && loss_seen(c, comm) < CREDIT_ONE_COPY_LOSS ? 1 : most;
}

/* A step's END marker matters to its receiver only where a chunk of the step was lost: a step whose
 * chunks all came closes complete. A step that lost a chunk and every copy of its END waits
 * idle_close_us (20 ms by default) and asks its sender, which answers; nothing is lost by it, but
 * that wait is long beside a small call. So an END takes the fewest copies with which, every
 * datagram lost independently at the rate this rank saw lately, its step would wait so in at most
 * END_WAIT_RISK / steps of calls (END_WAIT_RISK a call), and all of end_repeats where this call has
 * skipped a chunk. At 16 ranks a 4 KiB allreduce sends 30 steps a rank, each one chunk and three
 * ENDs; one END each took about 5% off that call (docs/performance/wire_measurements.md, "END
 * markers by the recent loss"). */
#define END_WAIT_RISK 1e-4

uint32_t udt_end_copies(const struct call *c, const struct udt_comm *comm, uint32_t step)
{
    uint32_t most = comm->options.end_repeats;
    if (c->data.skipped_chunks)
        return most;
    double rate = loss_seen(c, comm);
    double chunk_lost = pow(rate, (double)c->data.copies); /* every copy of a chunk lost */
    double step_lost = fmin(1.0, (double)send_chunks(c, c->step[step].send_block) * chunk_lost);
    return fewest_copies(step_lost * rate, rate, END_WAIT_RISK / (double)c->schedule.steps, most);
}

/* How long a round that lost nothing usually waits for its last verdict: smoothed as TCP smooths
 * its round trip (RFC 6298: gains 1/8 and 1/4), from rounds in which every verdict's first copy
 * came first, since a round a resent copy completed says how long the resend took (Karn). */
static void remember_round(struct udt_comm *comm, uint64_t waited_ns)
{
    double sample = (double)waited_ns;
    if (!comm->round_samples) {
        comm->round_wait_ns = sample;
        comm->round_wait_spread_ns = sample / 2.0;
    } else {
        double error = sample - comm->round_wait_ns;
        comm->round_wait_spread_ns += 0.25 * (fabs(error) - comm->round_wait_spread_ns);
        comm->round_wait_ns += 0.125 * error;
    }
    comm->round_samples++;
}

/* A call that reached its verdict: its data chunks into the recent counts, unless a peer's silence
 * or the deadline took them (a whole block lost says nothing of the network's rate). */
void udt_remember_loss(const struct call *c, struct udt_comm *comm)
{
    if (c->stats->silent_rank >= 0 || c->stats->deadline_expired)
        return;
    comm->recent_chunks_lost += lost_per_copy(c);
    comm->recent_chunks_seen += (double)c->stats->chunks_total;
    /* The verdicts are datagrams the network carried too, and a communicator that runs only
     * barriers has nothing else to judge by: n - 1 of them, those taken as lost whose first copy
     * was not the first to come (a copy marked AGAIN came first, or a relay). A round whose
     * first copies all came first says how long rounds here wait (remember_round). */
    if (c->n > 1 && c->verdict.decided && c->verdict.verdicts_got >= c->n - 1) {
        double late = (double)c->verdict.verdicts_late + (double)c->stats->verdicts_relayed;
        comm->recent_chunks_seen += (double)(c->n - 1);
        comm->recent_chunks_lost += late < (double)(c->n - 1) ? late : (double)(c->n - 1);
        if (late == 0.0)
            remember_round(comm, c->verdict.decided_ns - c->verdict.verdict_started_ns);
    }
    comm->recent_skipped_runs += (double)c->data.skipped_runs;
    comm->recent_skipped_chunks += (double)c->data.skipped_chunks;
    while (comm->recent_chunks_seen > 2.0 * LOSS_MEMORY_CHUNKS) {
        comm->recent_chunks_seen /= 2.0;
        comm->recent_chunks_lost /= 2.0;
        comm->recent_skipped_runs /= 2.0;
        comm->recent_skipped_chunks /= 2.0;
    }
}

/* The first wait before a rank sends its verdict again for want of a peer's: agree_resend_us, or
 * where rounds here usually take longer (ranks outnumber cores, a long path, data finished far
 * apart), their usual wait and four spreads, as TCP's retransmission timeout, at most
 * ROUND_WAIT_MAX_INTERVALS times agree_resend_us. A resend before that reads a slow peer as a
 * lost message: at 16 ranks on 2 cores every round resent, and each resend cost the others a
 * core. But where a round often loses a verdict (n - 1 of them, at the rate this rank saw lately:
 * LOSSY_ROUND_SHARE), the early resend pays for itself: in the simulator, 8 ranks 1.5 ms apart at
 * 10% loss took 15% longer a call waiting the usual round. */
uint64_t udt_verdict_resend_base_ns(const struct call *c, const struct udt_comm *comm)
{
    double base = (double)comm->options.agree_resend_us * 1000.0;
    if ((double)(c->n - 1) * loss_seen(c, comm) > LOSSY_ROUND_SHARE)
        return (uint64_t)base;
    double usual = comm->round_samples ? comm->round_wait_ns + 4.0 * comm->round_wait_spread_ns : 0.0;
    double ceiling = ROUND_WAIT_MAX_INTERVALS * base;
    return (uint64_t)(usual > ceiling ? ceiling : usual > base ? usual : base);
}
