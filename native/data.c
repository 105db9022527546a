/* The data phase: credits granted to senders, sending the schedule's blocks chunk by chunk,
 * and admitting the chunks, END markers and credits that arrive. Never retransmits. */
#include "engine_internal.h"

#include <string.h>

#include "blocks.h"
#include "elementwise.h"


/* a sender looks at most this many steps past its lowest unfinished one */
#define SEND_LOOKAHEAD_STEPS 64

/* A lost credit stalls its sender until the next refresh (credit_refresh_us); two
 * copies of a header-only datagram make that 1e-4 at 1% loss. Measured (loopback,
 * 2 ranks, 64 MiB, 1% real loss): p99 / p50 1.24-1.39 against 1.46-1.54 with one
 * copy in four alternating runs each, but later runs spread 1.23-1.54 either way.
 * Where loss has been rare for long, one (udt_credit_copies). */
#define CREDIT_COPIES 2

/* One past the last position step g sends: each of its chunks `copies` times. */
static uint32_t passes_end(const struct call *c, uint32_t g) { return send_chunks(c, c->step[g].send_block) * c->data.copies; }

static uint32_t arrivals_per_regrant(const struct call *c) { return c->data.window_chunks / 4 ? c->data.window_chunks / 4 : 1; }

/* A quarter window of data came from a peer since our last credit to it, and no
 * credit went out for it: the arrivals took room in our window without moving
 * the position we grant (copies of chunks we hold, args.copies; or the last
 * chunks of a step, which close it and leave nothing to grant while the sender
 * still has copies to send). The same position is credited again, which gives
 * the sender its window back (a credit covers a window beyond what it had sent). */
int udt_regrant(struct call *c, uint64_t now)
{
    struct udt_comm *comm = udt_comm_of(c);
    if (!c->data.regrant_due)
        return 0;
    c->data.regrant_due = 0;
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (p == c->rank || !peer->in_call.granted || peer->in_call.arrived_since_grant < arrivals_per_regrant(c))
            continue;
        struct udt_control credit = udt_control_of(c, UDT_KIND_CREDIT);
        credit.credit = peer->in_call.granted;
        credit.copies = udt_credit_copies(c, comm, CREDIT_COPIES);
        int rc = udt_send_control(c, p, &credit);
        if (rc < 0)
            return rc;
        if (rc == 0) { /* the socket is full: try again on the next pass */
            c->data.regrant_due = 1;
            c->data.credits_dirty = 1;
            continue;
        }
        peer->in_call.granted_at_ns = now;
        peer->in_call.arrived_since_grant = 0;
    }
    return 0;
}

/* Only in calls with copies (every rank passes the same): without them a sender is done
 * with a step once its positions are, and needs no credit back for it. */
static void count_arrival(struct call *c, struct udt_comm *comm, uint32_t peer)
{
    struct peer_state *p = &comm->peers[peer];
    if (c->data.copies > 1 && ++p->in_call.arrived_since_grant >= arrivals_per_regrant(c) && p->in_call.granted) {
        c->data.regrant_due = 1;
        c->data.credits_dirty = 1;
    }
}

/* A grown credit goes out once it grew by half a sender's share of the window (or on the refresh
 * timer). Bigger grants fill a sender's send batches: at 4 ranks on a bridge, MTU 1500, 64 MiB,
 * 22.7 datagrams per sendmmsg against 19.5 with a quarter, 15% fewer send calls (stats.send_calls;
 * measured in docs/performance/wire_measurements.md, "The credit window"). The window bounds what
 * is in flight either way. */
#define CREDIT_GROWTH_DIVISOR 2

/* Past this many windows still to come from the senders' next steps, the earliest step takes the
 * whole window (a stream, in full send batches, one sender at a time); at or below it the window
 * is split among the senders (sender_share). */
#define SHARED_WINDOWS 4

/* The share of the window each sender with an open step gets in a short exchange: the window
 * split evenly among them (at least the engine's floor of 16 chunks), so that every sender a rank
 * waits on can send at once, and one that waits for a core (8 ranks on 2 cores) holds back only
 * its own share. Until 2026-12-01 the earliest step always took the whole window, and on a gather,
 * an all_to_all or a 1 MiB allreduce at 8 ranks the later senders waited for the earlier ones'
 * pieces. A long exchange keeps that (the whole window): split there, each sender's credit grew by
 * a few chunks at a time and a 16 MiB allreduce at 8 ranks took 1.3 times as long. */
static uint32_t sender_share(const struct call *c, uint32_t epoch, struct udt_comm *comm)
{
    uint32_t senders = 0, looked = 0;
    uint64_t to_come = 0; /* chunks of each sender's next open step */
    for (uint32_t g = c->data.recv_step; g < c->schedule.steps && looked < CREDIT_LOOKAHEAD_STEPS; g++) {
        const struct step_state *s = &c->state[g];
        int32_t p = c->step[g].recv_peer;
        if (p == UDT_NO_PEER || s->closed)
            continue;
        looked++;
        struct peer_state *peer = &comm->peers[p];
        if (s->expected > s->seen_end && peer->wanted_epoch != epoch) {
            peer->wanted_epoch = epoch; /* counted; the walk stamps it again with the next epoch */
            senders++;
            to_come += s->expected - s->seen_end;
        }
    }
    if (senders <= 1 || to_come > (uint64_t)SHARED_WINDOWS * c->data.window_chunks)
        return c->data.window_chunks;
    uint32_t share = c->data.window_chunks / senders;
    return share < 16 ? 16 : share;
}

/* Of receive step g's chunks not yet seen, how many its sender already holds credit for. */
static uint32_t credit_held(const struct call *c, const struct peer_state *peer, uint32_t g)
{
    const struct step_state *s = &c->state[g];
    uint32_t from = g * c->geometry.max_chunks + s->seen_end, room = s->expected - s->seen_end;
    uint32_t held = peer->in_call.granted > from ? peer->in_call.granted - from : 0;
    return held < room ? held : room;
}

/* The window less what senders already hold of the open steps the walk looks at: a credit cannot
 * be taken back, so what is out counts against the window whatever the walk would give now (a
 * share shrinks as a long exchange becomes a short one). */
static uint32_t window_left(const struct call *c, struct udt_comm *comm)
{
    uint64_t held = 0;
    uint32_t looked = 0;
    for (uint32_t g = c->data.recv_step; g < c->schedule.steps && looked < CREDIT_LOOKAHEAD_STEPS; g++) {
        int32_t p = c->step[g].recv_peer;
        if (p == UDT_NO_PEER || c->state[g].closed)
            continue;
        looked++;
        held += credit_held(c, &comm->peers[p], g);
    }
    return held < c->data.window_chunks ? c->data.window_chunks - (uint32_t)held : 0;
}

/* Credits: walk the open receive steps in order and hand out the window,
 * step by step, to whoever sends each of them, each sender at most its
 * share (over all its steps). A sender's credit is a position
 * (step * max_chunks + chunk) it may not reach. */
int udt_grant_credits(struct call *c, uint64_t now, int force)
{
    struct udt_comm *comm = udt_comm_of(c);
    uint64_t refresh = udt_us(comm->options.credit_refresh_us);
    if (!force && !c->data.credits_dirty && now < c->data.credits_walked_ns + refresh)
        return 0; /* nothing moved and no refresh is due */
    c->data.credits_walked_ns = now;
    c->data.credits_dirty = 0;
    uint32_t share = sender_share(c, ++comm->credit_epoch, comm);
    comm->credit_epoch++;
    int32_t touched[CREDIT_LOOKAHEAD_STEPS];
    int touched_count = 0;
    uint32_t budget = window_left(c, comm); /* for credit beyond what senders hold */
    uint32_t looked = 0;
    for (uint32_t g = c->data.recv_step; g < c->schedule.steps && looked < CREDIT_LOOKAHEAD_STEPS; g++) {
        struct step_state *s = &c->state[g];
        int32_t p = c->step[g].recv_peer;
        if (p == UDT_NO_PEER || s->closed)
            continue;
        looked++;
        struct peer_state *peer = &comm->peers[p];
        int first = peer->wanted_epoch != comm->credit_epoch; /* first step of this sender in this walk */
        uint32_t taken = first ? 0 : peer->taken;
        uint32_t room = s->expected - s->seen_end;
        uint32_t held = credit_held(c, peer, g);
        uint32_t left = taken < share ? share - taken : 0; /* of this sender's share */
        uint32_t take = held > left ? held : left;
        take = take < held + budget ? take : held + budget;
        take = take < room ? take : room;
        if (take == 0)
            continue; /* nothing for it now (not even a refresh), or nothing left to send (a step that is
                       * empty, or all seen): a credit is a position, so none reaches past this step */
        if (first) {
            peer->wanted_epoch = comm->credit_epoch;
            touched[touched_count++] = p;
            peer->wanted = peer->taken = 0;
        }
        budget -= take - held;
        /* a step left partly uncovered holds back this sender's later ones */
        peer->taken = take < room ? share : peer->taken + take;
        uint32_t want = g * c->geometry.max_chunks + s->seen_end + take;
        if (want > peer->wanted) {
            peer->wanted = want;
            peer->wanted_ends_step = take == room;
        }
    }
    for (int i = 0; i < touched_count; i++) {
        struct peer_state *peer = &comm->peers[touched[i]];
        uint32_t grant = peer->wanted > peer->in_call.granted ? peer->wanted : peer->in_call.granted;
        /* a first credit, and one that reaches the end of a step, go out at once: no more of that
         * step would ever grow it by half a share, and its sender would wait for the refresh */
        uint32_t granted = peer->in_call.granted;
        int grew = grant > granted && (granted == 0 || grant - granted >= share / CREDIT_GROWTH_DIVISOR ||
                                       (grant == peer->wanted && peer->wanted_ends_step));
        if (!force && !grew && now - peer->in_call.granted_at_ns < refresh)
            continue;
        struct udt_control credit = udt_control_of(c, UDT_KIND_CREDIT);
        credit.credit = grant;
        credit.copies = udt_credit_copies(c, comm, CREDIT_COPIES);
        int rc = udt_send_control(c, (uint32_t)touched[i], &credit);
        if (rc < 0)
            return rc;
        if (rc == 0) { /* the socket is full: try again on the next pass */
            c->data.credits_dirty = 1;
            continue;
        }
        peer->in_call.granted = grant;
        peer->in_call.granted_at_ns = now;
        peer->in_call.arrived_since_grant = 0;
    }
    return udt_regrant(c, now);
}

/* Chunks of a send step that will actually be sent. */
static uint32_t count_to_send(const struct call *c, const struct udt_step *step)
{
    uint64_t base = c->geometry.chunk_base[step->send_block];
    uint32_t count = send_chunks(c, step->send_block), sending = 0;
    if (c->schedule.facts->sends_input)
        return count;
    for (uint32_t k = 0; k < count; k++)
        sending += (step->phase == UDT_PHASE_GATHER ? c->chunks.final_count[base + k] : c->chunks.rs_count[base + k]) != 0;
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
    int sent = udt_transport_send(udt_comm_of(c)->transport, b->items, b->n);
    if (sent < 0)
        return sent;
    c->stats->datagrams_sent += (uint64_t)sent;
    for (int i = 0; i < sent; i++)
        c->stats->payload_bytes_sent += b->items[i].payload_bytes;
    for (int i = b->n - 1; i >= sent; i--) {
        c->state[b->step[i]].sent_chunk = b->chunk[i]; /* items of a step are in position order */
        udt_comm_of(c)->peers[b->items[i].peer].in_call.chunks_queued--;
    }
    int taken = sent;
    b->n = 0;
    return taken;
}

/* Put chunks of step g into the batch until it is full or the receiver's
 * credit runs out. Returns 1 when every chunk of the step is handed out. */
static int fill_from_step(struct call *c, uint32_t g, struct send_batch *b)
{
    struct udt_comm *comm = udt_comm_of(c);
    const struct udt_step *step = &c->step[g];
    struct step_state *state = &c->state[g];
    struct peer_state *peer = &comm->peers[step->send_peer];
    uint32_t block = step->send_block, chunk_count = send_chunks(c, block);
    uint64_t base = c->geometry.chunk_base[block];
    int identity = c->geometry.accum_bytes == c->geometry.wire_bytes;
    if (!state->send_counted) {
        state->send_announced = count_to_send(c, step);
        state->send_counted = 1;
    }
    /* with copies, the step is sent `copies` times over: pass k sends position k * chunks + chunk */
    uint32_t position = state->sent_chunk, end = passes_end(c, g), queued_pass = UINT32_MAX;
    for (; position < end && b->n < SEND_BATCH; position++) {
        uint32_t chunk = position % chunk_count;
        /* a credit is a position, and covers at most a window beyond what we had sent
         * when it came: a forged credit cannot make us overrun the receiver by more
         * (a later copy's position was credited for the first; it counts against the window) */
        if (g * c->geometry.max_chunks + chunk >= peer->in_call.credit_limit || peer->in_call.chunks_queued >= peer->in_call.credit_base + c->data.window_chunks) {
            c->stats->credit_stalls++;
            break;
        }
        uint64_t id = base + chunk;
        uint16_t contributions = c->schedule.facts->sends_input ? 1 : step->phase == UDT_PHASE_GATHER ? c->chunks.final_count[id] : c->chunks.rs_count[id];
        if (contributions == 0)
            continue; /* gather: we never got this chunk; the receiver keeps its own */
        struct udt_wire_header h;
        udt_fill_header(c, &h, UDT_KIND_DATA, g);
        uint64_t elements = send_chunk_length(c, block, chunk), first = send_first_element(c, block, chunk);
        h.chunk_index = chunk;
        h.contributions = contributions;
        h.credit = state->send_announced;
        h.payload_bytes = (uint32_t)(elements * c->geometry.wire_bytes);
        udt_wire_encode(&h, comm->headers[b->n]);
        const void *payload;
        if (c->schedule.facts->sends_input || !(c->chunks.chunk_flags[id] & SCRATCH_VALID)) {
            udt_save_original(c, block, chunk);
            payload = input_at(c, first); /* our own input, untouched (in place: the tensor, unchanged) */
        } else if (identity) {
            payload = c->output.accum + first * c->geometry.accum_bytes;
        } else {
            uint8_t *slot = comm->staging + (size_t)b->n * comm->options.chunk_bytes;
            udt_pack(c->args.dtype, slot, c->output.accum + first * c->geometry.accum_bytes, elements);
            payload = slot;
        }
        b->items[b->n] = (struct udt_send_item){.peer = (uint32_t)step->send_peer, .header = comm->headers[b->n],
                                                .header_bytes = UDT_WIRE_HEADER_BYTES, .payload = payload,
                                                .payload_bytes = h.payload_bytes,
                                                /* a later pass starts a message: copies go apart from the originals */
                                                .flags = position >= chunk_count && position / chunk_count != queued_pass
                                                             ? UDT_SEND_APART : 0u};
        queued_pass = position / chunk_count;
        b->step[b->n] = g;
        b->chunk[b->n++] = position;
        peer->in_call.chunks_queued++;
    }
    state->sent_chunk = position;
    return position >= end;
}

static void mark_sent(struct call *c, uint32_t g)
{
    c->state[g].send_done = 1;
    if (c->step[g].send_peer != UDT_NO_PEER) /* to one receiver, steps go out in order */
        udt_comm_of(c)->peers[c->step[g].send_peer].in_call.sent_steps = g + 1;
    while (c->data.send_step < c->schedule.steps && c->state[c->data.send_step].send_done)
        c->data.send_step++;
}

/* Send what dependencies, credit and the socket allow. Steps go out in
 * order, except that a step stalled on its receiver's credit does not hold
 * up later steps to other receivers (to one receiver, steps stay in order:
 * it reads a later step from us as the end of the earlier ones). */
int udt_send_some(struct call *c)
{
    struct udt_comm *comm = udt_comm_of(c);
    struct send_batch b;
    b.n = 0;
    int progressed = 0, rc;
    comm->send_epoch++;
    uint32_t end = c->data.send_step + SEND_LOOKAHEAD_STEPS < c->schedule.steps ? c->data.send_step + SEND_LOOKAHEAD_STEPS : c->schedule.steps;
    for (uint32_t g = c->data.send_step; g < end && b.n < SEND_BATCH; g++) {
        const struct udt_step *step = &c->step[g];
        struct step_state *state = &c->state[g];
        if (state->send_done)
            continue;
        if (step->send_peer == UDT_NO_PEER || comm->peers[step->send_peer].in_call.finished) {
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
        struct udt_control end = udt_control_of(c, UDT_KIND_END);
        end.step = g;
        end.copies = (int)udt_end_copies(c, comm, g);
        rc = udt_send_control(c, (uint32_t)step->send_peer, &end);
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

/* Step g still has chunks to hand out once (its later copies aside). */
static int first_pass_pending(const struct call *c, uint32_t g)
{
    return !c->state[g].send_done && c->state[g].sent_chunk < send_chunks(c, c->step[g].send_block);
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
    if (h->phase != step->phase)
        return DROP_INVALID;
    if (h->layout_tag != c->layout_tag)
        return DROP_MISMATCH;
    if (h->kind == UDT_KIND_END)
        return c->state[h->step].closed ? DROP_QUIET : ADMIT;
    uint32_t block = step->recv_block;
    /* a sized all_to_all's sender that announces another count, or a last chunk of another
     * length, has another size for this piece: the call fails (its verdict's checksum, pieces.c),
     * and the data phase need not wait for the rest */
    if (c->args.piece_counts && (h->credit != chunks_in_block(c, block) || (h->chunk_index + 1 == h->credit &&
                                 h->payload_bytes != chunk_length(c, block, h->chunk_index) * c->geometry.wire_bytes)))
        return DROP_MISMATCH;
    if (h->chunk_index >= chunks_in_block(c, block))
        return DROP_INVALID;
    uint64_t elements = chunk_length(c, block, h->chunk_index);
    uint64_t id = c->geometry.chunk_base[block] + h->chunk_index;
    if (h->payload_bytes != elements * c->geometry.wire_bytes || bytes != UDT_WIRE_HEADER_BYTES + h->payload_bytes ||
        h->contributions == 0)
        return DROP_INVALID;
    /* the count the sender announces (finding 7): exact when the schedule says it holds the
     * whole block; else at least what already arrived plus this one, at most the block */
    if (step->recv_whole ? h->credit != chunks_in_block(c, block) : h->credit == 0 || h->credit > chunks_in_block(c, block))
        return DROP_INVALID;
    if (c->state[h->step].closed)
        return DROP_CLOSED;
    if (c->chunks.arrival_bits[(size_t)h->step * c->geometry.bitmap_bytes + h->chunk_index / 8] & (1u << (h->chunk_index % 8)))
        return DROP_DUPLICATE;
    /* after the duplicate check: a chunk several senders add to (direct) may be full already
     * because a forged copy got in first; the real one is then a duplicate, not malformed */
    /* a reduce chunk carries no more than the sender's partial can hold (one rank's input in a
     * direct exchange) nor more than the ranks still missing here: believed, a forged count
     * would make the chunk look complete and the real contributions be refused */
    uint32_t most = step->recv_mode == UDT_RECV_REDUCE ? c->n - c->chunks.rs_count[id] : c->n;
    if (step->recv_mode == UDT_RECV_REDUCE && step->recv_contributions < most)
        most = step->recv_contributions;
    if (h->contributions > most || h->credit <= c->state[h->step].received)
        return DROP_INVALID; /* more contributions than possible, or fewer chunks announced than already came */
    if (step->recv_needs_sent && first_pass_pending(c, step->recv_needs_sent - 1))
        return DROP_EARLY; /* it would change a block we have not finished sending */
    return ADMIT;
}

static void accept_data(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, const uint8_t *payload, uint32_t peer, uint64_t now)
{
    const struct udt_step *step = &c->step[h->step];
    struct step_state *s = &c->state[h->step];
    uint32_t block = step->recv_block;
    uint64_t id = c->geometry.chunk_base[block] + h->chunk_index;
    uint64_t first = chunk_first_element(c, block, h->chunk_index), elements = chunk_length(c, block, h->chunk_index);
    uint8_t *target = c->output.accum + first * c->geometry.accum_bytes;
    if (c->output.rank_rows && step->recv_mode == UDT_RECV_REDUCE) {
        /* kept apart in the sender's row, summed in rank order once all are in (output.c) */
        memcpy(udt_rank_row(c, peer, first - c->geometry.block_first[block]), payload, elements * c->geometry.wire_bytes);
        c->chunks.rs_count[id] = (uint16_t)(c->chunks.rs_count[id] + h->contributions);
    } else if (step->recv_mode == UDT_RECV_OVERWRITE) {
        udt_save_original(c, block, h->chunk_index);
        uint64_t bytes = elements * c->geometry.wire_bytes;
        if (c->output.final_uncached && !s->relayed && bytes >= UNCACHED_MIN_BYTES)
            udt_copy_uncached(target, payload, bytes); /* final: next read by the caller, after the call */
        else
            udt_unpack(c->args.dtype, target, payload, elements);
        c->chunks.final_count[id] = h->contributions;
    } else {
        udt_save_original(c, block, h->chunk_index);
        if ((c->chunks.chunk_flags[id] & SCRATCH_VALID) || c->output.in_place) /* in place an unchanged chunk is our input */
            udt_add(c->args.dtype, target, payload, elements);
        else
            udt_add_into(c->args.dtype, target, input_at(c, first), payload, elements);
        c->chunks.rs_count[id] = (uint16_t)(c->chunks.rs_count[id] + h->contributions);
    }
    if (!c->output.rank_rows || step->recv_mode != UDT_RECV_REDUCE)
        c->chunks.chunk_flags[id] |= SCRATCH_VALID;
    c->chunks.arrival_bits[(size_t)h->step * c->geometry.bitmap_bytes + h->chunk_index / 8] |= (uint8_t)(1u << (h->chunk_index % 8));
    s->received++;
    s->last_arrival_ns = now;
    if (h->credit > s->announced) /* the largest wins: a sender cannot send more than it has */
        s->announced = h->credit;
    if (h->chunk_index + 1 > s->seen_end) {
        if (h->chunk_index > s->seen_end) { /* chunks come in order: the ones skipped were lost (or, rarely, come late) */
            c->data.skipped_runs++;
            c->data.skipped_chunks += h->chunk_index - s->seen_end;
        }
        s->seen_end = h->chunk_index + 1;
        c->data.credits_dirty = 1;
    }
    c->stats->datagrams_received++;
    udt_note_peer_step(c, comm, peer, h->step, now);
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
    if (h->layout_tag != c->layout_tag)
        return DROP_INVALID;
    if (h->credit > comm->peers[peer].in_call.credit_ceiling) /* sized: the receiver expects a larger piece */
        return c->args.piece_counts ? DROP_MISMATCH : DROP_INVALID;
    return ADMIT;
}

void udt_on_credit(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer,
                      uint64_t now)
{
    switch (admit_credit(c, comm, h, bytes, peer)) {
    case ADMIT:
        break;
    case DROP_INVALID:
        c->stats->dropped_invalid++;
        return;
    case DROP_MISMATCH:
        c->stats->dropped_invalid++;
        c->live.mismatched_rank = (int32_t)peer; /* the data phase ends; the verdict says why */
        return;
    default:
        return;
    }
    struct peer_state *p = &comm->peers[peer];
    udt_hear(c, comm, peer, now); /* in this call, or already in the next */
    if (h->sequence == c->sequence) {
        if (h->credit >= p->in_call.credit_limit) {
            p->in_call.credit_limit = h->credit;
            p->in_call.credit_base = p->in_call.chunks_queued;
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

/* A chunk we already hold, or one of a step we closed, from the sender the step
 * expects. With args.copies > 1 these are the later copies and counted apart
 * from drops; either way the sender is alive and in the step (the step's idle
 * clock restarts: the copy of a chunk we lack may be next) and the copy took
 * room in our window (see regrant). */
static void note_copy(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t peer, uint64_t now,
                      int step_open)
{
    if (c->data.copies > 1)
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

/* A data chunk or END marker from `peer` (the session and sender already checked): admitted,
 * or dropped and counted. */
void udt_on_data(struct call *c, struct udt_comm *comm, const struct udt_wire_header *header, const uint8_t *payload,
                 uint32_t bytes, uint32_t peer, uint64_t now)
{
    struct udt_collective_stats *st = c->stats;
    struct udt_wire_header h = *header;
    switch (admit_data(c, &h, bytes, peer)) {
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
        c->live.mismatched_rank = (int32_t)peer;
        return;
    case DROP_QUIET: return;
    }
    if (h.kind == UDT_KIND_END) {
        if (!c->state[h.step].end_seen_ns)
            c->state[h.step].end_seen_ns = now;
        udt_note_peer_step(c, comm, peer, h.step, now);
        return;
    }
    drop_remaining_copies(c, &c->step[h.step]);
    accept_data(c, comm, &h, payload, peer, now);
}
