/* A call's life: arguments refused or the call prepared, the progress loop that reads and
 * dispatches datagrams, the verdict round's turn, and the finish that writes the output or
 * puts the tensor back.
 *  - A receive step closes when all its chunks arrived, when its sender's
 *    END marker (or verdict) arrived, when that sender moved on to a later
 *    step, when the sender answers that it is done with it (asked once the
 *    step has had nothing for idle_close_us, or at its share of the
 *    deadline), or at the call's deadline; silence alone never closes it,
 *    and a lost chunk never stalls later hops (liveness.c).
 *  - Reduced chunks carry how many ranks' inputs they sum; the owner of a
 *    block rescales by N/count, so the estimate is unbiased (output.c).
 *  - Receivers grant senders credits (a window of positions shared by all
 *    senders), so a healthy link never overflows a receive buffer (data.c).
 *  - The data deadline counts from the moment every rank is known to be in
 *    the call (a JOIN exchange finds the quiet ones), so a late rank costs
 *    time, not data; a separate, long join timeout catches the absent.
 *  - Then the verdict round (verdict.c): every rank returns the same outcome.
 * The caller's output is written once, at the end, and only on success. */
#define _GNU_SOURCE
#include "engine_internal.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "blocks.h"
#include "elementwise.h"

static uint64_t monotonic_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int fail(struct udt_comm *comm, int status, const char *message)
{
    udt_error_check(&comm->error, "%s", message);
    return status;
}

static uint32_t layout_tag_of(const struct udt_collective_args *a, uint32_t chunk_bytes)
{
    /* a sized all_to_all's count is this rank's own: its pieces are checked in the verdict (pieces.c) */
    uint64_t fields[8] = {(uint64_t)a->collective, (uint64_t)a->algorithm, a->piece_counts ? ~0ull : a->count, (uint64_t)a->dtype,
                          (uint64_t)a->op, chunk_bytes, (uint64_t)a->estimator, a->root};
    uint32_t hash = 2166136261u; /* FNV-1a */
    const uint8_t *bytes = (const uint8_t *)fields;
    for (size_t i = 0; i < sizeof fields; i++)
        hash = (hash ^ bytes[i]) * 16777619u;
    if (a->layout_salt) /* only then: a call without one keeps the tag peers of the same wire version compute */
        for (int i = 0; i < 4; i++)
            hash = (hash ^ ((a->layout_salt >> (8 * i)) & 0xffu)) * 16777619u;
    if (a->write_on_budget_miss) /* ranks that judge a miss differently would return different statuses */
        hash = (hash ^ 0x5du) * 16777619u;
    if (a->reduce_in_rank_order) /* an owner summing as chunks arrive would send other bits */
        hash = (hash ^ 0x6bu) * 16777619u;
    return hash;
}

static int grow(void **buffer, size_t *have, size_t need)
{
    if (need <= *have && *buffer)
        return 0;
    free(*buffer);
    *buffer = malloc(need ? need : 1);
    *have = *buffer ? need : 0;
    return *buffer ? 0 : -1;
}

static int prepare(struct udt_comm *comm, struct call *c)
{
    const struct udt_collective_args *a = &c->args;
    uint32_t n = comm->world_size;
    c->geometry.wire_bytes = udt_wire_elem_bytes(a->dtype);
    c->geometry.accum_bytes = udt_accum_elem_bytes(a->dtype);
    c->geometry.chunk_elements = comm->options.chunk_bytes / c->geometry.wire_bytes; /* at least 1 (refusal) */
    c->geometry.chunk_base = comm->geometry;
    c->geometry.block_first = comm->geometry + n + 1;
    c->geometry.send_first = a->piece_counts ? comm->geometry + 2 * (n + 1) : c->geometry.block_first;
    uint64_t max_chunks = 0;
    uint32_t rotation = c->schedule.facts->rotates ? c->sequence % n : 0;
    uint32_t steps = udt_schedule_steps(a->collective, a->algorithm, n);
    if (a->piece_counts) {
        max_chunks = udt_pieces_geometry(c);
        c->geometry.max_chunks = udt_pieces_stride(steps);
    } else {
        c->geometry.chunk_base[0] = 0;
        for (uint32_t b = 0; b <= n; b++)
            c->geometry.block_first[b] = udt_block_start(a->count, n, b);
        for (uint32_t b = 0; b < n; b++) {
            uint64_t chunks = udt_chunks_for(udt_block_length(a->count, n, b), c->geometry.chunk_elements);
            c->geometry.chunk_base[b + 1] = c->geometry.chunk_base[b] + chunks;
            if (chunks > max_chunks)
                max_chunks = chunks;
        }
        c->geometry.max_chunks = (uint32_t)max_chunks;
    }
    uint64_t total_chunks = c->geometry.chunk_base[n];

    c->geometry.bitmap_bytes = (max_chunks + 7) / 8;
    size_t step_bytes = (size_t)steps * (sizeof(struct udt_step) + sizeof(struct step_state) + c->geometry.bitmap_bytes);
    size_t state_bytes = (size_t)total_chunks * (2 * sizeof(uint16_t) + 1);
    if (grow((void **)&comm->scratch, &comm->scratch_bytes, (size_t)a->count * c->geometry.accum_bytes) ||
        grow((void **)&comm->chunk_state, &comm->chunk_state_bytes, state_bytes) ||
        grow((void **)&comm->step_memory, &comm->step_memory_bytes, step_bytes) ||
        (a->reduce_in_rank_order && n > 1 &&
         grow((void **)&comm->rank_rows, &comm->rank_rows_bytes, /* the peers' rows of the largest block (they rotate) */
              (size_t)(n - 1) * ((a->count + n - 1) / n) * c->geometry.wire_bytes)))
        return fail(comm, UDT_ERR_NO_MEMORY, "out of memory for the call's buffers");
    c->step = (struct udt_step *)comm->step_memory;
    c->state = (struct step_state *)(c->step + steps);
    c->chunks.arrival_bits = (uint8_t *)(c->state + steps);
    if (udt_schedule_build(a->collective, a->algorithm, c->rank, n, a->root, rotation, &c->schedule, c->step, comm->block_scratch) != 0 ||
        c->schedule.steps != steps)
        return fail(comm, UDT_ERR_INVALID_ARGUMENT, "no schedule for this collective and algorithm");
    memset(c->state, 0, (size_t)steps * sizeof(struct step_state));
    memset(c->chunks.arrival_bits, 0, (size_t)steps * c->geometry.bitmap_bytes);
    uint32_t receives_after = 0, *sent_later = comm->block_scratch;
    memset(sent_later, 0, n * sizeof *sent_later);
    for (uint32_t g = steps; g-- > 0;) {
        c->state[g].receives_after = receives_after;
        if (c->step[g].recv_peer != UDT_NO_PEER) {
            c->state[g].expected = chunks_in_block(c, c->step[g].recv_block);
            c->state[g].relayed = !c->schedule.facts->sends_input && sent_later[c->step[g].recv_block] != 0;
            receives_after++;
        }
        if (c->step[g].send_peer != UDT_NO_PEER)
            sent_later[c->step[g].send_block] = 1;
    }

    /* an allreduce in place accumulates in the caller's tensor and saves originals in the
     * scratch as it first touches them (while in cache), instead of copying the scratch out at
     * the end: as many bytes copied, fewer cache misses. Only for tensors too large for the
     * cache: below, the saves on the send path cost more than one copy out at the end
     * (2 ranks, loopback, 8 MiB: 11.8 against 8.5 ms; 64 MiB: 55 against 67 ms) */
    c->output.in_place = c->schedule.facts->may_sum_in_place && a->input == a->output && n > 1 && c->geometry.accum_bytes == c->geometry.wire_bytes &&
                  a->count * c->geometry.wire_bytes >= comm->options.in_place_min_bytes;
    c->stats->in_place = c->output.in_place;
    c->output.direct_output = a->direct_output && c->schedule.facts->gathers && !c->schedule.facts->reduces && c->geometry.accum_bytes == c->geometry.wire_bytes;
    c->output.accum = c->output.in_place || c->output.direct_output ? (uint8_t *)a->output : comm->scratch;
    c->output.final_uncached = (c->output.in_place || c->output.direct_output) && a->count * c->geometry.wire_bytes >= comm->options.in_place_min_bytes;
    c->output.saved = comm->scratch;
    c->output.rank_rows = a->reduce_in_rank_order && n > 1 ? comm->rank_rows : NULL; /* alone, our input is the sum */
    c->chunks.rs_count = (uint16_t *)comm->chunk_state;
    c->chunks.final_count = c->chunks.rs_count + total_chunks;
    c->chunks.chunk_flags = (uint8_t *)(c->chunks.final_count + total_chunks);
    for (uint64_t i = 0; i < total_chunks; i++)
        c->chunks.rs_count[i] = 1;
    memset(c->chunks.final_count, 0, total_chunks * sizeof(uint16_t));
    memset(c->chunks.chunk_flags, 0, total_chunks);
    /* what this rank holds fresh before anything arrives: all_gather's own
     * shard, everything at a broadcast's root */
    uint32_t own = c->schedule.owned_block;
    if (c->schedule.facts->holds_own_block)
        for (uint64_t id = c->geometry.chunk_base[own]; id < c->geometry.chunk_base[own + 1]; id++)
            c->chunks.final_count[id] = 1;
    if (c->schedule.facts->root_holds_all && c->rank == a->root)
        for (uint64_t id = 0; id < total_chunks; id++)
            c->chunks.final_count[id] = 1;

    if (c->schedule.finalize_after == UDT_NO_STEP)
        udt_finalize_owned_block(c); /* a world of one: our block is final as it is */
    uint32_t window = comm->options.window_bytes / comm->options.chunk_bytes;
    c->data.window_chunks = window < 16 ? 16 : window;
    c->data.copies = c->args.copies ? c->args.copies : 1;
    c->stats->steps = steps;
    c->stats->critical_path = (uint32_t)c->schedule.critical_path;
    return UDT_OK;
}

/* Why these arguments cannot make a call (NULL: they can). Every check runs before the call
 * takes its sequence number, so a refused call changes nothing and says which argument. */
static const char *refusal(const struct udt_comm *comm, const struct udt_collective_args *a)
{
    const struct udt_collective_facts *facts = udt_collective_facts(a->collective);
    if (!facts)
        return "collective: unknown";
    if (a->algorithm < 0 || a->algorithm >= UDT_ALGORITHM_COUNT)
        return "algorithm: unknown (ring or direct)";
    if (a->dtype < 0 || a->dtype >= UDT_DTYPE_COUNT)
        return "dtype: not one the wire carries";
    if (a->op != UDT_OP_SUM && a->op != UDT_OP_MEAN)
        return "op: sum or mean";
    if (a->estimator != UDT_ESTIMATOR_UNBIASED && a->estimator != UDT_ESTIMATOR_ZERO_FILL)
        return "estimator: unbiased or zero_fill";
    if (!(a->deadline_s > 0) || !(a->deadline_s <= 1e6))
        return "deadline_s: more than 0 and at most 1e6 seconds";
    if (!(a->loss_budget >= 0) || !(a->loss_budget <= 1))
        return "loss_budget: a fraction in [0, 1]";
    if (a->root >= comm->world_size)
        return "root: not a rank of this communicator";
    if (a->copies > UDT_MAX_COPIES)
        return "copies: more than UDT_MAX_COPIES";
    /* reduce_scatter's output and all_gather's input are this rank's shard, which may be empty */
    uint64_t shard = udt_block_length(a->count, comm->world_size, comm->rank);
    uint64_t input_count = facts->input_is_shard ? shard : a->piece_counts ? udt_pieces_input_count(a, comm->world_size) : a->count;
    uint64_t output_count = facts->output_is_shard ? shard : a->count;
    if (facts->moves_data && input_count && !a->input)
        return "input: missing";
    if (facts->moves_data && output_count && !a->output)
        return "output: missing";
    const char *why = a->piece_counts ? udt_pieces_refusal(comm, a) : NULL;
    if (why)
        return why;
    /* equal blocks, so that what rank r sends rank q is as long as q's block for it */
    if (facts->equal_blocks && !a->piece_counts && a->count % comm->world_size)
        return "count: must divide by the world size";
    if (facts->sends_input && (a->direct_output || a->piece_counts)) {
        /* written as it arrives, the output must not be the input later steps still send from;
         * nor, with pieces of their own sizes, where a rank's own piece sits elsewhere in each */
        uint64_t element_bytes = (uint64_t)udt_wire_elem_bytes(a->dtype);
        uint64_t in_bytes = input_count * element_bytes, out_bytes = output_count * element_bytes;
        const uint8_t *in = a->input, *out = a->output;
        if (in_bytes && out_bytes && in < out + out_bytes && out < in + in_bytes)
            return "output: overlaps the input (direct_output, or an all_to_all with piece_counts)";
    }
    uint64_t chunk_elements = comm->options.chunk_bytes / udt_wire_elem_bytes(a->dtype);
    if (!chunk_elements)
        return "chunk_bytes: smaller than one element";
    /* positions on the wire are step * chunks + chunk, below 2^32 with room for a window */
    uint64_t largest_block = (a->count + comm->world_size - 1) / comm->world_size;
    uint64_t max_chunks = facts->moves_data ? udt_chunks_for(largest_block, chunk_elements) : 0;
    uint32_t steps = udt_schedule_steps(a->collective, a->algorithm, comm->world_size);
    if ((uint64_t)(steps + 1) * (max_chunks + 1) + (uint64_t)comm->options.window_bytes >= 0xF0000000ull || steps > 0xFFFF)
        return "count: too many chunks for one call (raise chunk_bytes)";
    if (a->reduce_in_rank_order) {
        if ((facts->output != UDT_OUTPUT_REDUCED && facts->output != UDT_OUTPUT_REDUCED_SHARD) ||
            a->algorithm != UDT_ALGORITHM_DIRECT)
            return "reduce_in_rank_order: an allreduce or reduce_scatter on the direct algorithm only";
        if (a->dtype != UDT_FLOAT32 && a->dtype != UDT_FLOAT64)
            return "reduce_in_rank_order: float32 or float64 only";
        if (a->loss_budget != 0.0 || a->write_on_budget_miss)
            return "reduce_in_rank_order: a loss budget of 0, without write_on_budget_miss (a partial sum has no rank order)";
    }
    if (a->chunk_mask && !a->piece_counts) {
        uint64_t want = udt_chunk_mask_bytes(a->collective, a->algorithm, a->count, a->dtype, comm->rank, comm->world_size,
                                             comm->options.chunk_bytes);
        if (!want)
            return "chunk_mask: none for this collective and algorithm";
        if (a->chunk_mask_bytes != want)
            return "chunk_mask_bytes: not what udt_chunk_mask_bytes says";
    }
    return NULL;
}

int udt_call_start(struct udt_comm *comm, const struct udt_collective_args *args, struct udt_collective_stats *stats, uint64_t now)
{
    memset(stats, 0, sizeof *stats);
    stats->silent_rank = -1;
    stats->mismatched_rank = -1;
    stats->stripes = 1;
    stats->delivered_fraction = stats->reduce_fraction = stats->gather_fraction = 1.0;
    stats->own_reduce_fraction = stats->own_gather_fraction = 1.0;
    stats->deadline_s = args->deadline_s;
    const char *why = refusal(comm, args);
    if (why)
        return fail(comm, UDT_ERR_INVALID_ARGUMENT, why);
    struct call *c = &comm->call;
    memset(c, 0, sizeof *c);
    c->args = *args;
    c->schedule.facts = udt_collective_facts(args->collective);
    if (!c->schedule.facts->moves_data)
        c->args.count = 0;
    c->stats = stats;
    comm->sequence++; /* wraps modulo 2^32: every comparison is equality or +1 modulo 2^32 */
    stats->sequence = comm->sequence;
    c->sequence = comm->sequence;
    c->n = comm->world_size;
    c->rank = comm->rank;
    c->layout_tag = layout_tag_of(&c->args, comm->options.chunk_bytes);
    c->live.mismatched_rank = -1;
    c->start_ns = now;
    /* until every rank is known to be in the call, only the join timeout runs */
    udt_set_deadlines(c, now, comm->options.join_timeout_ms * 1e-3);
    udt_mark_quotes(comm);
    c->drops_before = comm->transport->counter_injected_drops;
    c->overflows_before = comm->transport->counter_receive_overflows;
    c->send_calls_before = comm->transport->counter_send_calls;
    c->receive_calls_before = comm->transport->counter_receive_calls;
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        memset(&peer->in_call, 0, sizeof peer->in_call);
        /* it may have spoken already: a credit or a JOIN of this call came before we started */
        peer->in_call.heard = (peer->early_credit_valid && peer->early_credit_sequence == c->sequence) ||
                              (peer->early_join_valid && peer->early_join_sequence == c->sequence);
        peer->early_join_valid = 0;
        peer->in_call.last_heard_ns = peer->in_call.heard ? now : 0;
        peer->in_call.join_request_ns = now + udt_join_request_interval(comm, 0); /* data and credits may show it first */
        c->live.heard_count += peer->in_call.heard && p != c->rank;
    }
    int rc = prepare(comm, c);
    if (rc != UDT_OK)
        return rc;
    for (uint32_t g = 0; g < c->schedule.steps; g++)
        if (c->step[g].send_peer != UDT_NO_PEER)
            comm->peers[c->step[g].send_peer].in_call.credit_ceiling = g * c->geometry.max_chunks + send_chunks(c, c->step[g].send_block);
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (!peer->early_credit_valid || peer->early_credit_sequence != c->sequence)
            continue;
        peer->early_credit_valid = 0;
        if (peer->early_credit_layout == c->layout_tag && peer->early_credit <= peer->in_call.credit_ceiling)
            peer->in_call.credit_limit = peer->early_credit;
        else
            stats->dropped_invalid++; /* checked now that the call's schedule is known */
        if (peer->early_credit_layout == c->layout_tag && peer->early_credit > peer->in_call.credit_ceiling && c->args.piece_counts)
            c->live.mismatched_rank = (int32_t)p; /* it expects a larger piece (data.c, admit_credit) */
    }
    c->phase = PHASE_DATA;
    if (c->n == 1) {
        c->phase = PHASE_DONE; /* nothing to exchange, nobody to disagree with */
        c->verdict.decided = 1;
        c->verdict.status = UDT_OK;
        return UDT_OK;
    }
    udt_verdict_begin_peers(c, comm, now);
    if (c->live.heard_count == c->n - 1 && !c->live.all_heard_ns) { /* everyone spoke before we started */
        c->live.all_heard_ns = now;
        udt_set_deadlines(c, now, c->args.deadline_s);
    }
    c->live.join_request_due_ns = now + udt_join_request_interval(comm, 0);
    if (c->args.count == 0 && !c->args.piece_counts) /* no data to move; the verdict round still checks everyone called alike */
        c->data.recv_step = c->data.send_step = c->schedule.steps;
    udt_set_step_deadline(c, now);
    rc = udt_grant_credits(c, now, 1);
    if (rc < 0) {
        c->phase = PHASE_IDLE;
        comm->error = comm->transport->error;
        return UDT_ERR_TRANSPORT;
    }
    return UDT_OK;
}

static void on_datagram(struct call *c, struct udt_comm *comm, const struct udt_recv_item *item, uint64_t now)
{
    struct udt_collective_stats *st = c->stats;
    struct udt_wire_header h;
    if (udt_wire_decode(item->data, item->bytes, &h) != 0) {
        st->dropped_invalid++;
        return;
    }
    if (h.magic != UDT_WIRE_MAGIC || h.version != UDT_WIRE_VERSION || h.session_id != comm->session_id || item->peer < 0 ||
        (uint32_t)item->peer != h.source_rank || h.source_rank == c->rank) {
        st->dropped_foreign++;
        return;
    }
    uint32_t peer = (uint32_t)item->peer;
    /* it carries our session from the peer's address: the peer's socket is open, whatever the
     * rest of the datagram turns out to be (it refutes a bounce: see notice_bounces) */
    comm->peers[peer].alive_ns = now;
    const uint8_t *payload = item->data + UDT_WIRE_HEADER_BYTES;
    switch (h.kind) {
    case UDT_KIND_CREDIT:
        udt_on_credit(c, comm, &h, item->bytes, peer, now);
        return;
    case UDT_KIND_JOIN:
        udt_on_join(c, comm, &h, item->bytes, peer, now); /* a reply the socket refused: the peer asks again */
        return;
    case UDT_KIND_AGREE:
        udt_verdict_receive(c, comm, &h, payload, item->bytes - UDT_WIRE_HEADER_BYTES, peer, now);
        return;
    case UDT_KIND_DATA:
    case UDT_KIND_END:
        break;
    default:
        st->dropped_invalid++;
        return;
    }
    udt_on_data(c, comm, &h, payload, item->bytes, peer, now);
}

static int receive_some(struct call *c, struct udt_comm *comm, uint64_t now)
{
    struct udt_recv_item items[RECV_BATCH];
    int got = udt_transport_recv(comm->transport, items, RECV_BATCH);
    for (int i = 0; i < got; i++)
        on_datagram(c, comm, &items[i], now);
    return got;
}

int udt_call_progress(struct udt_comm *comm, uint64_t now, uint64_t *wake_ns)
{
    struct call *c = &comm->call;
    if (c->phase == PHASE_DONE || c->phase == PHASE_IDLE)
        return 2;
    int progressed = 0, rc;
    udt_notice_bounces(c, comm, now);
    if (c->phase == PHASE_DATA) {
        /* a closed port sends nothing more, and a call that will fail needs nothing more (a
         * peer's verdict carries a cause, or a peer called with another layout: its data and ours
         * do not fit, as its JOIN or data showed): the verdict round then settles the cause, which
         * the layout tags every verdict carries name alike everywhere */
        if (now >= c->live.deadline_ns || c->live.ports_closed || c->live.doomed || c->live.mismatched_rank >= 0) {
            /* whatever has not arrived is lost; close the rest in order so
             * the owned block is still rescaled; abandon unsent data */
            c->stats->deadline_expired = now >= c->live.deadline_ns;
            udt_close_all_steps(c);
            c->data.send_step = c->schedule.steps;
            for (uint32_t p = 0; p < c->n; p++) /* what was not sent never will be: a JOIN says so */
                comm->peers[p].in_call.sent_steps = c->schedule.steps;
        }
        progressed |= udt_close_ready_steps(c, now);
        if ((rc = udt_send_some(c)) < 0)
            return rc;
        progressed |= rc;
    }
    int got = receive_some(c, comm, now);
    if (got < 0)
        return got;
    progressed |= got > 0;
    /* past the hard deadline the verdict is decided at once, so first read what is queued: a
     * rank that was paused or descheduled finds its peers' verdicts there, behind the data they
     * sent, and with them the cause they decided on. Best effort, and bounded: at most
     * LATE_DRAIN_BATCHES batches, so that a flood (from anyone: strangers' datagrams count too)
     * cannot hold the call past its deadline. */
    for (int batches = 0; got > 0 && batches < LATE_DRAIN_BATCHES && now >= c->live.hard_deadline_ns && !c->verdict.decided; batches++)
        if ((got = receive_some(c, comm, now)) < 0)
            return got;
    if (c->phase == PHASE_DATA) {
        progressed |= udt_close_ready_steps(c, now);
        if (c->data.recv_step < c->schedule.steps ? (rc = udt_grant_credits(c, now, 0)) < 0 : (rc = udt_regrant(c, now)) < 0)
            return rc;
        if (c->data.recv_step >= c->schedule.steps && c->data.send_step >= c->schedule.steps) {
            udt_verdict_begin(c, comm, now);
            progressed = 1;
        }
    }
    if (c->phase == PHASE_DATA) {
        if ((rc = udt_request_joins(c, comm, now)) < 0 || (rc = udt_ask_waited_sender(c, comm, now)) < 0)
            return rc;
        progressed |= rc;
    }
    uint64_t wake = c->phase == PHASE_DATA ? udt_data_wake(c, comm, now) : c->live.hard_deadline_ns;
    if (c->phase == PHASE_VERDICT) {
        rc = udt_verdict_progress(c, comm, now, &wake);
        if (rc < 0)
            return rc;
        progressed |= rc;
    }
    if (wake_ns)
        *wake_ns = wake;
    return c->phase == PHASE_DONE ? 2 : progressed;
}

int udt_collective_verdict(struct udt_comm *comm)
{
    struct call *c = &comm->call;
    return c->n > 1 ? udt_verdict_status(c, comm) : UDT_OK;
}

/* What the transport counted during the call (its counters run across calls). */
static void note_transport_counters(struct udt_comm *comm)
{
    const struct call *c = &comm->call;
    const struct udt_transport *t = comm->transport;
    c->stats->injected_drops = t->counter_injected_drops - c->drops_before;
    c->stats->receive_overflow_drops = t->counter_receive_overflows - c->overflows_before;
    c->stats->send_calls = t->counter_send_calls - c->send_calls_before;
    c->stats->receive_calls = t->counter_receive_calls - c->receive_calls_before;
}

/* A veto other than UDT_OK fails a call whose own verdict was OK (a sibling stripe failed):
 * the tensor is put back as for any failure. */
static int finish_call(struct udt_comm *comm, uint64_t now, int veto)
{
    struct call *c = &comm->call;
    struct udt_collective_stats *st = c->stats;
    udt_uncached_fence(); /* the saves and final values are in memory before the caller (or a stripe) reads */
    note_transport_counters(comm);
    st->mismatched_rank = c->live.mismatched_rank;
    st->elapsed_s = (double)(now - c->start_ns) * 1e-9;
    if (c->phase != PHASE_DONE) {
        c->phase = PHASE_IDLE;
        udt_restore_originals(c);
        return fail(comm, UDT_ERR_TRANSPORT, "call abandoned before its verdict");
    }
    c->phase = PHASE_IDLE;
    if (c->n > 1)
        st->delivered_fraction = udt_delivered_fraction(c);
    int status = udt_collective_verdict(comm);
    if (status == UDT_OK && veto != UDT_OK) {
        status = veto;
        st->stripes_vetoed = 1;
    }
    if (status == UDT_OK)
        udt_write_output(c);
    else
        udt_restore_originals(c);
    return status;
}

int udt_call_finish(struct udt_comm *comm, uint64_t now)
{
    return finish_call(comm, now, UDT_OK);
}

/* The call ends here, before its verdict, the tensor as it was given: another stripe's outcome
 * made it moot (striped.c), or its transport failed. */
static int abandon_call(struct udt_comm *comm, int status)
{
    udt_uncached_fence();
    comm->call.phase = PHASE_IDLE;
    udt_restore_originals(&comm->call);
    note_transport_counters(comm);
    comm->call.stats->elapsed_s = (double)(monotonic_ns() - comm->call.start_ns) * 1e-9;
    return status;
}

static int end_on_transport_error(struct udt_comm *comm)
{
    comm->error = comm->transport->error;
    return abandon_call(comm, UDT_ERR_TRANSPORT);
}

int udt_collective_to_verdict(struct udt_comm *comm, const struct udt_collective_args *args, struct udt_collective_stats *stats,
                              const int *cancel)
{
    uint64_t now = monotonic_ns();
    int rc = udt_call_start(comm, args, stats, now);
    if (rc != UDT_OK) {
        stats->elapsed_s = (double)(monotonic_ns() - now) * 1e-9;
        return rc;
    }
    uint64_t spin_started_ns = 0, hook_ns = now;
    for (;;) {
        uint64_t wake = 0;
        if (cancel && __atomic_load_n(cancel, __ATOMIC_ACQUIRE))
            return abandon_call(comm, UDT_ERR_CANCELLED);
        if (__atomic_load_n(&comm->interrupted, __ATOMIC_ACQUIRE)) {
            fail(comm, UDT_ERR_INTERRUPTED, "the call was interrupted: its communicator is being closed");
            return abandon_call(comm, UDT_ERR_INTERRUPTED);
        }
        now = monotonic_ns();
        if (comm->wait_hook && now - hook_ns >= (uint64_t)UDT_WAIT_HOOK_INTERVAL_MS * 1000000ull) {
            hook_ns = now;
            if (comm->wait_hook(comm->wait_hook_arg)) {
                fail(comm, UDT_ERR_INTERRUPTED, "the call was interrupted: its wait hook said so (a signal's handler raised)");
                return abandon_call(comm, UDT_ERR_INTERRUPTED);
            }
        }
        rc = udt_call_progress(comm, now, &wake);
        if (rc < 0)
            return end_on_transport_error(comm);
        if (rc == 2)
            break;
        if (rc == 1) {
            spin_started_ns = 0;
            continue;
        }
        /* Spin briefly before sleeping: a wake-up costs more than the next
         * datagram usually takes to come. Each turn yields the core, so a
         * thread that wants it (the model's, another rank's) gets turns at it
         * while this one waits (the scheduler still shares the core out). */
        if (!spin_started_ns)
            spin_started_ns = now;
        if (now - spin_started_ns < udt_us(comm->options.busy_poll_us)) {
            sched_yield();
            continue;
        }
        int64_t wait_us = wake > now ? (int64_t)((wake - now) / 1000) : 0;
        stats->idle_waits++;
        if (wait_us > 0 && udt_transport_wait(comm->transport, (int)(wait_us > 100000 ? 100000 : wait_us)) < 0)
            return end_on_transport_error(comm);
    }
    comm->call.verdict_ns = monotonic_ns();
    return UDT_OK;
}

int udt_collective_settle(struct udt_comm *comm, int veto)
{
    struct call *c = &comm->call;
    int rc = finish_call(comm, c->verdict_ns, veto);
    /* on a real clock the call ends once the result is written (or the tensor put back) */
    uint64_t end_ns = monotonic_ns();
    c->stats->output_s = (double)(end_ns - c->verdict_ns) * 1e-9;
    c->stats->elapsed_s = (double)(end_ns - c->start_ns) * 1e-9;
    return rc;
}

int udt_collective(struct udt_comm *comm, const struct udt_collective_args *args, struct udt_collective_stats *stats)
{
    int rc = udt_collective_to_verdict(comm, args, stats, NULL);
    return rc == UDT_OK ? udt_collective_settle(comm, UDT_OK) : rc;
}
