/* The engine: executes one rank's schedule, chunk by chunk, one chunk per
 * datagram, and never retransmits data.
 *  - A receive step closes when all its chunks arrived, when its sender's
 *    END marker (or verdict) arrived, when that sender moved on to a later
 *    step, when the sender answers that it is done with it (asked once the
 *    step has had nothing for idle_close_us, or at its share of the
 *    deadline), or at the call's deadline; silence alone never closes it,
 *    and a lost chunk never stalls later hops.
 *  - Reduced chunks carry how many ranks' inputs they sum; the owner of a
 *    block rescales by N/count, so the estimate is unbiased.
 *  - Receivers grant senders credits (a window of positions shared by all
 *    senders), so a healthy link never overflows a receive buffer.
 *  - The data deadline counts from the moment every rank is known to be in
 *    the call (a JOIN exchange finds the quiet ones), so a late rank costs
 *    time, not data; a separate, long join timeout catches the absent.
 *  - Then the verdict round (verdict.c): every rank returns the same outcome.
 * The caller's output is written once, at the end, and only on success. */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "blocks.h"
#include "elementwise.h"
#include "engine_internal.h"

/* credits are handed out at most this many receive steps ahead (the window
 * usually runs out first) */
#define CREDIT_LOOKAHEAD_STEPS 64
/* a sender looks at most this many steps past its lowest unfinished one */
#define SEND_LOOKAHEAD_STEPS 64

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

static uint64_t us(uint32_t microseconds) { return (uint64_t)microseconds * 1000ull; }

static void set_step_deadline(struct call *c, uint64_t now);
static void mark_quotes(struct udt_comm *comm);

/* The verdict round may run past the data deadline by a bounded slack. */
static void set_deadlines(struct call *c, uint64_t from, double seconds)
{
    double slack_s = c->args.deadline_s / 4 < 0.05 ? 0.05 : c->args.deadline_s / 4 > 1.0 ? 1.0 : c->args.deadline_s / 4;
    c->deadline_ns = from + (uint64_t)(seconds * 1e9);
    c->hard_deadline_ns = c->deadline_ns + (uint64_t)(slack_s * 1e9);
}

/* A peer showed it is in this call (any valid datagram of it). When it is
 * the last one we waited for, the data deadline starts. */
void udt_hear(struct call *c, struct udt_comm *comm, uint32_t peer, uint64_t now)
{
    struct peer_state *p = &comm->peers[peer];
    p->last_heard_ns = now;
    if (p->heard || peer == c->rank)
        return;
    p->heard = 1;
    p->join_requests = 0; /* from now on requests are liveness probes, starting again at the first interval */
    p->join_request_ns = 0;
    if (++c->heard_count == c->n - 1 && !c->all_heard_ns) {
        c->all_heard_ns = now;
        c->stats->join_wait_s = (double)(now - c->start_ns) * 1e-9;
        set_deadlines(c, now, c->args.deadline_s);
        if (c->phase == PHASE_DATA)
            set_step_deadline(c, now);
    }
}

/* ---- geometry of this call ------------------------------------------- */

static uint32_t chunks_in_block(const struct call *c, uint32_t block) { return (uint32_t)(c->chunk_base[block + 1] - c->chunk_base[block]); }

static uint64_t chunk_first_element(const struct call *c, uint32_t block, uint32_t chunk)
{
    return c->block_first[block] + (uint64_t)chunk * c->chunk_elements;
}

static uint64_t chunk_length(const struct call *c, uint32_t block, uint32_t chunk)
{
    uint64_t end = c->block_first[block + 1], first = chunk_first_element(c, block, chunk);
    return end - first < c->chunk_elements ? end - first : c->chunk_elements;
}

/* The caller's input for an element: all_gather's input is only our shard. */
static const uint8_t *input_at(const struct call *c, uint64_t element)
{
    uint64_t offset = c->schedule.facts->input_is_shard ? element - c->block_first[c->rank] : element;
    return (const uint8_t *)c->args.input + offset * c->wire_bytes;
}

/* In place, a chunk's original goes to the scratch before the tensor changes, to be put back
 * if the call fails (restore_originals); nothing else reads it, so the copy bypasses the cache.
 * Until the chunk changes (SCRATCH_VALID) the tensor itself holds our input. Sending a chunk
 * saves it too, so the tensor is read once for both and sent from the cache. The chunks after
 * it in its block go with it while they are unsaved (so unchanged): one copy of up to 64 KiB,
 * not one per MTU-sized chunk. 2 ranks, loopback, 64 MiB: a cached save that the send and the
 * sum then read cost a read of the scratch from memory on top, and evicted the tensor. */
static void save_original(struct call *c, uint32_t block, uint32_t chunk)
{
    uint64_t base = c->chunk_base[block];
    if (!c->in_place || (c->chunk_flags[base + chunk] & ORIGINAL_SAVED))
        return;
    uint32_t end = chunk, chunks = chunks_in_block(c, block);
    uint64_t bytes = 0;
    do {
        c->chunk_flags[base + end] |= ORIGINAL_SAVED;
        bytes += chunk_length(c, block, end) * c->wire_bytes;
        end++;
    } while (end < chunks && bytes < SAVE_AHEAD_BYTES && !(c->chunk_flags[base + end] & ORIGINAL_SAVED));
    uint64_t first = chunk_first_element(c, block, chunk);
    uint8_t *to = c->saved + first * c->wire_bytes;
    const uint8_t *from = c->accum + first * c->wire_bytes;
    if (bytes >= UNCACHED_MIN_BYTES)
        udt_copy_uncached(to, from, bytes);
    else
        memcpy(to, from, bytes);
}

static int reduces(const struct call *c) { return c->schedule.facts->reduces; }
static int gathers(const struct call *c) { return c->schedule.facts->gathers; }
/* what a step sends never depends on what arrived */
static int sends_input(const struct call *c) { return c->schedule.facts->sends_input; }

static uint32_t layout_tag_of(const struct udt_collective_args *a, uint32_t chunk_bytes)
{
    uint64_t fields[8] = {(uint64_t)a->collective, (uint64_t)a->algorithm, a->count, (uint64_t)a->dtype,
                          (uint64_t)a->op, chunk_bytes, (uint64_t)a->estimator, a->root};
    uint32_t hash = 2166136261u; /* FNV-1a */
    const uint8_t *bytes = (const uint8_t *)fields;
    for (size_t i = 0; i < sizeof fields; i++)
        hash = (hash ^ bytes[i]) * 16777619u;
    if (a->layout_salt) /* only then: a call without one keeps the tag peers of the same wire version compute */
        for (int i = 0; i < 4; i++)
            hash = (hash ^ ((a->layout_salt >> (8 * i)) & 0xffu)) * 16777619u;
    return hash;
}

/* ---- sending ------------------------------------------------------------ */

static struct udt_comm *comm_of(struct call *c) { return (struct udt_comm *)((uint8_t *)c - offsetof(struct udt_comm, call)); }

void udt_fill_header(struct call *c, struct udt_wire_header *h, uint8_t kind, uint32_t step)
{
    memset(h, 0, sizeof *h);
    h->magic = UDT_WIRE_MAGIC;
    h->version = UDT_WIRE_VERSION;
    h->kind = kind;
    h->session_id = comm_of(c)->session_id;
    h->sequence = c->sequence;
    h->source_rank = (uint16_t)c->rank;
    h->layout_tag = c->layout_tag;
    if (kind == UDT_KIND_DATA || kind == UDT_KIND_END) {
        h->step = (uint16_t)step;
        h->phase = c->step[step].phase == UDT_STEP_GATHER ? UDT_PHASE_GATHER : UDT_PHASE_REDUCE;
    }
}

static int send_control(struct call *c, uint8_t kind, uint32_t step, uint32_t peer, uint32_t credit, int copies)
{
    struct udt_comm *comm = comm_of(c);
    struct udt_wire_header h;
    udt_fill_header(c, &h, kind, step);
    h.credit = credit;
    uint8_t *slot = comm->headers[SEND_BATCH];
    udt_wire_encode(&h, slot);
    struct udt_send_item items[UDT_MAX_END_REPEATS];
    int n = copies < UDT_MAX_END_REPEATS ? copies : UDT_MAX_END_REPEATS;
    for (int i = 0; i < n; i++)
        items[i] = (struct udt_send_item){.peer = peer, .header = slot, .header_bytes = UDT_WIRE_HEADER_BYTES};
    int rc = udt_transport_send(comm->transport, items, n);
    if (rc > 0)
        c->stats->datagrams_sent += (uint64_t)rc;
    return rc; /* how many copies were queued (the socket may be full), or -errno */
}

/* A lost credit stalls its sender until the next refresh (credit_refresh_us); two
 * copies of a header-only datagram make that 1e-4 at 1% loss. Measured (loopback,
 * 2 ranks, 64 MiB, 1% real loss): p99 / p50 1.24-1.39 against 1.46-1.54 with one
 * copy in four alternating runs each, but later runs spread 1.23-1.54 either way. */
#define CREDIT_COPIES 2

/* One past the last position step g sends: each of its chunks `copies` times. */
static uint32_t passes_end(const struct call *c, uint32_t g) { return chunks_in_block(c, c->step[g].send_block) * c->copies; }

static uint32_t arrivals_per_regrant(const struct call *c) { return c->window_chunks / 4 ? c->window_chunks / 4 : 1; }

/* A quarter window of data came from a peer since our last credit to it, and no
 * credit went out for it: the arrivals took room in our window without moving
 * the position we grant (copies of chunks we hold, args.copies; or the last
 * chunks of a step, which close it and leave nothing to grant while the sender
 * still has copies to send). The same position is credited again, which gives
 * the sender its window back (a credit covers a window beyond what it had sent). */
static int regrant(struct call *c, uint64_t now)
{
    struct udt_comm *comm = comm_of(c);
    if (!c->regrant_due)
        return 0;
    c->regrant_due = 0;
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (p == c->rank || !peer->granted || peer->arrived_since_grant < arrivals_per_regrant(c))
            continue;
        int rc = send_control(c, UDT_KIND_CREDIT, 0, p, peer->granted, CREDIT_COPIES);
        if (rc < 0)
            return rc;
        if (rc == 0) { /* the socket is full: try again on the next pass */
            c->regrant_due = 1;
            c->credits_dirty = 1;
            continue;
        }
        peer->granted_at_ns = now;
        peer->arrived_since_grant = 0;
    }
    return 0;
}

/* Only in calls with copies (every rank passes the same): without them a sender is done
 * with a step once its positions are, and needs no credit back for it. */
static void count_arrival(struct call *c, struct udt_comm *comm, uint32_t peer)
{
    struct peer_state *p = &comm->peers[peer];
    if (c->copies > 1 && ++p->arrived_since_grant >= arrivals_per_regrant(c) && p->granted) {
        c->regrant_due = 1;
        c->credits_dirty = 1;
    }
}

/* A grown credit goes out once it grew by half a window (or on the refresh timer). Bigger
 * grants fill a sender's send batches: at 4 ranks on a bridge, MTU 1500, 64 MiB, 22.7 datagrams
 * per sendmmsg against 19.5 with a quarter, 15% fewer send calls (stats.send_calls; measured in
 * docs/wire_measurements.md, "The credit window"). The window bounds what is in flight either way. */
#define CREDIT_GROWTH_DIVISOR 2

/* Credits: walk the open receive steps in order and hand out the window,
 * step by step, to whoever sends each of them. A sender's credit is a
 * position (step * max_chunks + chunk) it may not reach. */
static int grant_credits(struct call *c, uint64_t now, int force)
{
    struct udt_comm *comm = comm_of(c);
    uint64_t refresh = us(comm->options.credit_refresh_us);
    if (!force && !c->credits_dirty && now < c->credits_walked_ns + refresh)
        return 0; /* nothing moved and no refresh is due */
    c->credits_walked_ns = now;
    c->credits_dirty = 0;
    comm->credit_epoch++;
    int32_t touched[CREDIT_LOOKAHEAD_STEPS];
    int touched_count = 0;
    uint32_t budget = c->window_chunks;
    uint32_t looked = 0;
    for (uint32_t g = c->recv_step; g < c->schedule.steps && budget > 0 && looked < CREDIT_LOOKAHEAD_STEPS; g++) {
        struct step_state *s = &c->state[g];
        int32_t p = c->step[g].recv_peer;
        if (p == UDT_NO_PEER || s->closed)
            continue;
        looked++;
        uint32_t room = s->expected - s->seen_end;
        uint32_t take = room < budget ? room : budget;
        budget -= take;
        struct peer_state *peer = &comm->peers[p];
        if (peer->wanted_epoch != comm->credit_epoch) { /* first step of this sender in this walk */
            peer->wanted_epoch = comm->credit_epoch;
            touched[touched_count++] = p;
            peer->wanted = 0;
        }
        uint32_t want = g * c->max_chunks + s->seen_end + take;
        if (want > peer->wanted)
            peer->wanted = want;
    }
    for (int i = 0; i < touched_count; i++) {
        struct peer_state *peer = &comm->peers[touched[i]];
        uint32_t grant = peer->wanted > peer->granted ? peer->wanted : peer->granted;
        int grew = grant >= peer->granted + c->window_chunks / CREDIT_GROWTH_DIVISOR || (grant > peer->granted && peer->granted == 0);
        if (!force && !grew && now - peer->granted_at_ns < refresh)
            continue;
        int rc = send_control(c, UDT_KIND_CREDIT, 0, (uint32_t)touched[i], grant, CREDIT_COPIES);
        if (rc < 0)
            return rc;
        if (rc == 0) { /* the socket is full: try again on the next pass */
            c->credits_dirty = 1;
            continue;
        }
        peer->granted = grant;
        peer->granted_at_ns = now;
        peer->arrived_since_grant = 0;
    }
    return regrant(c, now);
}

/* Chunks of a send step that will actually be sent. */
static uint32_t count_to_send(const struct call *c, const struct udt_step *step)
{
    uint64_t base = c->chunk_base[step->send_block];
    uint32_t count = chunks_in_block(c, step->send_block), sending = 0;
    if (sends_input(c))
        return count;
    for (uint32_t k = 0; k < count; k++)
        sending += (step->phase == UDT_STEP_GATHER ? c->final_count[base + k] : c->rs_count[base + k]) != 0;
    return sending;
}

struct send_batch {
    struct udt_send_item items[SEND_BATCH];
    uint32_t step[SEND_BATCH], chunk[SEND_BATCH];
    int n;
};

/* Hand the batch to the transport. Items it did not take are rolled back
 * into their steps, to go out on a later pass. Returns how many it took. */
static int flush(struct call *c, struct send_batch *b)
{
    if (b->n == 0)
        return 0;
    int sent = udt_transport_send(comm_of(c)->transport, b->items, b->n);
    if (sent < 0)
        return sent;
    c->stats->datagrams_sent += (uint64_t)sent;
    for (int i = b->n - 1; i >= sent; i--) {
        c->state[b->step[i]].sent_chunk = b->chunk[i]; /* items of a step are in position order */
        comm_of(c)->peers[b->items[i].peer].chunks_queued--;
    }
    int taken = sent;
    b->n = 0;
    return taken;
}

/* Put chunks of step g into the batch until it is full or the receiver's
 * credit runs out. Returns 1 when every chunk of the step is handed out. */
static int fill_from_step(struct call *c, uint32_t g, struct send_batch *b)
{
    struct udt_comm *comm = comm_of(c);
    const struct udt_step *step = &c->step[g];
    struct step_state *state = &c->state[g];
    struct peer_state *peer = &comm->peers[step->send_peer];
    uint32_t block = step->send_block, chunk_count = chunks_in_block(c, block);
    uint64_t base = c->chunk_base[block];
    int identity = c->accum_bytes == c->wire_bytes;
    if (!state->send_counted) {
        state->send_announced = count_to_send(c, step);
        state->send_counted = 1;
    }
    /* with copies, the step is sent `copies` times over: pass k sends position k * chunks + chunk */
    uint32_t position = state->sent_chunk, end = passes_end(c, g);
    for (; position < end && b->n < SEND_BATCH; position++) {
        uint32_t chunk = position % chunk_count;
        /* a credit is a position, and covers at most a window beyond what we had sent
         * when it came: a forged credit cannot make us overrun the receiver by more
         * (a later copy's position was credited for the first; it counts against the window) */
        if (g * c->max_chunks + chunk >= peer->credit_limit || peer->chunks_queued >= peer->credit_base + c->window_chunks) {
            c->stats->credit_stalls++;
            break;
        }
        uint64_t id = base + chunk;
        uint16_t contributions = sends_input(c) ? 1 : step->phase == UDT_STEP_GATHER ? c->final_count[id] : c->rs_count[id];
        if (contributions == 0)
            continue; /* gather: we never got this chunk; the receiver keeps its own */
        struct udt_wire_header h;
        udt_fill_header(c, &h, UDT_KIND_DATA, g);
        uint64_t elements = chunk_length(c, block, chunk), first = chunk_first_element(c, block, chunk);
        h.chunk_index = chunk;
        h.contributions = contributions;
        h.credit = state->send_announced;
        h.payload_bytes = (uint32_t)(elements * c->wire_bytes);
        udt_wire_encode(&h, comm->headers[b->n]);
        const void *payload;
        if (sends_input(c) || !(c->chunk_flags[id] & SCRATCH_VALID)) {
            save_original(c, block, chunk);
            payload = input_at(c, first); /* our own input, untouched (in place: the tensor, unchanged) */
        } else if (identity) {
            payload = c->accum + first * c->accum_bytes;
        } else {
            uint8_t *slot = comm->staging + (size_t)b->n * comm->options.chunk_bytes;
            udt_pack(c->args.dtype, slot, c->accum + first * c->accum_bytes, elements);
            payload = slot;
        }
        b->items[b->n] = (struct udt_send_item){.peer = (uint32_t)step->send_peer, .header = comm->headers[b->n],
                                                .header_bytes = UDT_WIRE_HEADER_BYTES, .payload = payload,
                                                .payload_bytes = h.payload_bytes};
        b->step[b->n] = g;
        b->chunk[b->n++] = position;
        peer->chunks_queued++;
    }
    state->sent_chunk = position;
    return position >= end;
}

static void mark_sent(struct call *c, uint32_t g)
{
    c->state[g].send_done = 1;
    if (c->step[g].send_peer != UDT_NO_PEER) /* to one receiver, steps go out in order */
        comm_of(c)->peers[c->step[g].send_peer].sent_steps = g + 1;
    while (c->send_step < c->schedule.steps && c->state[c->send_step].send_done)
        c->send_step++;
}

/* Send what dependencies, credit and the socket allow. Steps go out in
 * order, except that a step stalled on its receiver's credit does not hold
 * up later steps to other receivers (to one receiver, steps stay in order:
 * it reads a later step from us as the end of the earlier ones). */
static int send_some(struct call *c)
{
    struct udt_comm *comm = comm_of(c);
    struct send_batch b;
    b.n = 0;
    int progressed = 0, rc;
    comm->send_epoch++;
    uint32_t end = c->send_step + SEND_LOOKAHEAD_STEPS < c->schedule.steps ? c->send_step + SEND_LOOKAHEAD_STEPS : c->schedule.steps;
    for (uint32_t g = c->send_step; g < end && b.n < SEND_BATCH; g++) {
        const struct udt_step *step = &c->step[g];
        struct step_state *state = &c->state[g];
        if (state->send_done)
            continue;
        if (step->send_peer == UDT_NO_PEER || comm->peers[step->send_peer].finished) {
            mark_sent(c, g); /* nothing to send, or the receiver is done with this call */
            progressed = 1;
            continue;
        }
        struct peer_state *peer = &comm->peers[step->send_peer];
        if (peer->send_blocked_epoch == comm->send_epoch)
            continue; /* an earlier step to the same receiver is not done */
        peer->send_blocked_epoch = comm->send_epoch;
        if (step->send_after != UDT_NO_STEP && !c->state[step->send_after].closed)
            break; /* what we would send is still being received; later steps depend on it too */
        if (!fill_from_step(c, g, &b))
            continue; /* stalled on credit (or the batch is full) */
        /* every chunk is handed out: flush, then mark the step's end */
        if ((rc = flush(c, &b)) < 0)
            return rc;
        progressed |= rc > 0;
        if (state->sent_chunk < passes_end(c, g))
            break; /* the socket is full */
        rc = send_control(c, UDT_KIND_END, g, (uint32_t)step->send_peer, 0, (int)comm->options.end_repeats);
        if (rc < 0)
            return rc;
        if (rc == 0)
            break; /* the socket is full: the END goes out on the next pass */
        mark_sent(c, g);
        progressed = 1;
    }
    if ((rc = flush(c, &b)) < 0)
        return rc;
    return progressed | (rc > 0);
}

/* ---- receiving ---------------------------------------------------------- */

enum admission {
    ADMIT = 0,
    DROP_INVALID,
    DROP_STALE,
    DROP_CLOSED, /* a well-formed chunk of this call for a step we closed */
    DROP_DUPLICATE,
    DROP_EARLY,
    DROP_MISMATCH,
    DROP_QUIET, /* not counted: an old credit, an extra END copy */
};

/* Step g still has chunks to hand out once (its later copies aside). */
static int first_pass_pending(const struct call *c, uint32_t g)
{
    return !c->state[g].send_done && c->state[g].sent_chunk < chunks_in_block(c, c->step[g].send_block);
}

/* Data for a block whose earlier send step has only copies left to send: the
 * copies would read what this data overwrites, and holding the data back
 * instead would hold up a collective for the sake of redundancy. The step
 * sends no more copies (its END still goes out). */
static void drop_remaining_copies(struct call *c, const struct udt_step *step)
{
    if (!step->recv_needs_sent)
        return;
    uint32_t g = step->recv_needs_sent - 1;
    if (!c->state[g].send_done && c->state[g].sent_chunk < passes_end(c, g))
        c->state[g].sent_chunk = passes_end(c, g);
}

/* Decide what a DATA or END datagram is, changing nothing. */
static enum admission admit_data(const struct call *c, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer)
{
    if (h->sequence != c->sequence)
        return h->kind == UDT_KIND_END && h->sequence + 1 == c->sequence ? DROP_QUIET : DROP_STALE;
    if (h->flags != 0 || h->reserved != 0 || h->step >= c->schedule.steps)
        return DROP_INVALID;
    const struct udt_step *step = &c->step[h->step];
    if (step->recv_peer != (int32_t)peer)
        return DROP_INVALID; /* the schedule expects nothing from this rank in that step */
    if (h->phase != (step->phase == UDT_STEP_GATHER ? UDT_PHASE_GATHER : UDT_PHASE_REDUCE))
        return DROP_INVALID;
    if (h->layout_tag != c->layout_tag)
        return DROP_MISMATCH;
    if (h->kind == UDT_KIND_END)
        return c->state[h->step].closed ? DROP_QUIET : ADMIT;
    uint32_t block = step->recv_block;
    if (h->chunk_index >= chunks_in_block(c, block))
        return DROP_INVALID;
    uint64_t elements = chunk_length(c, block, h->chunk_index);
    uint64_t id = c->chunk_base[block] + h->chunk_index;
    if (h->payload_bytes != elements * c->wire_bytes || bytes != UDT_WIRE_HEADER_BYTES + h->payload_bytes ||
        h->contributions == 0)
        return DROP_INVALID;
    /* the count the sender announces (finding 7): exact when the schedule says it holds the
     * whole block; else at least what already arrived plus this one, at most the block */
    if (step->recv_whole ? h->credit != chunks_in_block(c, block) : h->credit == 0 || h->credit > chunks_in_block(c, block))
        return DROP_INVALID;
    if (c->state[h->step].closed)
        return DROP_CLOSED;
    if (c->arrival_bits[(size_t)h->step * c->bitmap_bytes + h->chunk_index / 8] & (1u << (h->chunk_index % 8)))
        return DROP_DUPLICATE;
    /* after the duplicate check: a chunk several senders add to (direct) may be full already
     * because a forged copy got in first; the real one is then a duplicate, not malformed */
    /* a reduce chunk carries no more than the sender's partial can hold (one rank's input in a
     * direct exchange) nor more than the ranks still missing here: believed, a forged count
     * would make the chunk look complete and the real contributions be refused */
    uint32_t most = step->recv_mode == UDT_RECV_REDUCE ? c->n - c->rs_count[id] : c->n;
    if (step->recv_mode == UDT_RECV_REDUCE && step->recv_contributions < most)
        most = step->recv_contributions;
    if (h->contributions > most || h->credit <= c->state[h->step].received)
        return DROP_INVALID; /* more contributions than possible, or fewer chunks announced than already came */
    if (step->recv_needs_sent && first_pass_pending(c, step->recv_needs_sent - 1))
        return DROP_EARLY; /* it would change a block we have not finished sending */
    return ADMIT;
}

static void note_peer_step(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t step, uint64_t now)
{
    struct peer_state *p = &comm->peers[peer];
    udt_hear(c, comm, peer, now);
    if (step + 1 > p->highest_step_seen)
        p->highest_step_seen = step + 1; /* a sender goes through its steps in order */
}

static void accept_data(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, const uint8_t *payload, uint32_t peer, uint64_t now)
{
    const struct udt_step *step = &c->step[h->step];
    struct step_state *s = &c->state[h->step];
    uint32_t block = step->recv_block;
    uint64_t id = c->chunk_base[block] + h->chunk_index;
    uint64_t first = chunk_first_element(c, block, h->chunk_index), elements = chunk_length(c, block, h->chunk_index);
    uint8_t *target = c->accum + first * c->accum_bytes;
    save_original(c, block, h->chunk_index);
    if (step->recv_mode == UDT_RECV_OVERWRITE) {
        uint64_t bytes = elements * c->wire_bytes;
        if (c->final_uncached && !s->relayed && bytes >= UNCACHED_MIN_BYTES)
            udt_copy_uncached(target, payload, bytes); /* final: next read by the caller, after the call */
        else
            udt_unpack(c->args.dtype, target, payload, elements);
        c->final_count[id] = h->contributions;
    } else {
        if ((c->chunk_flags[id] & SCRATCH_VALID) || c->in_place) /* in place an unchanged chunk is our input */
            udt_add(c->args.dtype, target, payload, elements);
        else
            udt_add_into(c->args.dtype, target, input_at(c, first), payload, elements);
        c->rs_count[id] = (uint16_t)(c->rs_count[id] + h->contributions);
    }
    c->chunk_flags[id] |= SCRATCH_VALID;
    c->arrival_bits[(size_t)h->step * c->bitmap_bytes + h->chunk_index / 8] |= (uint8_t)(1u << (h->chunk_index % 8));
    s->received++;
    s->last_arrival_ns = now;
    if (h->credit > s->announced) /* the largest wins: a sender cannot send more than it has */
        s->announced = h->credit;
    if (h->chunk_index + 1 > s->seen_end) {
        s->seen_end = h->chunk_index + 1;
        c->credits_dirty = 1;
    }
    c->stats->datagrams_received++;
    note_peer_step(c, comm, peer, h->step, now);
    count_arrival(c, comm, peer);
}

/* Decide what a CREDIT datagram is, changing nothing. A credit names a
 * position in one of our send steps to its sender; none is higher than the
 * end of our last such step (an early credit is checked when its call starts). */
static enum admission admit_credit(const struct call *c, const struct udt_comm *comm, const struct udt_wire_header *h,
                                   uint32_t bytes, uint32_t peer)
{
    if (bytes != UDT_WIRE_HEADER_BYTES || h->payload_bytes != 0 || h->flags != 0 || h->reserved != 0 || h->phase != 0 ||
        h->step != 0 || h->chunk_index != 0 || h->contributions != 0)
        return DROP_INVALID;
    if (h->sequence == c->sequence + 1)
        return ADMIT;
    if (h->sequence != c->sequence)
        return DROP_QUIET; /* a refresh of an earlier call's credit */
    if (h->layout_tag != c->layout_tag || h->credit > comm->peers[peer].credit_ceiling)
        return DROP_INVALID;
    return ADMIT;
}

static void on_credit(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer,
                      uint64_t now)
{
    switch (admit_credit(c, comm, h, bytes, peer)) {
    case ADMIT:
        break;
    case DROP_INVALID:
        c->stats->dropped_invalid++;
        return;
    default:
        return;
    }
    struct peer_state *p = &comm->peers[peer];
    udt_hear(c, comm, peer, now); /* in this call, or already in the next */
    if (h->sequence == c->sequence) {
        if (h->credit >= p->credit_limit) {
            p->credit_limit = h->credit;
            p->credit_base = p->chunks_queued;
        }
    } else {
        /* the peer started the next call already: keep its credit for then */
        if (!p->early_credit_valid || p->early_credit_sequence != h->sequence || h->credit > p->early_credit)
            p->early_credit = h->credit;
        p->early_credit_sequence = h->sequence;
        p->early_credit_layout = h->layout_tag;
        p->early_credit_valid = 1;
        /* Not taken as the peer's acknowledgement of our verdict: a credit carries no verdict, so
         * anyone could forge it and cut our verdict off from a peer that lacks it. A peer that has
         * moved on answers our verdict with its own (HAVE_YOURS) at once. */
    }
}

/* ---- who is in the call: JOIN requests and replies --------------------- */

/* Intervals between requests to one peer: the first after agree_resend_us,
 * doubling up to 128x while it is silent, so a rank waiting minutes for a late one sends it a
 * few thousand 44-byte datagrams, not millions. */
#define LIVE_SENDER_ASK_DOUBLINGS 4

static uint64_t join_request_interval(const struct udt_comm *comm, uint32_t attempts)
{
    return us(comm->options.agree_resend_us) << (attempts < 7 ? attempts : 7);
}

/* A JOIN also tells the peer how far our sending to it has come (`sent_steps`: it gets
 * nothing more of our steps below this), so a receiver whose END markers were all lost,
 * or that wonders whether a sender busy with other peers has reached its step, can ask. */
static int send_join(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t sequence, uint32_t layout_tag, uint8_t flags,
                     uint32_t sent_steps)
{
    struct udt_wire_header h;
    udt_fill_header(c, &h, UDT_KIND_JOIN, 0);
    h.sequence = sequence;
    h.layout_tag = layout_tag;
    h.flags = flags;
    h.credit = sent_steps;
    uint8_t *slot = comm->headers[SEND_BATCH + 2];
    udt_wire_encode(&h, slot);
    struct udt_send_item item = {.peer = peer, .header = slot, .header_bytes = UDT_WIRE_HEADER_BYTES};
    int rc = udt_transport_send(comm->transport, &item, 1);
    if (rc > 0) {
        c->stats->datagrams_sent++;
        c->stats->join_messages_sent++;
    }
    return rc;
}

static enum admission admit_join(const struct udt_wire_header *h, uint32_t bytes)
{
    if (bytes != UDT_WIRE_HEADER_BYTES || h->payload_bytes != 0 || (h->flags & ~UDT_JOIN_REPLY) || h->reserved != 0 ||
        h->phase != 0 || h->step != 0 || h->chunk_index != 0 || h->contributions != 0)
        return DROP_INVALID;
    return ADMIT;
}

/* A request is answered at once, for this call or, to a peer still in our
 * previous one, for that; a reply is never answered. The layout is not
 * checked here: a peer in the call with another layout is in the call, and
 * the verdict round names it. */
static int on_join(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer, uint64_t now)
{
    if (admit_join(h, bytes) != ADMIT) {
        c->stats->dropped_invalid++;
        return 0;
    }
    int request = !(h->flags & UDT_JOIN_REPLY);
    struct peer_state *p = &comm->peers[peer];
    if (h->sequence == c->sequence) {
        if (h->credit > c->schedule.steps) { /* past its last step: no sender says that */
            c->stats->dropped_invalid++;
            return 0;
        }
        udt_hear(c, comm, peer, now);
        if (h->layout_tag != c->layout_tag && c->mismatched_rank < 0)
            c->mismatched_rank = (int32_t)peer; /* it called something else: the data phase ends (see udt_call_progress) */
        if (h->credit > p->reported_sent) {
            p->reported_sent = h->credit;
            p->reported_at_ns = now;
        }
        if (!request) { /* it answers, so it is alive: while we wait on it, ask every 16 intervals at most */
            if (p->join_requests > LIVE_SENDER_ASK_DOUBLINGS)
                p->join_requests = LIVE_SENDER_ASK_DOUBLINGS;
            p->join_request_ns = now + join_request_interval(comm, p->join_requests);
            return 0;
        }
        return send_join(c, comm, peer, c->sequence, c->layout_tag, UDT_JOIN_REPLY, p->sent_steps);
    }
    if (h->sequence == c->sequence + 1) { /* it is in our next call (not taken as an acknowledgement: see on_credit) */
        p->early_join_sequence = h->sequence;
        p->early_join_valid = 1;
        udt_hear(c, comm, peer, now);
        return 0; /* we are not in that call yet: it asks again */
    }
    if (request && comm->have_last_verdict && h->sequence == comm->last_verdict_sequence)
        return send_join(c, comm, peer, comm->last_verdict_sequence, comm->last_layout_tag, UDT_JOIN_REPLY, comm->last_steps);
    return 0;
}

static int request_join(struct call *c, struct udt_comm *comm, uint32_t peer, uint64_t now)
{
    struct peer_state *p = &comm->peers[peer];
    if (!p->join_request_ns) /* a probe: give the sender a moment to show itself first */
        p->join_request_ns = now + join_request_interval(comm, 0);
    if (now < p->join_request_ns)
        return 0;
    int rc = send_join(c, comm, peer, c->sequence, c->layout_tag, 0, p->sent_steps);
    if (rc < 0)
        return rc;
    p->join_request_ns = now + join_request_interval(comm, p->join_requests++);
    return 1;
}

/* Ask every peer not yet heard from in this call whether it is in it. */
static int request_joins(struct call *c, struct udt_comm *comm, uint64_t now)
{
    if (c->all_heard_ns || now < c->join_request_due_ns)
        return 0;
    uint64_t due = UINT64_MAX;
    int progressed = 0;
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->rank || comm->peers[p].heard)
            continue;
        int rc = request_join(c, comm, p, now);
        if (rc < 0)
            return rc;
        progressed |= rc;
        if (comm->peers[p].join_request_ns < due)
            due = comm->peers[p].join_request_ns;
    }
    c->join_request_due_ns = due;
    return progressed;
}

/* A chunk we already hold, or one of a step we closed, from the sender the step
 * expects. With args.copies > 1 these are the later copies and counted apart
 * from drops; either way the sender is alive and in the step (the step's idle
 * clock restarts: the copy of a chunk we lack may be next) and the copy took
 * room in our window (see regrant). */
static void note_copy(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t peer, uint64_t now,
                      int step_open)
{
    if (c->copies > 1)
        c->stats->redundant_copies++;
    else if (step_open)
        c->stats->dropped_duplicate++;
    else
        c->stats->dropped_stale++;
    if (step_open)
        c->state[h->step].last_arrival_ns = now;
    udt_hear(c, comm, peer, now);
    count_arrival(c, comm, peer);
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
        on_credit(c, comm, &h, item->bytes, peer, now);
        return;
    case UDT_KIND_JOIN:
        on_join(c, comm, &h, item->bytes, peer, now); /* a reply the socket refused: the peer asks again */
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
    switch (admit_data(c, &h, item->bytes, peer)) {
    case ADMIT:
        break;
    case DROP_INVALID: st->dropped_invalid++; return;
    case DROP_STALE: st->dropped_stale++; return;
    case DROP_CLOSED:
        note_copy(c, comm, &h, peer, now, 0);
        return;
    case DROP_DUPLICATE:
        note_copy(c, comm, &h, peer, now, 1);
        return;
    case DROP_EARLY: st->dropped_early++; return;
    case DROP_MISMATCH:
        st->dropped_invalid++;
        c->mismatched_rank = (int32_t)peer;
        return;
    case DROP_QUIET: return;
    }
    if (h.kind == UDT_KIND_END) {
        if (!c->state[h.step].end_seen_ns)
            c->state[h.step].end_seen_ns = now;
        note_peer_step(c, comm, peer, h.step, now);
        return;
    }
    drop_remaining_copies(c, &c->step[h.step]);
    accept_data(c, comm, &h, payload, peer, now);
}

static int receive_some(struct call *c, struct udt_comm *comm, uint64_t now)
{
    struct udt_recv_item items[RECV_BATCH];
    int got = udt_transport_recv(comm->transport, items, RECV_BATCH);
    for (int i = 0; i < got; i++)
        on_datagram(c, comm, &items[i], now);
    return got;
}

/* ---- closing steps ------------------------------------------------------ */

static void set_step_deadline(struct call *c, uint64_t now)
{
    uint32_t remaining = c->recv_step < c->schedule.steps ? c->state[c->recv_step].receives_after + 1 : 1;
    uint64_t left = c->deadline_ns > now ? c->deadline_ns - now : 0;
    c->step_deadline_ns = now + left / remaining;
    c->step_opened_ns = now;
}

/* The owner's block is complete: rescale each chunk by N / contributions so
 * its expectation is the full sum. */
static void finalize_owned_block(struct call *c)
{
    if (!reduces(c))
        return;
    uint32_t block = c->schedule.owned_block, chunk_count = chunks_in_block(c, block);
    uint64_t base = c->chunk_base[block];
    for (uint32_t chunk = 0; chunk < chunk_count; chunk++) {
        uint64_t id = base + chunk;
        uint64_t first = chunk_first_element(c, block, chunk), elements = chunk_length(c, block, chunk);
        uint8_t *value = c->accum + first * c->accum_bytes;
        save_original(c, block, chunk);
        if (!(c->chunk_flags[id] & SCRATCH_VALID)) {
            if (!c->in_place) /* in place the tensor holds our input already */
                udt_load(c->args.dtype, value, input_at(c, first), elements);
            c->chunk_flags[id] |= SCRATCH_VALID;
        }
        if (c->args.estimator == UDT_ESTIMATOR_UNBIASED && c->rs_count[id] != c->n)
            udt_scale(c->args.dtype, value, elements, (double)c->n / c->rs_count[id]);
        c->final_count[id] = c->rs_count[id];
    }
}

static void close_step(struct call *c, uint32_t g)
{
    struct step_state *s = &c->state[g];
    c->stats->chunks_total += s->expected;
    c->stats->chunks_lost += s->expected - s->received;
    s->closed = 1;
    c->credits_dirty = 1;
    if ((int32_t)g == c->schedule.finalize_after)
        finalize_owned_block(c);
}

void udt_close_all_steps(struct call *c)
{
    while (c->recv_step < c->schedule.steps) {
        struct step_state *s = &c->state[c->recv_step];
        if (s->expected && s->received < s->expected)
            s->announced && s->received >= s->announced ? c->stats->steps_ended++ : c->stats->steps_timed_out++;
        close_step(c, c->recv_step++);
    }
}

/* Since when the lowest open step g has had nothing: its last arrival, or when
 * it became the step we wait on (0: it is complete, or idle_close_us is 0). */
static uint64_t step_quiet_since(const struct call *c, uint32_t g)
{
    const struct step_state *s = &c->state[g];
    if (comm_of((struct call *)c)->options.idle_close_us == 0 || s->received >= s->expected)
        return 0;
    return s->last_arrival_ns > c->step_opened_ns ? s->last_arrival_ns : c->step_opened_ns;
}

/* When a step received every chunk its sender announced (0: not yet). */
static uint64_t announced_end_ns(const struct step_state *s)
{
    return s->announced && s->received >= s->announced ? s->last_arrival_ns : 0;
}

/* The lowest open step has waited long enough to ask its sender whether it is
 * done with it: past its share of the deadline, or idle_close_us without an
 * arrival (a burst may have taken the step's last chunks and every copy of its
 * END marker: asking at the share alone left such a step waiting D / steps, a
 * second and more). Neither closes the step. Silence is no evidence that a sender is done:
 * its END markers may all be lost, but it may as well be busy with other peers
 * (direct: it serves them in turn; a late rank's senders have others' data
 * queued first), descheduled on a loaded machine, or stopped in a debugger. Its
 * answer (a JOIN reply saying how far its sending to us has come) closes the
 * step once it is done; one still sending is asked again (1 to 16 ms apart
 * while it answers); a silent one is waited for until the call's deadline.
 * Closing on silence read a busy sender as a lost step and dropped the rest of
 * its block as stale when it came: at its share, 8 ranks on a bridge with no
 * loss injected lost whole blocks in 15 of 30 calls; after a quiet gap, a sender
 * paused mid-step lost the rest of its block (4 ranks on a bridge, with a credit
 * policy that made senders pause more: 22 datagrams dropped on the wire became
 * 6,812 chunks lost; tests/test_busy_sender.py stops a sender for 0.5 s). */
static uint64_t ask_due_ns(const struct call *c, const struct udt_comm *comm)
{
    if (c->recv_step >= c->schedule.steps)
        return UINT64_MAX;
    uint32_t g = c->recv_step;
    int32_t p = c->step[g].recv_peer;
    if (p == UDT_NO_PEER || c->state[g].expected == 0 || comm->peers[p].reported_sent > g || comm->peers[p].finished)
        return UINT64_MAX;
    uint64_t due = c->all_heard_ns ? c->step_deadline_ns : UINT64_MAX;
    uint64_t quiet_since = step_quiet_since(c, g);
    if (quiet_since && quiet_since + us(comm->options.idle_close_us) < due)
        due = quiet_since + us(comm->options.idle_close_us);
    return due;
}

static int sender_to_ask(const struct call *c, const struct udt_comm *comm, uint64_t now) { return now >= ask_due_ns(c, comm); }

static int ask_waited_sender(struct call *c, struct udt_comm *comm, uint64_t now)
{
    return sender_to_ask(c, comm, now) ? request_join(c, comm, (uint32_t)c->step[c->recv_step].recv_peer, now) : 0;
}

/* When the sender of step g said, in a JOIN, that it sends nothing more of it (0: it did not). */
static uint64_t reported_end_ns(const struct call *c, const struct peer_state *peer, uint32_t g)
{
    return peer->reported_sent > g ? peer->reported_at_ns : 0;
}

/* Close the lowest open receive steps that are complete, ended (END marker,
 * verdict or announced count), answered (the sender's reply to a JOIN says it
 * sends nothing more of the step) or superseded. The call's deadline closes
 * the rest (udt_close_all_steps). */
static int close_ready_steps(struct call *c, uint64_t now)
{
    struct udt_comm *comm = comm_of(c);
    const struct udt_engine_options *o = &comm->options;
    int closed = 0;
    while (c->recv_step < c->schedule.steps) {
        uint32_t g = c->recv_step;
        struct step_state *s = &c->state[g];
        int32_t p = c->step[g].recv_peer;
        int empty = p == UDT_NO_PEER || s->expected == 0;
        int complete = s->received >= s->expected;
        struct peer_state *peer = empty ? NULL : &comm->peers[p];
        /* a relay that announced fewer chunks than the block has ends like an END marker:
         * after the reorder grace, in which a larger announcement (the real one) may come */
        uint64_t announced_at = announced_end_ns(s), reported_at = empty ? 0 : reported_end_ns(c, peer, g);
        int ended = !empty && ((s->end_seen_ns && now - s->end_seen_ns >= us(o->reorder_grace_us)) ||
                               (announced_at && now - announced_at >= us(o->reorder_grace_us)) ||
                               (peer->finished && now - peer->finished_at_ns >= us(o->reorder_grace_us)));
        int answered = reported_at && now - reported_at >= us(o->reorder_grace_us);
        /* the sender already sends us a later step: all of this one that will come, came */
        int superseded = !empty && peer->highest_step_seen > g + 1;
        if (!empty && !complete && !ended && !answered && !superseded)
            break;
        if (!empty && !complete)
            ended ? c->stats->steps_ended++ : answered ? c->stats->steps_answered++ : c->stats->steps_superseded++;
        close_step(c, g);
        c->recv_step++;
        set_step_deadline(c, now);
        closed = 1;
    }
    return closed;
}

/* ---- results --------------------------------------------------------------- */

uint64_t udt_fresh_elements(const struct call *c)
{
    if (!gathers(c))
        return c->args.count;
    uint64_t fresh = 0;
    for (uint32_t block = 0; block < c->n; block++) {
        if (c->schedule.facts->holds_own_block && block == c->schedule.owned_block) {
            fresh += c->block_first[block + 1] - c->block_first[block];
            continue;
        }
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++)
            if (c->final_count[c->chunk_base[block] + chunk])
                fresh += chunk_length(c, block, chunk);
    }
    return fresh;
}

uint64_t udt_reduce_weighted(const struct call *c)
{
    if (!reduces(c))
        return 0;
    uint32_t block = c->schedule.owned_block;
    uint64_t weighted = 0;
    for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++)
        weighted += (uint64_t)c->rs_count[c->chunk_base[block] + chunk] * chunk_length(c, block, chunk);
    return weighted;
}

/* allreduce, per chunk: the owner's estimate if it reached us; otherwise our
 * own reduce-scatter partial, rescaled (unbiased) or zero (baseline). */
static double allreduce_factor(const struct call *c, uint64_t id, uint16_t *contributions)
{
    double mean = c->args.op == UDT_OP_MEAN ? 1.0 / c->n : 1.0;
    if (c->final_count[id]) {
        *contributions = c->final_count[id];
        return mean;
    }
    if (c->args.estimator == UDT_ESTIMATOR_ZERO_FILL) {
        *contributions = 0;
        return 0.0;
    }
    *contributions = c->rs_count[id];
    return mean * c->n / c->rs_count[id];
}

static double delivered_fraction(const struct call *c)
{
    if (c->args.count == 0)
        return 1.0;
    switch (c->schedule.facts->output) {
    case UDT_OUTPUT_REDUCED_SHARD: {
        uint64_t length = c->block_first[c->rank + 1] - c->block_first[c->rank];
        return length ? (double)udt_reduce_weighted(c) / ((double)c->n * (double)length) : 1.0;
    }
    case UDT_OUTPUT_GATHERED:
        return (double)udt_fresh_elements(c) / (double)c->args.count;
    case UDT_OUTPUT_REDUCED:
        break;
    default:
        return 1.0;
    }
    double delivered = 0;
    for (uint32_t block = 0; block < c->n; block++) {
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint16_t contributions;
            allreduce_factor(c, c->chunk_base[block] + chunk, &contributions);
            delivered += (double)contributions * (double)chunk_length(c, block, chunk);
        }
    }
    return delivered / ((double)c->n * (double)c->args.count);
}

/* The output is written in runs: neighbouring chunks that take the same action and
 * factor go out in one call. Chunk by chunk, an MTU-sized chunk (1.4 KB) made the
 * tensor-sized copy 2.4x slower than one large copy (64 MiB: 12.5-13 ms against
 * 5.1-6.1 ms on the build machine), and it is on every call's critical path. */
enum write_kind { WRITE_NONE, WRITE_STORE, WRITE_RESCALE, WRITE_MOVE }; /* NONE: no run open */

struct write_run {
    enum write_kind kind;
    double factor;
    uint8_t *out;       /* first output byte */
    const uint8_t *src; /* first source byte (accum for STORE, input for MOVE) */
    uint64_t elements;
};

static void flush_run(const struct call *c, struct write_run *r)
{
    switch (r->kind) {
    case WRITE_STORE:
        if (r->src == r->out && r->factor == 1.0)
            break; /* in place: the value is where it belongs */
        udt_store(c->args.dtype, r->out, r->src, r->elements, r->factor);
        break;
    case WRITE_RESCALE:
        udt_rescale_wire(c->args.dtype, r->out, r->elements, r->factor);
        break;
    case WRITE_MOVE:
        memmove(r->out, r->src, r->elements * c->wire_bytes);
        break;
    default:
        break;
    }
    r->kind = WRITE_NONE;
    r->elements = 0;
}

/* Add `elements` starting at output byte `out` (source `src`) to the run, or flush the
 * run and start a new one when the action, the factor or either address does not follow on. */
static void write_chunk(const struct call *c, struct write_run *r, enum write_kind kind, double factor, uint8_t *out,
                        const uint8_t *src, uint64_t elements)
{
    size_t src_bytes = kind == WRITE_STORE ? c->accum_bytes : c->wire_bytes;
    if (r->kind == kind && r->factor == factor && r->out + r->elements * c->wire_bytes == out &&
        (kind == WRITE_RESCALE || r->src + r->elements * src_bytes == src)) {
        r->elements += elements;
        return;
    }
    flush_run(c, r);
    *r = (struct write_run){.kind = kind, .factor = factor, .out = out, .src = src, .elements = elements};
}

static void write_allreduce(struct call *c)
{
    uint8_t *out = c->args.output;
    struct write_run run = {0};
    for (uint32_t block = 0; block < c->n; block++) {
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint16_t contributions;
            uint64_t id = c->chunk_base[block] + chunk;
            double factor = allreduce_factor(c, id, &contributions);
            uint64_t first = chunk_first_element(c, block, chunk), elements = chunk_length(c, block, chunk);
            if (c->chunk_flags[id] & SCRATCH_VALID)
                write_chunk(c, &run, WRITE_STORE, factor, out + first * c->wire_bytes, c->accum + first * c->accum_bytes,
                            elements);
            else /* a hole where nothing ever arrived: our own input, rescaled in place */
                write_chunk(c, &run, WRITE_RESCALE, factor, out + first * c->wire_bytes, NULL, elements);
        }
    }
    flush_run(c, &run);
}

/* Gathered outputs: fresh chunks take the new value, stale ones keep theirs. */
static void write_gathered(struct call *c)
{
    uint8_t *out = c->args.output;
    struct write_run run = {0};
    for (uint32_t block = 0; block < c->n; block++) {
        int own_input = c->schedule.facts->holds_own_block && block == c->schedule.owned_block;
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint64_t id = c->chunk_base[block] + chunk;
            uint64_t first = chunk_first_element(c, block, chunk), elements = chunk_length(c, block, chunk);
            uint8_t *target = out + first * c->wire_bytes;
            int in_scratch = (c->chunk_flags[id] & SCRATCH_VALID) && !own_input;
            if (own_input || (!in_scratch && c->final_count[id] && input_at(c, first) != target))
                write_chunk(c, &run, WRITE_MOVE, 1.0, target, input_at(c, first), elements);
            else if (in_scratch && c->final_count[id] && !c->direct_output) /* direct: it is there already */
                write_chunk(c, &run, WRITE_STORE, 1.0, target, c->accum + first * c->accum_bytes, elements);
            else
                flush_run(c, &run); /* the chunk keeps what the output holds */
        }
    }
    flush_run(c, &run);
}

uint64_t udt_chunk_mask_bytes(int collective, int algorithm, uint64_t count, int dtype, uint32_t rank, uint32_t world_size,
                              uint32_t chunk_bytes)
{
    if (dtype < 0 || dtype >= UDT_DTYPE_COUNT)
        return 0;
    uint32_t element_bytes = (uint32_t)udt_wire_elem_bytes(dtype);
    uint64_t chunk_elements = element_bytes ? chunk_bytes / element_bytes : 0;
    if (!chunk_elements || !world_size || rank >= world_size)
        return 0;
    const struct udt_collective_facts *facts = udt_collective_facts(collective);
    if (!facts || !facts->moves_data || (facts->equal_blocks && count % world_size))
        return 0;
    /* a ring's partial sums mix senders: only a piece that comes alone names its sender */
    if (facts->mask_by_sender)
        return algorithm == UDT_ALGORITHM_DIRECT || world_size <= 2
                   ? (uint64_t)world_size * udt_chunks_for(udt_block_length(count, world_size, rank), chunk_elements) : 0;
    {
        uint64_t total = 0;
        for (uint32_t b = 0; b < world_size; b++)
            total += udt_chunks_for(udt_block_length(count, world_size, b), chunk_elements);
        return total;
    }
    return 0;
}

/* The caller's chunk mask (see udt_collective_args): whose contributions reached this
 * rank's shard, or which chunks of the output are fresh. */
static void write_chunk_mask(struct call *c)
{
    uint8_t *mask = c->args.chunk_mask;
    if (!c->schedule.facts->mask_by_sender) {
        for (uint64_t id = 0; id < c->chunk_base[c->n]; id++)
            mask[id] = c->final_count[id] != 0;
        return;
    }
    uint32_t block = c->schedule.owned_block, chunks = chunks_in_block(c, block);
    memset(mask, 0, (size_t)c->n * chunks);
    memset(mask + (size_t)c->rank * chunks, 1, chunks); /* our own contribution is always in */
    for (uint32_t s = 0; s < c->schedule.steps; s++) {
        const struct udt_step *step = &c->step[s];
        if (step->recv_peer == UDT_NO_PEER || step->recv_mode != UDT_RECV_REDUCE || step->recv_block != block)
            continue;
        const uint8_t *bits = c->arrival_bits + (size_t)s * c->bitmap_bytes;
        for (uint32_t k = 0; k < chunks; k++)
            mask[(size_t)step->recv_peer * chunks + k] = (bits[k / 8] >> (k % 8)) & 1u;
    }
}

/* In place, a call that fails leaves the tensor as it found it: every chunk saved is put back
 * (a saved chunk may not have changed; putting it back is then harmless). */
static void restore_originals(struct call *c)
{
    if (!c->in_place)
        return;
    for (uint32_t block = 0; block < c->n; block++)
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint64_t id = c->chunk_base[block] + chunk;
            if (!(c->chunk_flags[id] & ORIGINAL_SAVED))
                continue;
            uint64_t first = chunk_first_element(c, block, chunk);
            memcpy(c->accum + first * c->wire_bytes, c->saved + first * c->wire_bytes,
                   chunk_length(c, block, chunk) * c->wire_bytes);
            c->chunk_flags[id] &= (uint8_t)~ORIGINAL_SAVED;
        }
    c->in_place = 0;
}

int udt_write_output(struct call *c)
{
    if (c->args.chunk_mask)
        write_chunk_mask(c);
    c->stats->chunks_stale = 0;
    if (gathers(c))
        for (uint64_t id = 0; id < c->chunk_base[c->n]; id++)
            c->stats->chunks_stale += c->final_count[id] == 0;
    switch (c->schedule.facts->output) {
    case UDT_OUTPUT_REDUCED:
        write_allreduce(c);
        break;
    case UDT_OUTPUT_REDUCED_SHARD: {
        uint32_t block = c->schedule.owned_block;
        double mean = c->args.op == UDT_OP_MEAN ? 1.0 / c->n : 1.0;
        uint64_t first = c->block_first[block], length = c->block_first[block + 1] - first;
        if (length)
            udt_store(c->args.dtype, c->args.output, c->accum + first * c->accum_bytes, length, mean);
        break;
    }
    case UDT_OUTPUT_GATHERED:
        write_gathered(c);
        break;
    default:
        break;
    }
    return UDT_OK;
}

/* ---- the call ----------------------------------------------------------- */

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
    c->wire_bytes = udt_wire_elem_bytes(a->dtype);
    c->accum_bytes = udt_accum_elem_bytes(a->dtype);
    c->chunk_elements = comm->options.chunk_bytes / c->wire_bytes; /* at least 1 (refusal) */
    c->chunk_base = comm->geometry;
    c->block_first = comm->geometry + n + 1;
    uint64_t max_chunks = 0;
    c->chunk_base[0] = 0;
    for (uint32_t b = 0; b <= n; b++)
        c->block_first[b] = udt_block_start(a->count, n, b);
    for (uint32_t b = 0; b < n; b++) {
        uint64_t chunks = udt_chunks_for(udt_block_length(a->count, n, b), c->chunk_elements);
        c->chunk_base[b + 1] = c->chunk_base[b] + chunks;
        if (chunks > max_chunks)
            max_chunks = chunks;
    }
    uint32_t rotation = c->schedule.facts->rotates ? c->sequence % n : 0;
    uint32_t steps = udt_schedule_steps(a->collective, a->algorithm, n);
    c->max_chunks = (uint32_t)max_chunks;
    uint64_t total_chunks = c->chunk_base[n];

    c->bitmap_bytes = (max_chunks + 7) / 8;
    size_t step_bytes = (size_t)steps * (sizeof(struct udt_step) + sizeof(struct step_state) + c->bitmap_bytes);
    size_t state_bytes = (size_t)total_chunks * (2 * sizeof(uint16_t) + 1);
    if (grow((void **)&comm->scratch, &comm->scratch_bytes, (size_t)a->count * c->accum_bytes) ||
        grow((void **)&comm->chunk_state, &comm->chunk_state_bytes, state_bytes) ||
        grow((void **)&comm->step_memory, &comm->step_memory_bytes, step_bytes))
        return fail(comm, UDT_ERR_NO_MEMORY, "out of memory for the call's buffers");
    c->step = (struct udt_step *)comm->step_memory;
    c->state = (struct step_state *)(c->step + steps);
    c->arrival_bits = (uint8_t *)(c->state + steps);
    if (udt_schedule_build(a->collective, a->algorithm, c->rank, n, a->root, rotation, &c->schedule, c->step, comm->block_scratch) != 0 ||
        c->schedule.steps != steps)
        return fail(comm, UDT_ERR_INVALID_ARGUMENT, "no schedule for this collective and algorithm");
    memset(c->state, 0, (size_t)steps * sizeof(struct step_state));
    memset(c->arrival_bits, 0, (size_t)steps * c->bitmap_bytes);
    uint32_t receives_after = 0, *sent_later = comm->block_scratch;
    memset(sent_later, 0, n * sizeof *sent_later);
    for (uint32_t g = steps; g-- > 0;) {
        c->state[g].receives_after = receives_after;
        if (c->step[g].recv_peer != UDT_NO_PEER) {
            c->state[g].expected = chunks_in_block(c, c->step[g].recv_block);
            c->state[g].relayed = !sends_input(c) && sent_later[c->step[g].recv_block] != 0;
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
    c->in_place = c->schedule.facts->may_sum_in_place && a->input == a->output && n > 1 && c->accum_bytes == c->wire_bytes &&
                  a->count * c->wire_bytes >= comm->options.in_place_min_bytes;
    c->stats->in_place = c->in_place;
    c->direct_output = a->direct_output && gathers(c) && !reduces(c) && c->accum_bytes == c->wire_bytes;
    c->accum = c->in_place || c->direct_output ? (uint8_t *)a->output : comm->scratch;
    c->final_uncached = (c->in_place || c->direct_output) && a->count * c->wire_bytes >= comm->options.in_place_min_bytes;
    c->saved = comm->scratch;
    c->rs_count = (uint16_t *)comm->chunk_state;
    c->final_count = c->rs_count + total_chunks;
    c->chunk_flags = (uint8_t *)(c->final_count + total_chunks);
    for (uint64_t i = 0; i < total_chunks; i++)
        c->rs_count[i] = 1;
    memset(c->final_count, 0, total_chunks * sizeof(uint16_t));
    memset(c->chunk_flags, 0, total_chunks);
    /* what this rank holds fresh before anything arrives: all_gather's own
     * shard, everything at a broadcast's root */
    uint32_t own = c->schedule.owned_block;
    if (c->schedule.facts->holds_own_block)
        for (uint64_t id = c->chunk_base[own]; id < c->chunk_base[own + 1]; id++)
            c->final_count[id] = 1;
    if (c->schedule.facts->root_holds_all && c->rank == a->root)
        for (uint64_t id = 0; id < total_chunks; id++)
            c->final_count[id] = 1;

    if (c->schedule.finalize_after == UDT_NO_STEP)
        finalize_owned_block(c); /* a world of one: our block is final as it is */
    uint32_t window = comm->options.window_bytes / comm->options.chunk_bytes;
    c->window_chunks = window < 16 ? 16 : window;
    c->copies = c->args.copies ? c->args.copies : 1;
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
    uint64_t input_count = facts->input_is_shard ? shard : a->count;
    uint64_t output_count = facts->output_is_shard ? shard : a->count;
    if (facts->moves_data && input_count && !a->input)
        return "input: missing";
    if (facts->moves_data && output_count && !a->output)
        return "output: missing";
    /* equal blocks, so that what rank r sends rank q is as long as q's block for it */
    if (facts->equal_blocks && a->count % comm->world_size)
        return "count: must divide by the world size";
    if (facts->sends_input && a->direct_output) {
        /* written as it arrives, the output must not be the input later steps still send from */
        uint64_t bytes = a->count * (uint64_t)udt_wire_elem_bytes(a->dtype);
        const uint8_t *in = a->input, *out = a->output;
        if (bytes && in < out + bytes && out < in + bytes)
            return "output: overlaps the input (direct_output)";
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
    if (a->chunk_mask) {
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
    c->mismatched_rank = -1;
    c->start_ns = now;
    /* until every rank is known to be in the call, only the join timeout runs */
    set_deadlines(c, now, comm->options.join_timeout_ms * 1e-3);
    mark_quotes(comm);
    c->drops_before = comm->transport->counter_injected_drops;
    c->overflows_before = comm->transport->counter_receive_overflows;
    c->send_calls_before = comm->transport->counter_send_calls;
    c->receive_calls_before = comm->transport->counter_receive_calls;
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        peer->credit_limit = 0;
        peer->credit_ceiling = 0;
        peer->chunks_queued = 0;
        peer->credit_base = 0;
        peer->heard = (peer->early_credit_valid && peer->early_credit_sequence == c->sequence) ||
                      (peer->early_join_valid && peer->early_join_sequence == c->sequence);
        peer->early_join_valid = 0;
        peer->last_heard_ns = peer->heard ? now : 0;
        peer->join_requests = 0;
        peer->join_request_ns = now + join_request_interval(comm, 0); /* data and credits may show it first */
        c->heard_count += peer->heard && p != c->rank;
        peer->granted = 0;
        peer->granted_at_ns = 0;
        peer->arrived_since_grant = 0;
        peer->highest_step_seen = 0;
        peer->sent_steps = 0;
        peer->reported_sent = 0;
        peer->reported_at_ns = 0;
        peer->finished = 0;
        peer->port_closed = 0;
        peer->verdict_attempts = 0;
        peer->acks_asked = 0;
        peer->verdict_resend_ns = 0;
    }
    int rc = prepare(comm, c);
    if (rc != UDT_OK)
        return rc;
    for (uint32_t g = 0; g < c->schedule.steps; g++)
        if (c->step[g].send_peer != UDT_NO_PEER)
            comm->peers[c->step[g].send_peer].credit_ceiling = g * c->max_chunks + chunks_in_block(c, c->step[g].send_block);
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (!peer->early_credit_valid || peer->early_credit_sequence != c->sequence)
            continue;
        peer->early_credit_valid = 0;
        if (peer->early_credit_layout == c->layout_tag && peer->early_credit <= peer->credit_ceiling)
            peer->credit_limit = peer->early_credit;
        else
            stats->dropped_invalid++; /* checked now that the call's schedule is known */
    }
    c->phase = PHASE_DATA;
    if (c->n == 1) {
        c->phase = PHASE_DONE; /* nothing to exchange, nobody to disagree with */
        c->decided = 1;
        c->status = UDT_OK;
        return UDT_OK;
    }
    udt_verdict_begin_peers(c, comm, now);
    if (c->heard_count == c->n - 1 && !c->all_heard_ns) { /* everyone spoke before we started */
        c->all_heard_ns = now;
        set_deadlines(c, now, c->args.deadline_s);
    }
    c->join_request_due_ns = now + join_request_interval(comm, 0);
    if (c->args.count == 0) /* no data to move; the verdict round still checks everyone called alike */
        c->recv_step = c->send_step = c->schedule.steps;
    set_step_deadline(c, now);
    rc = grant_credits(c, now, 1);
    if (rc < 0) {
        c->phase = PHASE_IDLE;
        comm->error = comm->transport->error;
        return UDT_ERR_TRANSPORT;
    }
    return UDT_OK;
}

/* Earliest time something is due in the data phase. */
static uint64_t data_wake(const struct call *c, const struct udt_comm *comm, uint64_t now)
{
    uint64_t wake = c->deadline_ns;
    if (!c->all_heard_ns && c->join_request_due_ns < wake)
        wake = c->join_request_due_ns;
    if (c->recv_step >= c->schedule.steps)
        return wake;
    const struct step_state *s = &c->state[c->recv_step];
    int32_t p = c->step[c->recv_step].recv_peer;
    /* one rule, one place: the sleep and the asking use the same due time */
    uint64_t ask_due = ask_due_ns(c, comm);
    uint64_t due = now >= ask_due ? comm->peers[p].join_request_ns : ask_due;
    if (due < wake)
        wake = due;
    /* A credit goes out no sooner than the next walk (grant_credits waits a refresh interval
     * between walks unless an arrival moved something, which wakes us anyway). A sender the
     * last walk left without credit (the window went to earlier steps) has an old or no grant
     * time: counting from that alone put the wake in the past, and the loop spun until the
     * earlier step closed (a 16-chunk window, 4 ranks, direct: 100,000+ empty passes a call). */
    for (uint32_t g = c->recv_step; g < c->schedule.steps && g < c->recv_step + CREDIT_LOOKAHEAD_STEPS; g++) {
        int32_t q = c->step[g].recv_peer;
        if (q == UDT_NO_PEER || c->state[g].closed)
            continue;
        uint64_t since = comm->peers[q].granted_at_ns > c->credits_walked_ns ? comm->peers[q].granted_at_ns : c->credits_walked_ns;
        uint64_t refresh = since + us(comm->options.credit_refresh_us);
        if (refresh < wake)
            wake = refresh;
    }
    uint64_t grace = us(comm->options.reorder_grace_us);
    if (s->end_seen_ns && s->end_seen_ns + grace < wake)
        wake = s->end_seen_ns + grace;
    if (announced_end_ns(s) && announced_end_ns(s) + grace < wake)
        wake = announced_end_ns(s) + grace;
    if (p != UDT_NO_PEER && comm->peers[p].finished && comm->peers[p].finished_at_ns + grace < wake)
        wake = comm->peers[p].finished_at_ns + grace;
    uint64_t reported_at = p != UDT_NO_PEER ? reported_end_ns(c, &comm->peers[p], c->recv_step) : 0;
    if (reported_at && reported_at + grace < wake)
        wake = reported_at + grace;
    return wake;
}

/* ---- evidence of a closed port ------------------------------------------- */

/* Tell the transport what our datagrams carry (the session id, which no stranger knows), so
 * that an ICMP message quoting a datagram without it is dropped, not counted (transport.h). */
static void mark_quotes(struct udt_comm *comm)
{
    struct udt_peer_ports *ports = comm->transport->ports;
    if (!ports || ports->quote_bytes)
        return;
    ports->quote_offset = 8; /* udt_wire_encode: the session id */
    udt_put64(ports->quote, comm->session_id);
    ports->quote_bytes = 8;
}

void udt_note_port_closed(struct call *c, struct udt_comm *comm, uint32_t peer)
{
    if (peer >= c->n || peer == c->rank || comm->peers[peer].port_closed)
        return;
    comm->peers[peer].port_closed = 1;
    c->ports_closed++;
}

/* An ICMP port unreachable quoting one of our datagrams to a peer says its socket was closed
 * when the datagram got there. Evidence, not a verdict, and for this call only: a port briefly
 * closed (a NAT or firewall reset), or a bounce of the call before, is forgotten when the peer
 * speaks again, and a peer whose verdict we hold has only left. Otherwise what it owed us will
 * not come: the data phase ends and our verdict names it (CAUSE_PORT_CLOSED), so every rank
 * fails the call with the same cause, and peers holding that verdict stop waiting for the
 * closed port's own (udt_verdict_progress). The forged ICMP of issue 38 no longer reaches
 * here: it cannot quote our session id. */
static void notice_bounces(struct call *c, struct udt_comm *comm, uint64_t now)
{
    const struct udt_peer_ports *ports = comm->transport->ports;
    if (!ports || ports->bounce_count == comm->bounces_seen)
        return;
    comm->bounces_seen = ports->bounce_count;
    uint32_t n = ports->peer_count < comm->world_size ? ports->peer_count : comm->world_size;
    for (uint32_t p = 0; p < n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (ports->bounces[p] == peer->bounces_seen || p == comm->rank)
            continue;
        peer->bounces_seen = ports->bounces[p];
        peer->bounced_ns = now;
        if (peer->alive_ns < now && !(peer->slot[c->sequence & 1].sequence == c->sequence &&
                                      (peer->slot[c->sequence & 1].flags & VERDICT_GOT)))
            udt_note_port_closed(c, comm, p);
    }
}

int udt_call_progress(struct udt_comm *comm, uint64_t now, uint64_t *wake_ns)
{
    struct call *c = &comm->call;
    if (c->phase == PHASE_DONE || c->phase == PHASE_IDLE)
        return 2;
    int progressed = 0, rc;
    notice_bounces(c, comm, now);
    if (c->phase == PHASE_DATA) {
        /* a closed port sends nothing more, and a call that will fail needs nothing more (a
         * peer's verdict carries a cause, or a peer called with another layout: its data and ours
         * do not fit, as its JOIN or data showed): the verdict round then settles the cause, which
         * the layout tags every verdict carries name alike everywhere */
        if (now >= c->deadline_ns || c->ports_closed || c->doomed || c->mismatched_rank >= 0) {
            /* whatever has not arrived is lost; close the rest in order so
             * the owned block is still rescaled; abandon unsent data */
            c->stats->deadline_expired = now >= c->deadline_ns;
            udt_close_all_steps(c);
            c->send_step = c->schedule.steps;
            for (uint32_t p = 0; p < c->n; p++) /* what was not sent never will be: a JOIN says so */
                comm->peers[p].sent_steps = c->schedule.steps;
        }
        progressed |= close_ready_steps(c, now);
        if ((rc = send_some(c)) < 0)
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
    for (int batches = 0; got > 0 && batches < LATE_DRAIN_BATCHES && now >= c->hard_deadline_ns && !c->decided; batches++)
        if ((got = receive_some(c, comm, now)) < 0)
            return got;
    if (c->phase == PHASE_DATA) {
        progressed |= close_ready_steps(c, now);
        if (c->recv_step < c->schedule.steps ? (rc = grant_credits(c, now, 0)) < 0 : (rc = regrant(c, now)) < 0)
            return rc;
        if (c->recv_step >= c->schedule.steps && c->send_step >= c->schedule.steps) {
            udt_verdict_begin(c, comm, now);
            progressed = 1;
        }
    }
    if (c->phase == PHASE_DATA) {
        if ((rc = request_joins(c, comm, now)) < 0 || (rc = ask_waited_sender(c, comm, now)) < 0)
            return rc;
        progressed |= rc;
    }
    uint64_t wake = c->phase == PHASE_DATA ? data_wake(c, comm, now) : c->hard_deadline_ns;
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
    st->mismatched_rank = c->mismatched_rank;
    st->elapsed_s = (double)(now - c->start_ns) * 1e-9;
    if (c->phase != PHASE_DONE) {
        c->phase = PHASE_IDLE;
        restore_originals(c);
        return fail(comm, UDT_ERR_TRANSPORT, "call abandoned before its verdict");
    }
    c->phase = PHASE_IDLE;
    if (c->n > 1)
        st->delivered_fraction = delivered_fraction(c);
    int status = udt_collective_verdict(comm);
    if (status == UDT_OK && veto != UDT_OK) {
        status = veto;
        st->stripes_vetoed = 1;
    }
    if (status == UDT_OK)
        udt_write_output(c);
    else
        restore_originals(c);
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
    restore_originals(&comm->call);
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
    uint64_t spin_started_ns = 0;
    for (;;) {
        uint64_t wake = 0;
        if (cancel && __atomic_load_n(cancel, __ATOMIC_ACQUIRE))
            return abandon_call(comm, UDT_ERR_CANCELLED);
        if (__atomic_load_n(&comm->interrupted, __ATOMIC_ACQUIRE)) {
            fail(comm, UDT_ERR_INTERRUPTED, "the call was interrupted: its communicator is being closed");
            return abandon_call(comm, UDT_ERR_INTERRUPTED);
        }
        now = monotonic_ns();
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
         * datagram usually takes to come. */
        if (!spin_started_ns)
            spin_started_ns = now;
        if (now - spin_started_ns < us(comm->options.busy_poll_us))
            continue;
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

/* ---- the communicator ------------------------------------------------------ */

void udt_comm_interrupt(struct udt_comm *comm)
{
    __atomic_store_n(&comm->interrupted, 1, __ATOMIC_RELEASE);
}

struct udt_comm *udt_comm_create(struct udt_transport *transport, uint32_t rank, uint32_t world_size, uint64_t session_id,
                                 const struct udt_engine_options *options, struct udt_error *error)
{
    if (world_size == 0 || rank >= world_size || world_size >= UDT_NO_RANK) {
        udt_error_check(error, "rank %u is not in a world of %u", rank, world_size);
        return NULL;
    }
    if (world_size > UDT_MAX_WORLD) {
        udt_error_check(error, "world sizes above %d are not supported (got %u)", UDT_MAX_WORLD, world_size);
        return NULL;
    }
    uint32_t max_chunk = transport->max_datagram_bytes - UDT_WIRE_HEADER_BYTES;
    if (options->chunk_bytes == 0 || options->chunk_bytes > max_chunk) {
        udt_error_check(error, "chunk_bytes %u must be between 1 and %u (the transport's datagram size minus the %u-byte header)",
                 options->chunk_bytes, max_chunk, UDT_WIRE_HEADER_BYTES);
        return NULL;
    }
    struct udt_comm *comm = calloc(1, sizeof *comm);
    if (comm) {
        comm->staging = malloc((size_t)SEND_BATCH * options->chunk_bytes);
        comm->peers = calloc(world_size, sizeof *comm->peers);
        comm->geometry = calloc(2 * ((size_t)world_size + 1), sizeof *comm->geometry);
        comm->block_scratch = calloc(world_size, sizeof *comm->block_scratch);
    }
    if (!comm || !comm->staging || !comm->peers || !comm->geometry || !comm->block_scratch) {
        if (comm) {
            free(comm->staging);
            free(comm->peers);
            free(comm->geometry);
            free(comm->block_scratch);
            free(comm);
        }
        udt_error_check(error, "out of memory");
        return NULL;
    }
    comm->transport = transport;
    comm->rank = rank;
    comm->world_size = world_size;
    comm->session_id = session_id;
    comm->options = *options;
    if (options->end_repeats > UDT_MAX_END_REPEATS) {
        udt_error_check(error, "end_repeats %u must be at most %d", options->end_repeats, UDT_MAX_END_REPEATS);
        free(comm->staging);
        free(comm->peers);
        free(comm->geometry);
        free(comm->block_scratch);
        free(comm);
        return NULL;
    }
    if (comm->options.end_repeats == 0)
        comm->options.end_repeats = 1;
    if (comm->options.agree_resend_us == 0)
        comm->options.agree_resend_us = 1000;
    if (comm->options.join_timeout_ms == 0)
        comm->options.join_timeout_ms = 300000;
    return comm;
}

int udt_comm_set_peers(struct udt_comm *comm, const uint8_t *addresses, size_t length, uint32_t address_bytes)
{
    if (address_bytes == 0 || length != (size_t)address_bytes * comm->world_size) {
        udt_error_check(&comm->error, "set_peers: %zu bytes of addresses for %u ranks of %u bytes each (want %zu)",
                        length, comm->world_size, address_bytes, (size_t)address_bytes * comm->world_size);
        return -EINVAL;
    }
    int rc = udt_transport_set_peers(comm->transport, addresses, address_bytes, comm->world_size);
    if (rc < 0)
        comm->error = comm->transport->error;
    return rc;
}

void udt_comm_destroy(struct udt_comm *comm)
{
    if (!comm)
        return;
    udt_transport_destroy(comm->transport);
    free(comm->scratch);
    free(comm->chunk_state);
    free(comm->step_memory);
    free(comm->geometry);
    free(comm->block_scratch);
    free(comm->peers);
    free(comm->staging);
    free(comm);
}

const struct udt_error *udt_comm_error(const struct udt_comm *comm) { return &comm->error; }

int udt_comm_set_sequence(struct udt_comm *comm, uint32_t sequence)
{
    if (comm->call.phase != PHASE_IDLE)
        return -1;
    comm->sequence = sequence;
    return 0;
}
uint32_t udt_comm_chunk_bytes(const struct udt_comm *comm) { return comm->options.chunk_bytes; }
uint32_t udt_comm_sequence(const struct udt_comm *comm) { return comm->sequence; }
