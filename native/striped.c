/* One collective run as several stripes at once, each on its own communicator (its own
 * socket) and thread, with one outcome for all (engine.h: udt_collective_striped).
 *
 * Why: one engine is one thread, and a call's work (the kernel's copies into and out of the
 * socket, the sums, the put-back saves) is serial in it. Where a host has cores to spare,
 * stripes spread that work and the kernel's per-packet work over them; Gloo already moves
 * its receives to a second thread. */
#include <pthread.h>
#include <string.h>

#include "engine.h"

struct stripe_job {
    struct udt_comm *comm;
    const struct udt_collective_args *args;
    struct udt_collective_stats *stats;
    int *cancel; /* shared by the stripes of one call */
    int veto;
    int rc;
    int status; /* rc, or for a call that reached its verdict the verdict */
};

static void *stripe_to_verdict(void *p)
{
    struct stripe_job *job = p;
    job->rc = udt_collective_to_verdict(job->comm, job->args, job->stats, job->cancel);
    /* Ranks that disagree on a call's layout can disagree on whether it is striped (its size
     * decides), and then a striped rank's other stripes would wait out the join timeout for
     * ranks that never run them. Every rank runs stripe 0 and learns the mismatch there, so it
     * ends the others at once. So does an interruption (stripe 0's wait hook: Ctrl-C on the
     * caller's thread), which has left stripe 0's peers already, as if this rank had died.
     * Nothing else does: ending stripes on other failures would leave their peers waiting in
     * verdict rounds that this rank had left. */
    job->status = job->rc != UDT_OK ? job->rc : udt_collective_verdict(job->comm);
    if (job->status == UDT_ERR_LAYOUT_MISMATCH || job->status == UDT_ERR_INTERRUPTED)
        __atomic_store_n(job->cancel, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void *stripe_settle(void *p)
{
    struct stripe_job *job = p;
    job->rc = udt_collective_settle(job->comm, job->veto);
    return NULL;
}

/* Run `work` for jobs[0..count): jobs 1.. on threads of their own, job 0 on this one. A
 * thread that cannot be made runs its job here after job 0 (slower, the same outcome). */
static void run_all(struct stripe_job *jobs, const int *active, uint32_t count, void *(*work)(void *))
{
    pthread_t threads[UDT_MAX_STRIPES];
    int started[UDT_MAX_STRIPES] = {0};
    for (uint32_t k = 1; k < count; k++)
        if (active[k])
            started[k] = pthread_create(&threads[k], NULL, work, &jobs[k]) == 0;
    if (active[0])
        work(&jobs[0]);
    for (uint32_t k = 1; k < count; k++) {
        if (started[k])
            pthread_join(threads[k], NULL);
        else if (active[k])
            work(&jobs[k]);
    }
}

/* How grave a status is when stripes disagree: errors of the call's arguments and of this
 * rank's own resources first, then what the ranks agreed (layout, a silent peer, loss). */
static int gravity(int status)
{
    switch (status) {
    case UDT_OK: return 0;
    case UDT_ERR_CANCELLED: return 1; /* only ever beside the mismatch that cancelled it */
    case UDT_ERR_LOSS_BUDGET: return 2;
    case UDT_ERR_PEER_TIMEOUT: return 3;
    case UDT_ERR_LAYOUT_MISMATCH: return 4;
    case UDT_ERR_TRANSPORT: return 5;
    case UDT_ERR_INTERRUPTED: return 5;
    case UDT_ERR_NO_MEMORY: return 6;
    default: return 7; /* UDT_ERR_INVALID_ARGUMENT */
    }
}

static void merge_stats(struct udt_collective_stats *into, const struct udt_collective_stats *part, double weight, int first)
{
    if (first) {
        *into = *part;
        into->delivered_fraction = into->reduce_fraction = into->gather_fraction = 0;
        into->own_reduce_fraction = into->own_gather_fraction = 0;
        into->stripes = into->stripes_vetoed = 0;
    } else {
#define SUM(field) into->field += part->field
#define MAX(field) into->field = part->field > into->field ? part->field : into->field
        SUM(chunks_total); SUM(chunks_lost); SUM(chunks_stale); SUM(datagrams_sent); SUM(payload_bytes_sent); SUM(datagrams_received);
        SUM(dropped_stale); SUM(dropped_duplicate); SUM(redundant_copies); SUM(dropped_foreign); SUM(dropped_invalid);
        SUM(dropped_early); SUM(injected_drops); SUM(agree_messages_sent); SUM(join_messages_sent); SUM(credits_sent); SUM(ends_sent);
        SUM(receive_overflow_drops); SUM(send_calls); SUM(receive_calls); SUM(verdict_acks_presumed); SUM(verdicts_relayed); SUM(answer_waits); SUM(steps_ended); SUM(steps_superseded);
        SUM(steps_answered); SUM(steps_timed_out); SUM(idle_waits); SUM(credit_stalls);
        MAX(elapsed_s); MAX(deadline_s); MAX(agree_s); MAX(join_wait_s); MAX(output_s); MAX(agreed_value);
        MAX(deadline_expired); MAX(budget_missed); /* a stripe that missed: the call missed */
        if (into->silent_rank < 0)
            into->silent_rank = part->silent_rank;
        if (into->mismatched_rank < 0)
            into->mismatched_rank = part->mismatched_rank;
        into->in_place = into->in_place && part->in_place;
#undef SUM
#undef MAX
    }
    /* Each stripe's agreed fraction weighted by its share: for reduce_fraction the exact share
     * of the tensor's contributions; for gather_fraction (each stripe's least over ranks) a
     * lower bound of the least over ranks of the whole. */
    into->delivered_fraction += weight * part->delivered_fraction;
    into->reduce_fraction += weight * part->reduce_fraction;
    into->gather_fraction += weight * part->gather_fraction;
    into->own_reduce_fraction += weight * part->own_reduce_fraction;
    into->own_gather_fraction += weight * part->own_gather_fraction;
    into->stripes += 1;
    into->stripes_vetoed += part->stripes_vetoed;
}

int udt_collective_striped(struct udt_comm *const *comms, const struct udt_collective_args *args,
                           struct udt_collective_stats *stats, const double *weights, uint32_t count,
                           struct udt_collective_stats *merged, uint32_t *failed_stripe)
{
    struct stripe_job jobs[UDT_MAX_STRIPES];
    int active[UDT_MAX_STRIPES];
    int cancel = 0;
    *failed_stripe = 0;
    memset(merged, 0, sizeof *merged);
    merged->silent_rank = merged->mismatched_rank = -1;
    if (count == 0 || count > UDT_MAX_STRIPES)
        return UDT_ERR_INVALID_ARGUMENT;
    for (uint32_t k = 0; k < count; k++) {
        /* Stripes 1.. run only in striped calls, stripe 0 in every call: numbering this call's
         * stripes after stripe 0 keeps every rank's stripe k on the same call, even after ranks
         * disagreed on whether an earlier call was striped. */
        if (k > 0 && udt_comm_set_sequence(comms[k], udt_comm_sequence(comms[0])) != 0)
            return UDT_ERR_INVALID_ARGUMENT; /* a stripe is in a call already (used from two threads) */
        jobs[k] = (struct stripe_job){comms[k], &args[k], &stats[k], &cancel, UDT_OK, UDT_OK, UDT_OK};
        active[k] = 1;
    }
    run_all(jobs, active, count, stripe_to_verdict);
    /* One outcome: the gravest status of any stripe, the same on every rank for the agreed
     * ones, since each stripe's verdict is agreed and every rank combines them alike. */
    int outcome = UDT_OK;
    for (uint32_t k = 0; k < count; k++) {
        if (gravity(jobs[k].status) > gravity(outcome)) {
            outcome = jobs[k].status;
            *failed_stripe = k;
        }
        active[k] = jobs[k].rc == UDT_OK; /* the others are over already, their output as it was */
    }
    for (uint32_t k = 0; k < count; k++)
        jobs[k].veto = outcome; /* after the loop: a later stripe can still make the outcome graver */
    run_all(jobs, active, count, stripe_settle);
    for (uint32_t k = 0; k < count; k++)
        merge_stats(merged, &stats[k], weights[k], k == 0);
    /* the rank an error names is the failing stripe's, as its message is */
    if (outcome != UDT_OK) {
        merged->silent_rank = stats[*failed_stripe].silent_rank;
        merged->mismatched_rank = stats[*failed_stripe].mismatched_rank;
    }
    return outcome;
}
