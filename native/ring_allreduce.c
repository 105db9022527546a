/* Loss-tolerant ring allreduce.
 *
 * Each call runs 2*(N-1) steps. In step g a rank sends one segment to its
 * downstream neighbour and receives one from its upstream neighbour, chunk by
 * chunk, one chunk per datagram. Nothing is retransmitted:
 *  - a receive step closes when all its chunks arrived, when the sender's END
 *    marker arrived (what is missing then is lost), or at the step's share
 *    of the call's deadline; a lost chunk never stalls later hops;
 *  - every chunk carries how many ranks' inputs it sums, and the owner of a
 *    segment rescales by N/count, so the estimate is unbiased;
 *  - receivers grant their upstream credits (a window of positions), so a
 *    healthy link never overflows a receive buffer.
 * The caller's tensor is written once, at the end, and only on success. */
#define _GNU_SOURCE
#include "ring_allreduce.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "elementwise.h"
#include "ring_geometry.h"
#include "wire.h"

#define SEND_BATCH 32
/* 16 datagrams of 64 KiB stay in L2 between the kernel's copy and our add */
#define RECV_BATCH 16
#define RS_ARRIVED 1u
#define AG_ARRIVED 2u
#define SCRATCH_VALID 4u /* scratch holds this chunk's current value; else the caller's input does */

struct udt_comm {
    struct udt_transport *transport;
    uint32_t rank, world_size;
    uint64_t session_id;
    uint32_t sequence; /* of the last call started */
    struct udt_engine_options options;
    /* credit granted by our downstream for the next call, if it came early */
    uint32_t early_credit_sequence, early_credit;
    /* buffers kept between calls so a steady workload allocates nothing */
    uint8_t *scratch;
    size_t scratch_bytes;
    uint8_t *chunk_state;
    size_t chunk_state_bytes;
    uint8_t *staging;
    uint8_t headers[SEND_BATCH + 8][UDT_WIRE_HEADER_BYTES];
    char error[320];
};

struct call {
    struct udt_comm *comm;
    const struct udt_allreduce_args *args;
    struct udt_allreduce_stats *stats;
    uint32_t world_size, rank, upstream, downstream, steps, rotation, sequence, layout_tag;
    uint64_t chunk_elements;
    uint32_t max_chunks; /* in any segment: positions are step * max_chunks + chunk */
    size_t wire_bytes, accum_bytes;
    uint8_t *accum;
    uint64_t chunk_base[UDT_MAX_WORLD + 1];    /* first chunk id of each actual segment */
    uint64_t segment_first[UDT_MAX_WORLD + 1]; /* first element of each segment (and the end) */
    uint16_t *rs_count;    /* contributions summed in scratch during reduce-scatter */
    uint16_t *final_count; /* contributions in the owner's estimate, 0 = not known here */
    uint8_t *arrived;
    uint32_t step_received[2 * UDT_MAX_WORLD];
    uint64_t end_seen_ns[2 * UDT_MAX_WORLD];
    uint8_t finalized[2 * UDT_MAX_WORLD];
    uint64_t last_arrival_ns[2 * UDT_MAX_WORLD];
    uint32_t chunks_seen_end[2 * UDT_MAX_WORLD]; /* one past the highest chunk index received */
    uint32_t highest_step_seen;                  /* from upstream, +1; 0 = none yet */
    uint32_t announced[2 * UDT_MAX_WORLD];       /* chunks the upstream said it sends in a step; 0 = not yet known */
    uint32_t send_announced;                     /* chunks we send in the current send step */
    uint64_t reminded_at_ns;
    uint32_t recv_step;        /* lowest receive step not yet closed */
    uint64_t step_deadline_ns; /* when recv_step gives up waiting */
    uint32_t send_step, send_chunk;
    int end_sent;
    uint32_t credit_limit;     /* from downstream: we may send positions below this */
    uint32_t read_position;    /* one past the highest position received */
    uint32_t granted;          /* last credit we sent upstream */
    uint64_t granted_at_ns;
    uint32_t window_chunks;
    int heard_upstream, heard_downstream;
    int credited; /* the downstream granted credit for this call */
    int downstream_moved_on;
    uint16_t silent_rank;  /* a rank known to be silent; stamped on everything we send */
    int silence_is_ours;   /* we concluded it ourselves (not told), so hearing it later clears it */
    int32_t mismatched_rank;
    uint64_t start_ns, deadline_ns;
};

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int fail(struct udt_comm *comm, int status, const char *message)
{
    snprintf(comm->error, sizeof comm->error, "%s", message);
    return status;
}

/* ---- geometry of this call ------------------------------------------- */

static uint32_t actual_segment(const struct call *c, uint32_t virtual_segment) { return (virtual_segment + c->rotation) % c->world_size; }

static uint32_t chunks_in_segment(struct call *c, uint32_t segment)
{
    return (uint32_t)(c->chunk_base[segment + 1] - c->chunk_base[segment]);
}

static uint64_t chunk_first_element(const struct call *c, uint32_t segment, uint32_t chunk)
{
    return c->segment_first[segment] + (uint64_t)chunk * c->chunk_elements;
}

static uint64_t chunk_length(const struct call *c, uint32_t segment, uint32_t chunk)
{
    uint64_t end = c->segment_first[segment + 1];
    uint64_t first = chunk_first_element(c, segment, chunk);
    return end - first < c->chunk_elements ? end - first : c->chunk_elements;
}

static uint32_t layout_tag_of(const struct udt_allreduce_args *a, uint32_t chunk_bytes)
{
    uint64_t fields[5] = {a->count, (uint64_t)a->dtype, (uint64_t)a->op, chunk_bytes, (uint64_t)a->estimator};
    uint32_t hash = 2166136261u; /* FNV-1a */
    const uint8_t *bytes = (const uint8_t *)fields;
    for (size_t i = 0; i < sizeof fields; i++)
        hash = (hash ^ bytes[i]) * 16777619u;
    return hash;
}

/* ---- sending ------------------------------------------------------------ */

static void fill_header(struct call *c, struct udt_wire_header *h, uint8_t kind, uint32_t global_step)
{
    memset(h, 0, sizeof *h);
    h->magic = UDT_WIRE_MAGIC;
    h->version = UDT_WIRE_VERSION;
    h->kind = kind;
    h->session_id = c->comm->session_id;
    h->sequence = c->sequence;
    h->source_rank = (uint16_t)c->rank;
    h->silent_rank = c->silent_rank;
    h->layout_tag = c->layout_tag;
    if (kind != UDT_KIND_CREDIT) {
        int all_gather = global_step >= c->world_size - 1;
        h->phase = all_gather ? UDT_PHASE_ALL_GATHER : UDT_PHASE_REDUCE_SCATTER;
        h->step = (uint16_t)(all_gather ? global_step - (c->world_size - 1) : global_step);
    }
}

static int send_control(struct call *c, uint8_t kind, uint32_t global_step, uint32_t peer, uint32_t credit, int copies)
{
    struct udt_wire_header h;
    fill_header(c, &h, kind, global_step);
    h.credit = credit;
    uint8_t *slot = c->comm->headers[SEND_BATCH];
    udt_wire_encode(&h, slot);
    struct udt_send_item items[8];
    for (int i = 0; i < copies && i < 8; i++)
        items[i] = (struct udt_send_item){.peer = peer, .header = slot, .header_bytes = UDT_WIRE_HEADER_BYTES};
    int rc = udt_transport_send(c->comm->transport, items, copies < 8 ? copies : 8);
    if (rc > 0)
        c->stats->datagrams_sent += (uint64_t)rc;
    return rc < 0 ? rc : 0;
}

static int grant_credit(struct call *c, uint64_t now, int force)
{
    uint32_t floor = c->recv_step * c->max_chunks;
    uint32_t base = c->read_position > floor ? c->read_position : floor;
    uint32_t grant = base + c->window_chunks;
    int refresh = now - c->granted_at_ns >= (uint64_t)c->comm->options.credit_refresh_us * 1000ull;
    if (!force && grant < c->granted + c->window_chunks / 4 && !refresh)
        return 0;
    c->granted = grant;
    c->granted_at_ns = now;
    return send_control(c, UDT_KIND_CREDIT, 0, c->upstream, grant, 1);
}

/* Send as much of the current send step as credit and the socket allow. */
static int send_some(struct call *c)
{
    if (c->downstream_moved_on)
        c->send_step = c->steps;
    if (c->send_step >= c->steps)
        return 0;
    if (c->send_step > 0 && !c->finalized[c->send_step - 1])
        return 0; /* the segment to forward is still being received */
    uint32_t global_step = c->send_step;
    int all_gather = global_step >= c->world_size - 1;
    uint32_t segment = actual_segment(c, udt_send_segment(c->rank, c->world_size, global_step));
    uint32_t chunk_count = chunks_in_segment(c, segment);
    uint64_t base = c->chunk_base[segment];
    struct udt_send_item items[SEND_BATCH];
    uint32_t item_chunk[SEND_BATCH];
    int n = 0;
    uint32_t chunk = c->send_chunk;
    if (chunk == 0 && c->send_announced == 0) {
        /* reduce-scatter sends every chunk; all-gather only those that reached us */
        for (uint32_t k = 0; k < chunk_count; k++)
            c->send_announced += all_gather ? c->final_count[base + k] != 0 : 1;
    }
    int identity = c->accum_bytes == c->wire_bytes;
    for (; chunk < chunk_count && n < SEND_BATCH; chunk++) {
        uint32_t position = global_step * c->max_chunks + chunk;
        if (position >= c->credit_limit) {
            c->stats->credit_stalls++;
            break;
        }
        uint64_t id = base + chunk;
        uint16_t contributions = all_gather ? c->final_count[id] : c->rs_count[id];
        if (contributions == 0)
            continue; /* all-gather: we never got this chunk, the downstream will fill it */
        struct udt_wire_header h;
        fill_header(c, &h, UDT_KIND_DATA, global_step);
        uint64_t elements = chunk_length(c, segment, chunk);
        h.chunk_index = chunk;
        h.contributions = contributions;
        h.credit = c->send_announced;
        h.payload_bytes = (uint32_t)(elements * c->wire_bytes);
        udt_wire_encode(&h, c->comm->headers[n]);
        uint64_t first = chunk_first_element(c, segment, chunk);
        if (!(c->arrived[id] & SCRATCH_VALID)) {
            /* our own input, untouched so far: send it straight from the caller's memory */
            items[n] = (struct udt_send_item){.peer = c->downstream, .header = c->comm->headers[n], .header_bytes = UDT_WIRE_HEADER_BYTES,
                                              .payload = (const uint8_t *)c->args->data + first * c->wire_bytes, .payload_bytes = h.payload_bytes};
            item_chunk[n++] = chunk;
            continue;
        }
        const uint8_t *source = c->accum + first * c->accum_bytes;
        const void *payload = source;
        if (!identity) {
            uint8_t *slot = c->comm->staging + (size_t)n * c->comm->options.chunk_bytes;
            udt_pack(c->args->dtype, slot, source, elements);
            payload = slot;
        }
        items[n] = (struct udt_send_item){.peer = c->downstream, .header = c->comm->headers[n], .header_bytes = UDT_WIRE_HEADER_BYTES,
                                          .payload = payload, .payload_bytes = h.payload_bytes};
        item_chunk[n] = chunk;
        n++;
    }
    int progressed = 0;
    if (n > 0) {
        int sent = udt_transport_send(c->comm->transport, items, n);
        if (sent < 0)
            return sent;
        c->stats->datagrams_sent += (uint64_t)sent;
        if (sent < n) {
            c->send_chunk = item_chunk[sent];
            return sent > 0;
        }
        progressed = 1;
    }
    c->send_chunk = chunk;
    if (chunk >= chunk_count) {
        int rc = send_control(c, UDT_KIND_END, global_step, c->downstream, 0, (int)c->comm->options.end_repeats);
        if (rc < 0)
            return rc;
        c->send_step++;
        c->send_chunk = 0;
        c->send_announced = 0;
        progressed = 1;
    }
    return progressed;
}

/* ---- receiving ---------------------------------------------------------- */

static void on_datagram(struct call *c, const struct udt_recv_item *item, uint64_t now)
{
    struct udt_allreduce_stats *st = c->stats;
    struct udt_wire_header h;
    if (udt_wire_decode(item->data, item->bytes, &h) != 0) {
        st->dropped_invalid++;
        return;
    }
    if (h.magic != UDT_WIRE_MAGIC || h.version != UDT_WIRE_VERSION || h.session_id != c->comm->session_id ||
        item->peer < 0 || (uint32_t)item->peer != h.source_rank) {
        st->dropped_foreign++;
        return;
    }
    /* A neighbour is alive for this call if it sent anything for this call
     * or the next. (Not for an earlier one: those may have waited in our
     * socket since before the neighbour died.) */
    int current = h.sequence == c->sequence || h.sequence == c->sequence + 1;
    if (current && h.source_rank == c->downstream && h.kind == UDT_KIND_CREDIT)
        c->heard_downstream = 1;
    if (current && h.source_rank == c->upstream && h.kind != UDT_KIND_CREDIT)
        c->heard_upstream = 1;
    if (c->silence_is_ours && (c->heard_upstream || c->silent_rank != c->upstream) &&
        (c->heard_downstream || c->silent_rank != c->downstream)) {
        c->silent_rank = UDT_NO_RANK; /* late, not dead */
        c->silence_is_ours = 0;
    }
    if (h.kind == UDT_KIND_CREDIT) {
        if (h.source_rank != c->downstream) {
            st->dropped_foreign++;
        } else if (h.sequence == c->sequence) {
            c->credited = 1;
            if (h.credit > c->credit_limit)
                c->credit_limit = h.credit;
        } else if (h.sequence == c->sequence + 1) {
            /* The downstream finished this call: what we have not sent it yet
             * would arrive stale. Stop sending; keep the credit for the next call. */
            c->downstream_moved_on = 1;
            if (c->comm->early_credit_sequence != h.sequence || h.credit > c->comm->early_credit)
                c->comm->early_credit = h.credit;
            c->comm->early_credit_sequence = h.sequence;
        }
        return; /* an old credit is harmless and not worth counting */
    }
    if ((h.kind != UDT_KIND_DATA && h.kind != UDT_KIND_END) || h.source_rank != c->upstream) {
        st->dropped_foreign++;
        return;
    }
    if (h.sequence != c->sequence) {
        if (!(h.kind == UDT_KIND_END && h.sequence + 1 == c->sequence))
            st->dropped_stale++; /* an END of the previous call is a reminder, not an intruder */
        return;
    }
    if (h.phase > UDT_PHASE_ALL_GATHER || h.flags != 0 || h.step >= c->world_size - 1) {
        st->dropped_invalid++;
        return;
    }
    if (h.layout_tag != c->layout_tag) {
        st->dropped_invalid++;
        c->mismatched_rank = (int32_t)h.source_rank;
        return;
    }
    /* Adopt what the upstream concluded about ranks we cannot observe; our
     * neighbours (and we) are judged by what we hear ourselves. */
    if (h.silent_rank < c->world_size && c->silent_rank == UDT_NO_RANK && h.silent_rank != c->rank &&
        h.silent_rank != c->upstream && h.silent_rank != c->downstream)
        c->silent_rank = h.silent_rank;
    int all_gather = h.phase == UDT_PHASE_ALL_GATHER;
    uint32_t global_step = all_gather ? c->world_size - 1 + h.step : h.step;
    if (global_step + 1 > c->highest_step_seen)
        c->highest_step_seen = global_step + 1; /* the upstream sends steps in order */
    if (h.kind == UDT_KIND_END && c->finalized[global_step])
        return; /* the redundant copy of an END marker */
    if (c->finalized[global_step]) {
        st->dropped_stale++;
        return;
    }
    if (h.kind == UDT_KIND_END) {
        if (!c->end_seen_ns[global_step])
            c->end_seen_ns[global_step] = now;
        return;
    }
    uint32_t segment = actual_segment(c, udt_recv_segment(c->rank, c->world_size, global_step));
    if (h.chunk_index >= chunks_in_segment(c, segment)) {
        st->dropped_invalid++;
        return;
    }
    uint64_t elements = chunk_length(c, segment, h.chunk_index);
    uint32_t most_contributions = all_gather ? c->world_size : h.step + 1u;
    if (h.payload_bytes != elements * c->wire_bytes || item->bytes != UDT_WIRE_HEADER_BYTES + h.payload_bytes ||
        h.contributions == 0 || h.contributions > most_contributions) {
        st->dropped_invalid++;
        return;
    }
    /* All-gather step t overwrites the segment we send in reduce-scatter step
     * t; only after timeouts upstream can it arrive before that send is done. */
    if (all_gather && c->send_step <= h.step) {
        st->dropped_early++;
        return;
    }
    uint64_t id = c->chunk_base[segment] + h.chunk_index;
    uint8_t bit = all_gather ? AG_ARRIVED : RS_ARRIVED;
    if (c->arrived[id] & bit) {
        st->dropped_duplicate++;
        return;
    }
    uint64_t first = chunk_first_element(c, segment, h.chunk_index);
    uint8_t *target = c->accum + first * c->accum_bytes;
    const uint8_t *payload = item->data + UDT_WIRE_HEADER_BYTES;
    if (all_gather) {
        udt_unpack(c->args->dtype, target, payload, elements);
        c->final_count[id] = h.contributions;
    } else {
        /* each chunk arrives at most once per phase, so scratch = input + partial */
        udt_add_into(c->args->dtype, target, (const uint8_t *)c->args->data + first * c->wire_bytes, payload, elements);
        c->rs_count[id] = (uint16_t)(c->rs_count[id] + h.contributions);
    }
    c->arrived[id] |= bit | SCRATCH_VALID;
    c->step_received[global_step]++;
    c->last_arrival_ns[global_step] = now;
    if (h.credit && h.credit <= chunks_in_segment(c, segment) && c->announced[global_step] == 0)
        c->announced[global_step] = h.credit;
    if (h.chunk_index + 1 > c->chunks_seen_end[global_step])
        c->chunks_seen_end[global_step] = h.chunk_index + 1;
    st->datagrams_received++;
    uint32_t position = global_step * c->max_chunks + h.chunk_index;
    if (position + 1 > c->read_position)
        c->read_position = position + 1;
}

static int receive_some(struct call *c, uint64_t now)
{
    struct udt_recv_item items[RECV_BATCH];
    int got = udt_transport_recv(c->comm->transport, items, RECV_BATCH);
    for (int i = 0; i < got; i++)
        on_datagram(c, &items[i], now);
    return got;
}

/* ---- closing steps ------------------------------------------------------ */

static void set_step_deadline(struct call *c, uint64_t now)
{
    uint32_t remaining = c->steps - c->recv_step;
    uint64_t left = c->deadline_ns > now ? c->deadline_ns - now : 0;
    c->step_deadline_ns = now + (remaining ? left / remaining : 0);
}

static void close_step(struct call *c, uint32_t global_step)
{
    uint32_t segment = actual_segment(c, udt_recv_segment(c->rank, c->world_size, global_step));
    uint32_t chunk_count = chunks_in_segment(c, segment);
    c->stats->chunks_total += chunk_count;
    c->stats->chunks_lost += chunk_count - c->step_received[global_step];
    c->finalized[global_step] = 1;
    if (global_step != c->world_size - 2)
        return;
    /* Last reduce-scatter step: this rank now owns the segment. Rescale each
     * chunk by N / contributions so its expectation is the full sum. */
    uint64_t base = c->chunk_base[segment];
    for (uint32_t chunk = 0; chunk < chunk_count; chunk++) {
        uint64_t id = base + chunk;
        uint64_t first = chunk_first_element(c, segment, chunk), elements = chunk_length(c, segment, chunk);
        uint8_t *value = c->accum + first * c->accum_bytes;
        if (!(c->arrived[id] & SCRATCH_VALID)) {
            udt_load(c->args->dtype, value, (const uint8_t *)c->args->data + first * c->wire_bytes, elements);
            c->arrived[id] |= SCRATCH_VALID;
        }
        if (c->args->estimator == UDT_ESTIMATOR_UNBIASED && c->rs_count[id] != c->world_size)
            udt_scale(c->args->dtype, value, elements, (double)c->world_size / c->rs_count[id]);
        c->final_count[id] = c->rs_count[id];
    }
}

/* A step with a hole below its highest received chunk has seen loss; when it
 * then goes quiet, waiting longer only delays every later hop. Returns the
 * time of its last arrival, or 0 when there is no evidence of loss. */
static uint64_t step_idle_since(const struct call *c, uint32_t g)
{
    /* Only a chunk missing below one that arrived is evidence: a step still
     * in progress is short of its announced count too. */
    if (c->comm->options.idle_close_us == 0 || c->step_received[g] >= c->chunks_seen_end[g])
        return 0;
    return c->last_arrival_ns[g];
}

/* Close the lowest open receive step if it is complete, ended, superseded,
 * idle after loss, or overdue. */
static int close_ready_steps(struct call *c, uint64_t now)
{
    int closed = 0;
    while (c->recv_step < c->steps) {
        uint32_t g = c->recv_step;
        uint32_t expected = chunks_in_segment(c, actual_segment(c, udt_recv_segment(c->rank, c->world_size, g)));
        int complete = c->step_received[g] >= expected ||
                       (c->announced[g] && c->step_received[g] >= c->announced[g]);
        int ended = c->end_seen_ns[g] && now - c->end_seen_ns[g] >= (uint64_t)c->comm->options.reorder_grace_us * 1000ull;
        /* the upstream already sends a later step: all of this one that will come, came */
        int superseded = c->highest_step_seen > g + 1;
        /* idle counts only once the upstream had credit for the whole step:
         * otherwise its silence may be our own flow control */
        int idle = step_idle_since(c, g) && c->granted >= g * c->max_chunks + expected &&
                   now - step_idle_since(c, g) >= (uint64_t)c->comm->options.idle_close_us * 1000ull;
        int overdue = now >= c->step_deadline_ns;
        if (!complete && !ended && !superseded && !idle && !overdue)
            break;
        if (!complete)
            ended ? c->stats->steps_ended++ : superseded ? c->stats->steps_superseded++
                  : idle ? c->stats->steps_idle_closed++ : c->stats->steps_timed_out++;
        close_step(c, g);
        c->recv_step++;
        set_step_deadline(c, now);
        closed = 1;
    }
    return closed;
}

/* ---- result --------------------------------------------------------------- */

/* Per chunk: the owner's estimate if it reached us; otherwise our own
 * reduce-scatter partial, rescaled (unbiased) or zero (baseline). */
static double result_factor(const struct call *c, uint64_t id, uint16_t *contributions)
{
    double mean = c->args->op == UDT_OP_MEAN ? 1.0 / c->world_size : 1.0;
    if (c->final_count[id]) {
        *contributions = c->final_count[id];
        return mean;
    }
    if (c->args->estimator == UDT_ESTIMATOR_ZERO_FILL) {
        *contributions = 0;
        return 0.0;
    }
    *contributions = c->rs_count[id];
    return mean * c->world_size / c->rs_count[id];
}

static double delivered_fraction(struct call *c)
{
    double delivered = 0;
    for (uint32_t segment = 0; segment < c->world_size; segment++) {
        for (uint32_t chunk = 0; chunk < chunks_in_segment(c, segment); chunk++) {
            uint16_t contributions;
            result_factor(c, c->chunk_base[segment] + chunk, &contributions);
            delivered += (double)contributions * (double)chunk_length(c, segment, chunk);
        }
    }
    return c->args->count ? delivered / ((double)c->world_size * (double)c->args->count) : 1.0;
}

static void write_result(struct call *c)
{
    uint8_t *out = c->args->data;
    for (uint32_t segment = 0; segment < c->world_size; segment++) {
        for (uint32_t chunk = 0; chunk < chunks_in_segment(c, segment); chunk++) {
            uint16_t contributions;
            uint64_t id = c->chunk_base[segment] + chunk;
            double factor = result_factor(c, id, &contributions);
            uint64_t first = chunk_first_element(c, segment, chunk), elements = chunk_length(c, segment, chunk);
            if (c->arrived[id] & SCRATCH_VALID)
                udt_store(c->args->dtype, out + first * c->wire_bytes, c->accum + first * c->accum_bytes, elements, factor);
            else /* a hole where nothing ever arrived: our own input, rescaled in place */
                udt_rescale_wire(c->args->dtype, out + first * c->wire_bytes, elements, factor);
        }
    }
}

/* ---- the call ----------------------------------------------------------- */

static int prepare(struct call *c)
{
    struct udt_comm *comm = c->comm;
    const struct udt_allreduce_args *a = c->args;
    uint32_t n = comm->world_size;
    c->wire_bytes = udt_wire_elem_bytes(a->dtype);
    c->accum_bytes = udt_accum_elem_bytes(a->dtype);
    c->chunk_elements = comm->options.chunk_bytes / c->wire_bytes;
    if (c->chunk_elements == 0)
        return fail(comm, UDT_ERR_INVALID_ARGUMENT, "chunk_bytes is smaller than one element");
    uint64_t *bases = c->chunk_base;
    uint64_t max_chunks = 0;
    bases[0] = 0;
    for (uint32_t s = 0; s <= n; s++)
        c->segment_first[s] = udt_segment_start(a->count, n, s);
    for (uint32_t s = 0; s < n; s++) {
        uint64_t chunks = udt_chunks_for(udt_segment_length(a->count, n, s), c->chunk_elements);
        bases[s + 1] = bases[s] + chunks;
        if (chunks > max_chunks)
            max_chunks = chunks;
    }
    uint64_t positions = (uint64_t)c->steps * (max_chunks + 1) + (uint64_t)comm->options.window_bytes;
    if (positions >= 0xF0000000ull)
        return fail(comm, UDT_ERR_INVALID_ARGUMENT, "too many chunks for one call: raise chunk_bytes");
    c->max_chunks = (uint32_t)max_chunks;
    uint64_t total_chunks = bases[n];

    size_t scratch = (size_t)a->count * c->accum_bytes;
    if (scratch > comm->scratch_bytes) {
        free(comm->scratch);
        comm->scratch = malloc(scratch);
        comm->scratch_bytes = comm->scratch ? scratch : 0;
        if (!comm->scratch)
            return fail(comm, UDT_ERR_NO_MEMORY, "out of memory for the scratch buffer");
    }
    size_t state = (size_t)total_chunks * (2 * sizeof(uint16_t) + 1);
    if (state > comm->chunk_state_bytes || !comm->chunk_state) {
        free(comm->chunk_state);
        comm->chunk_state = malloc(state ? state : 1);
        comm->chunk_state_bytes = comm->chunk_state ? state : 0;
        if (!comm->chunk_state)
            return fail(comm, UDT_ERR_NO_MEMORY, "out of memory for chunk state");
    }
    c->accum = comm->scratch;
    c->rs_count = (uint16_t *)comm->chunk_state;
    c->final_count = c->rs_count + total_chunks;
    c->arrived = (uint8_t *)(c->final_count + total_chunks);
    for (uint64_t i = 0; i < total_chunks; i++)
        c->rs_count[i] = 1;
    memset(c->final_count, 0, total_chunks * sizeof(uint16_t));
    memset(c->arrived, 0, total_chunks);

    uint32_t window = comm->options.window_bytes / comm->options.chunk_bytes;
    c->window_chunks = window < 16 ? 16 : window;
    return UDT_OK;
}

/* Call a neighbour silent when it sent nothing at all during this call. */
static void judge_silence(struct call *c, int time_is_up)
{
    if (!time_is_up || c->silent_rank != UDT_NO_RANK)
        return;
    if (!c->heard_upstream)
        c->silent_rank = (uint16_t)c->upstream;
    else if (!c->heard_downstream && c->send_step < c->steps)
        c->silent_rank = (uint16_t)c->downstream;
    c->silence_is_ours = c->silent_rank != UDT_NO_RANK;
}

static int run_steps(struct call *c)
{
    struct udt_transport *t = c->comm->transport;
    uint64_t now = now_ns();
    set_step_deadline(c, now);
    int rc = grant_credit(c, now, 1);
    if (rc < 0)
        return rc;
    /* A neighbour that sent nothing for half the deadline is called silent
     * (and others are told, so ranks that cannot see it fail fast too). */
    uint64_t silence_after = c->start_ns + (c->deadline_ns - c->start_ns) / 2;
    uint64_t spin_started_ns = 0;
    while (c->recv_step < c->steps || c->send_step < c->steps) {
        now = now_ns();
        if (now >= c->deadline_ns) {
            c->stats->deadline_expired = 1;
            break;
        }
        int progressed = close_ready_steps(c, now);
        rc = send_some(c);
        if (rc < 0)
            return rc;
        progressed |= rc;
        int got = receive_some(c, now);
        if (got < 0)
            return got;
        progressed |= got > 0;
        if (c->recv_step < c->steps && (rc = grant_credit(c, now, 0)) < 0)
            return rc;
        if (!c->credited && c->sequence > 1 &&
            now - c->reminded_at_ns >= (uint64_t)c->comm->options.credit_refresh_us * 1000ull) {
            /* The downstream has not started this call: it may still wait for
             * the end of the previous one, whose END markers can all be lost. */
            c->reminded_at_ns = now;
            c->sequence--;
            rc = send_control(c, UDT_KIND_END, c->steps - 1, c->downstream, 0, 1);
            c->sequence++;
            if (rc < 0)
                return rc;
        }
        judge_silence(c, now >= silence_after);
        if (progressed) {
            spin_started_ns = 0;
            continue;
        }
        /* Spin briefly before sleeping: a wake-up costs more than the next
         * datagram usually takes to come. */
        if (!spin_started_ns)
            spin_started_ns = now;
        if (now - spin_started_ns < (uint64_t)c->comm->options.busy_poll_us * 1000ull)
            continue;
        /* Idle: sleep until a datagram comes or the next timer is due. */
        uint64_t wake = c->deadline_ns;
        if (c->recv_step < c->steps && c->step_deadline_ns < wake)
            wake = c->step_deadline_ns;
        uint64_t refresh = c->granted_at_ns + (uint64_t)c->comm->options.credit_refresh_us * 1000ull;
        if (c->recv_step < c->steps && refresh < wake)
            wake = refresh;
        uint64_t remind = c->reminded_at_ns + (uint64_t)c->comm->options.credit_refresh_us * 1000ull;
        if (!c->credited && c->sequence > 1 && remind < wake)
            wake = remind;
        if (c->recv_step < c->steps && step_idle_since(c, c->recv_step)) {
            uint64_t idle = step_idle_since(c, c->recv_step) + (uint64_t)c->comm->options.idle_close_us * 1000ull;
            if (idle < wake)
                wake = idle;
        }
        if (c->recv_step < c->steps && c->end_seen_ns[c->recv_step]) {
            uint64_t grace = c->end_seen_ns[c->recv_step] + (uint64_t)c->comm->options.reorder_grace_us * 1000ull;
            if (grace < wake)
                wake = grace;
        }
        int64_t wait_us = wake > now ? (int64_t)((wake - now) / 1000) : 0;
        c->stats->idle_waits++;
        if (wait_us > 0 && (rc = udt_transport_wait(t, (int)(wait_us > 100000 ? 100000 : wait_us))) < 0)
            return rc;
    }
    /* Deadline: whatever has not arrived is lost; close the rest in order so
     * the owned segment is still rescaled. */
    while (c->recv_step < c->steps) {
        c->stats->steps_timed_out++;
        close_step(c, c->recv_step++);
    }
    judge_silence(c, c->stats->deadline_expired);
    return UDT_OK;
}

int udt_allreduce(struct udt_comm *comm, const struct udt_allreduce_args *args, struct udt_allreduce_stats *stats)
{
    memset(stats, 0, sizeof *stats);
    stats->silent_rank = -1;
    stats->mismatched_rank = -1;
    stats->delivered_fraction = 1.0;
    stats->deadline_s = args->deadline_s;
    if (args->dtype < 0 || args->dtype >= UDT_DTYPE_COUNT || (args->op != UDT_OP_SUM && args->op != UDT_OP_MEAN) ||
        (args->estimator != UDT_ESTIMATOR_UNBIASED && args->estimator != UDT_ESTIMATOR_ZERO_FILL) || !(args->deadline_s > 0) ||
        (args->count && !args->data))
        return fail(comm, UDT_ERR_INVALID_ARGUMENT, "invalid allreduce arguments");
    uint64_t start = now_ns();
    comm->sequence++;
    stats->sequence = comm->sequence;
    if (comm->world_size == 1 || args->count == 0) {
        /* Nothing to exchange: every rank skips the same call, and the
         * result (sum or mean of one contribution) is the input itself. */
        stats->elapsed_s = (double)(now_ns() - start) * 1e-9;
        return UDT_OK;
    }
    struct call c;
    memset(&c, 0, sizeof c);
    c.comm = comm;
    c.args = args;
    c.stats = stats;
    c.world_size = comm->world_size;
    c.rank = comm->rank;
    c.upstream = (comm->rank + comm->world_size - 1) % comm->world_size;
    c.downstream = (comm->rank + 1) % comm->world_size;
    c.steps = udt_steps_total(comm->world_size);
    c.sequence = comm->sequence;
    c.rotation = comm->sequence % comm->world_size;
    c.layout_tag = layout_tag_of(args, comm->options.chunk_bytes);
    c.silent_rank = UDT_NO_RANK;
    c.mismatched_rank = -1;
    c.start_ns = start;
    c.deadline_ns = start + (uint64_t)(args->deadline_s * 1e9);
    if (comm->early_credit_sequence == c.sequence) {
        c.credit_limit = comm->early_credit;
        c.credited = c.heard_downstream = 1;
    }
    uint64_t drops_before = comm->transport->counter_injected_drops;
    int rc = prepare(&c);
    if (rc == UDT_OK) {
        rc = run_steps(&c);
        if (rc < 0) {
            snprintf(comm->error, sizeof comm->error, "%s", comm->transport->error);
            rc = UDT_ERR_TRANSPORT;
        }
    }
    stats->injected_drops = comm->transport->counter_injected_drops - drops_before;
    if (rc == UDT_OK) {
        stats->delivered_fraction = delivered_fraction(&c);
        stats->silent_rank = c.silent_rank == UDT_NO_RANK ? -1 : c.silent_rank;
        stats->mismatched_rank = c.mismatched_rank;
        if (c.mismatched_rank >= 0 && stats->datagrams_received == 0) {
            snprintf(comm->error, sizeof comm->error, "rank %d called allreduce with another element count, dtype or op", c.mismatched_rank);
            rc = UDT_ERR_LAYOUT_MISMATCH;
        } else if (stats->silent_rank >= 0) {
            snprintf(comm->error, sizeof comm->error, "rank %d sent nothing within the %.3f s deadline", stats->silent_rank, args->deadline_s);
            rc = UDT_ERR_PEER_TIMEOUT;
        } else if (1.0 - stats->delivered_fraction > args->loss_budget + 1e-12) {
            snprintf(comm->error, sizeof comm->error, "%.2f%% of contributions missing, budget %.2f%%",
                     100.0 * (1.0 - stats->delivered_fraction), 100.0 * args->loss_budget);
            rc = UDT_ERR_LOSS_BUDGET;
        } else {
            write_result(&c);
        }
    }
    stats->elapsed_s = (double)(now_ns() - start) * 1e-9;
    return rc;
}

struct udt_comm *udt_comm_create(struct udt_transport *transport, uint32_t rank, uint32_t world_size, uint64_t session_id,
                                 const struct udt_engine_options *options, char *error, int error_bytes)
{
    if (world_size == 0 || rank >= world_size || world_size >= UDT_NO_RANK) {
        snprintf(error, (size_t)error_bytes, "rank %u is not in a world of %u", rank, world_size);
        return NULL;
    }
    if (world_size > UDT_MAX_WORLD) {
        snprintf(error, (size_t)error_bytes, "world sizes above %d are not supported yet (got %u)", UDT_MAX_WORLD, world_size);
        return NULL;
    }
    uint32_t max_chunk = transport->max_datagram_bytes - UDT_WIRE_HEADER_BYTES;
    if (options->chunk_bytes == 0 || options->chunk_bytes > max_chunk) {
        snprintf(error, (size_t)error_bytes, "chunk_bytes %u must be between 1 and %u (the transport's datagram size minus the %u-byte header)",
                 options->chunk_bytes, max_chunk, UDT_WIRE_HEADER_BYTES);
        return NULL;
    }
    struct udt_comm *comm = calloc(1, sizeof *comm);
    if (!comm) {
        snprintf(error, (size_t)error_bytes, "out of memory");
        return NULL;
    }
    comm->staging = malloc((size_t)SEND_BATCH * options->chunk_bytes);
    if (!comm->staging) {
        free(comm);
        snprintf(error, (size_t)error_bytes, "out of memory");
        return NULL;
    }
    comm->transport = transport;
    comm->rank = rank;
    comm->world_size = world_size;
    comm->session_id = session_id;
    comm->options = *options;
    if (comm->options.end_repeats == 0)
        comm->options.end_repeats = 1;
    return comm;
}

int udt_comm_set_peers(struct udt_comm *comm, const uint8_t *addresses, uint32_t address_bytes)
{
    int rc = udt_transport_set_peers(comm->transport, addresses, address_bytes, comm->world_size);
    if (rc < 0)
        snprintf(comm->error, sizeof comm->error, "%s", comm->transport->error);
    return rc;
}

void udt_comm_destroy(struct udt_comm *comm)
{
    if (!comm)
        return;
    udt_transport_destroy(comm->transport);
    free(comm->scratch);
    free(comm->chunk_state);
    free(comm->staging);
    free(comm);
}

const char *udt_comm_error(const struct udt_comm *comm) { return comm->error; }
uint32_t udt_comm_chunk_bytes(const struct udt_comm *comm) { return comm->options.chunk_bytes; }
