/* The caller's buffers: originals saved before an in-place tensor changes and put back if the
 * call fails, the owned block's rescaling, what the result delivered, and the write-out of the
 * output and the chunk mask once the verdict is OK. */
#include "engine_internal.h"

#include <string.h>

#include "blocks.h"
#include "elementwise.h"

/* In place, a chunk's original goes to the scratch before the tensor changes, to be put back
 * if the call fails (restore_originals); nothing else reads it, so the copy bypasses the cache.
 * Until the chunk changes (SCRATCH_VALID) the tensor itself holds our input. Sending a chunk
 * saves it too, so the tensor is read once for both and sent from the cache. The chunks after
 * it in its block go with it while they are unsaved (so unchanged): one copy of up to 64 KiB,
 * not one per MTU-sized chunk. 2 ranks, loopback, 64 MiB: a cached save that the send and the
 * sum then read cost a read of the scratch from memory on top, and evicted the tensor. */
void udt_save_original(struct call *c, uint32_t block, uint32_t chunk)
{
    uint64_t base = c->geometry.chunk_base[block];
    if (!c->output.in_place || (c->chunks.chunk_flags[base + chunk] & ORIGINAL_SAVED))
        return;
    uint32_t end = chunk, chunks = chunks_in_block(c, block);
    uint64_t bytes = 0;
    do {
        c->chunks.chunk_flags[base + end] |= ORIGINAL_SAVED;
        bytes += chunk_length(c, block, end) * c->geometry.wire_bytes;
        end++;
    } while (end < chunks && bytes < SAVE_AHEAD_BYTES && !(c->chunks.chunk_flags[base + end] & ORIGINAL_SAVED));
    uint64_t first = chunk_first_element(c, block, chunk);
    uint8_t *to = c->output.saved + first * c->geometry.wire_bytes;
    const uint8_t *from = c->output.accum + first * c->geometry.wire_bytes;
    if (bytes >= UNCACHED_MIN_BYTES)
        udt_copy_uncached(to, from, bytes);
    else
        memcpy(to, from, bytes);
}

/* Elements summed at once in rank order: their partial sums stay in registers and cache. */
#define RANK_ORDER_RUN 256

/* reduce_in_rank_order: each element of a chunk becomes rank 0's contribution plus rank 1's and
 * so on, in double precision, divided by N for a mean, rounded once to the caller's type: what
 * ud_transport.exact's _reduce_rows computes, bit for bit. Every row is read before a run of the
 * result is written, so in place our own row (the tensor) may be the target. */
static void reduce_in_rank_order(struct call *c, uint32_t block, uint64_t first, uint64_t elements, uint8_t *value)
{
    uint64_t offset = first - c->geometry.block_first[block];
    size_t wire = c->geometry.wire_bytes;
    int single = c->args.dtype == UDT_FLOAT32;
    double sums[RANK_ORDER_RUN];
    for (uint64_t done = 0; done < elements; done += RANK_ORDER_RUN) {
        uint64_t run = elements - done < RANK_ORDER_RUN ? elements - done : RANK_ORDER_RUN;
        for (uint32_t p = 0; p < c->n; p++) {
            const uint8_t *row = p == c->rank ? input_at(c, first + done) : udt_rank_row(c, p, offset + done);
            for (uint64_t i = 0; i < run; i++) { /* -O3 takes the branches out of the loop */
                double x = single ? ((const float *)row)[i] : ((const double *)row)[i];
                sums[i] = p == 0 ? x : sums[i] + x;
            }
        }
        if (c->args.op == UDT_OP_MEAN)
            for (uint64_t i = 0; i < run; i++)
                sums[i] /= c->n;
        if (single)
            for (uint64_t i = 0; i < run; i++)
                ((float *)value)[done + i] = (float)sums[i];
        else
            memcpy(value + done * wire, sums, run * wire);
    }
}

/* The owner's block is complete: rescale each chunk by N / contributions so
 * its expectation is the full sum (or, in rank order, reduce its rows). */
void udt_finalize_owned_block(struct call *c)
{
    if (!c->schedule.facts->reduces)
        return;
    uint32_t block = c->schedule.owned_block, chunk_count = chunks_in_block(c, block);
    uint64_t base = c->geometry.chunk_base[block];
    for (uint32_t chunk = 0; chunk < chunk_count; chunk++) {
        uint64_t id = base + chunk;
        uint64_t first = chunk_first_element(c, block, chunk), elements = chunk_length(c, block, chunk);
        uint8_t *value = c->output.accum + first * c->geometry.accum_bytes;
        udt_save_original(c, block, chunk);
        if (c->output.rank_rows) {
            /* a chunk some contribution missed fails the call (its budget is 0): it keeps our input */
            if (c->chunks.rs_count[id] == c->n)
                reduce_in_rank_order(c, block, first, elements, value);
            else if (!c->output.in_place)
                udt_load(c->args.dtype, value, input_at(c, first), elements);
            c->chunks.chunk_flags[id] |= SCRATCH_VALID;
            c->chunks.final_count[id] = c->chunks.rs_count[id];
            continue;
        }
        if (!(c->chunks.chunk_flags[id] & SCRATCH_VALID)) {
            if (!c->output.in_place) /* in place the tensor holds our input already */
                udt_load(c->args.dtype, value, input_at(c, first), elements);
            c->chunks.chunk_flags[id] |= SCRATCH_VALID;
        }
        if (c->args.estimator == UDT_ESTIMATOR_UNBIASED && c->chunks.rs_count[id] != c->n)
            udt_scale(c->args.dtype, value, elements, (double)c->n / c->chunks.rs_count[id]);
        c->chunks.final_count[id] = c->chunks.rs_count[id];
    }
}

/* Fresh elements of this rank's result, scaled to the tensor's count where the result is part
 * of it (a scatter's block, a gather off its root), so that one number means the same share on
 * every rank and the verdict's least over ranks is the least share; rounded down, so a result
 * that lacks anything never reads as whole. (A sized all_to_all's outputs differ: a share of
 * udt_fresh_scale.) */
uint64_t udt_fresh_elements(const struct call *c)
{
    uint64_t scale = udt_fresh_scale(c);
    if (!c->schedule.facts->gathers)
        return scale;
    uint64_t fresh = 0, wanted = 0;
    for (uint32_t block = 0; block < c->n; block++) {
        if (!wants_block(c, block))
            continue;
        wanted += c->geometry.block_first[block + 1] - c->geometry.block_first[block];
        if (c->schedule.facts->holds_own_block && block == c->schedule.owned_block) {
            fresh += c->geometry.block_first[block + 1] - c->geometry.block_first[block];
            continue;
        }
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++)
            if (c->chunks.final_count[c->geometry.chunk_base[block] + chunk])
                fresh += chunk_length(c, block, chunk);
    }
    if (wanted == scale)
        return fresh;
    if (wanted == 0) /* an empty block: nothing to lack */
        return scale;
    unsigned __int128 missing = (unsigned __int128)(wanted - fresh) * scale;
    return scale - (uint64_t)((missing + wanted - 1) / wanted);
}

/* In the verdict: contributions x elements of our shard; a sized all_to_all, which sums
 * nothing, carries its checksum of the pieces' sizes there instead (pieces.c). */
uint64_t udt_reduce_weighted(const struct call *c)
{
    if (c->args.piece_counts)
        return udt_pieces_checksum(c);
    if (!c->schedule.facts->reduces)
        return 0;
    uint32_t block = c->schedule.owned_block;
    uint64_t weighted = 0;
    for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++)
        weighted += (uint64_t)c->chunks.rs_count[c->geometry.chunk_base[block] + chunk] * chunk_length(c, block, chunk);
    return weighted;
}

/* allreduce, per chunk: the owner's estimate if it reached us; otherwise our
 * own reduce-scatter partial, rescaled (unbiased) or zero (baseline). */
static double allreduce_factor(const struct call *c, uint64_t id, uint16_t *contributions)
{
    double mean = c->args.op == UDT_OP_MEAN && !c->output.rank_rows ? 1.0 / c->n : 1.0; /* in rank order: divided already */
    if (c->chunks.final_count[id]) {
        *contributions = c->chunks.final_count[id];
        return mean;
    }
    if (c->args.estimator == UDT_ESTIMATOR_ZERO_FILL) {
        *contributions = 0;
        return 0.0;
    }
    *contributions = c->chunks.rs_count[id];
    return mean * c->n / c->chunks.rs_count[id];
}

double udt_delivered_fraction(const struct call *c)
{
    if (c->args.count == 0)
        return 1.0;
    switch (c->schedule.facts->output) {
    case UDT_OUTPUT_REDUCED_SHARD: {
        uint64_t length = c->geometry.block_first[c->rank + 1] - c->geometry.block_first[c->rank];
        return length ? (double)udt_reduce_weighted(c) / ((double)c->n * (double)length) : 1.0;
    }
    case UDT_OUTPUT_GATHERED:
        return (double)udt_fresh_elements(c) / (double)udt_fresh_scale(c);
    case UDT_OUTPUT_REDUCED:
        break;
    default:
        return 1.0;
    }
    double delivered = 0;
    for (uint32_t block = 0; block < c->n; block++) {
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint16_t contributions;
            allreduce_factor(c, c->geometry.chunk_base[block] + chunk, &contributions);
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
        memmove(r->out, r->src, r->elements * c->geometry.wire_bytes);
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
    size_t src_bytes = kind == WRITE_STORE ? c->geometry.accum_bytes : c->geometry.wire_bytes;
    if (r->kind == kind && r->factor == factor && r->out + r->elements * c->geometry.wire_bytes == out &&
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
            uint64_t id = c->geometry.chunk_base[block] + chunk;
            double factor = allreduce_factor(c, id, &contributions);
            uint64_t first = chunk_first_element(c, block, chunk), elements = chunk_length(c, block, chunk);
            if (c->chunks.chunk_flags[id] & SCRATCH_VALID)
                write_chunk(c, &run, WRITE_STORE, factor, out + first * c->geometry.wire_bytes, c->output.accum + first * c->geometry.accum_bytes,
                            elements);
            else /* a hole where nothing ever arrived: our own input, rescaled in place */
                write_chunk(c, &run, WRITE_RESCALE, factor, out + first * c->geometry.wire_bytes, NULL, elements);
        }
    }
    flush_run(c, &run);
}

/* The input that holds output element `element` of `block` (where a sized all_to_all's own
 * piece sits in the input is not where it goes in the output). */
static const uint8_t *held_input(const struct call *c, uint32_t block, uint64_t element)
{
    return input_at(c, element - c->geometry.block_first[block] + c->geometry.send_first[block]);
}

/* Gathered outputs: fresh chunks take the new value, stale ones keep theirs. */
static void write_gathered(struct call *c)
{
    uint8_t *out = c->args.output;
    struct write_run run = {0};
    for (uint32_t block = 0; block < c->n; block++) {
        int own_input = c->schedule.facts->holds_own_block && block == c->schedule.owned_block;
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint64_t id = c->geometry.chunk_base[block] + chunk;
            uint64_t first = chunk_first_element(c, block, chunk), elements = chunk_length(c, block, chunk);
            uint8_t *target = out + first * c->geometry.wire_bytes;
            int in_scratch = (c->chunks.chunk_flags[id] & SCRATCH_VALID) && !own_input;
            if (own_input || (!in_scratch && c->chunks.final_count[id] && held_input(c, block, first) != target))
                write_chunk(c, &run, WRITE_MOVE, 1.0, target, held_input(c, block, first), elements);
            else if (in_scratch && c->chunks.final_count[id] && !c->output.direct_output) /* direct: it is there already */
                write_chunk(c, &run, WRITE_STORE, 1.0, target, c->output.accum + first * c->geometry.accum_bytes, elements);
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
    uint64_t total = 0; /* one per chunk of the tensor */
    for (uint32_t b = 0; b < world_size; b++)
        total += udt_chunks_for(udt_block_length(count, world_size, b), chunk_elements);
    return total;
}

/* The caller's chunk mask (see udt_collective_args): whose contributions reached this
 * rank's shard, or which chunks of the output are fresh. */
static void write_chunk_mask(struct call *c)
{
    uint8_t *mask = c->args.chunk_mask;
    if (!c->schedule.facts->mask_by_sender) { /* a chunk outside this rank's result lacks nothing: 1 */
        for (uint32_t block = 0; block < c->n; block++) {
            int wanted = wants_block(c, block);
            for (uint64_t id = c->geometry.chunk_base[block]; id < c->geometry.chunk_base[block + 1]; id++)
                mask[id] = !wanted || c->chunks.final_count[id] != 0;
        }
        return;
    }
    uint32_t block = c->schedule.owned_block, chunks = chunks_in_block(c, block);
    memset(mask, 0, (size_t)c->n * chunks);
    memset(mask + (size_t)c->rank * chunks, 1, chunks); /* our own contribution is always in */
    for (uint32_t s = 0; s < c->schedule.steps; s++) {
        const struct udt_step *step = &c->step[s];
        if (step->recv_peer == UDT_NO_PEER || step->recv_mode != UDT_RECV_REDUCE || step->recv_block != block)
            continue;
        const uint8_t *bits = c->chunks.arrival_bits + (size_t)s * c->geometry.bitmap_bytes;
        for (uint32_t k = 0; k < chunks; k++)
            mask[(size_t)step->recv_peer * chunks + k] = (bits[k / 8] >> (k % 8)) & 1u;
    }
}

/* In place, a call that fails leaves the tensor as it found it: every chunk saved is put back
 * (a saved chunk may not have changed; putting it back is then harmless). */
void udt_restore_originals(struct call *c)
{
    if (!c->output.in_place)
        return;
    for (uint32_t block = 0; block < c->n; block++)
        for (uint32_t chunk = 0; chunk < chunks_in_block(c, block); chunk++) {
            uint64_t id = c->geometry.chunk_base[block] + chunk;
            if (!(c->chunks.chunk_flags[id] & ORIGINAL_SAVED))
                continue;
            uint64_t first = chunk_first_element(c, block, chunk);
            memcpy(c->output.accum + first * c->geometry.wire_bytes, c->output.saved + first * c->geometry.wire_bytes,
                   chunk_length(c, block, chunk) * c->geometry.wire_bytes);
            c->chunks.chunk_flags[id] &= (uint8_t)~ORIGINAL_SAVED;
        }
    c->output.in_place = 0;
}

int udt_write_output(struct call *c)
{
    if (c->args.chunk_mask)
        write_chunk_mask(c);
    c->stats->chunks_stale = 0;
    for (uint32_t block = 0; c->schedule.facts->gathers && block < c->n; block++) {
        if (!wants_block(c, block))
            continue; /* not this rank's to receive */
        for (uint64_t id = c->geometry.chunk_base[block]; id < c->geometry.chunk_base[block + 1]; id++)
            c->stats->chunks_stale += c->chunks.final_count[id] == 0;
    }
    switch (c->schedule.facts->output) {
    case UDT_OUTPUT_REDUCED:
        write_allreduce(c);
        break;
    case UDT_OUTPUT_REDUCED_SHARD: {
        uint32_t block = c->schedule.owned_block;
        double mean = c->args.op == UDT_OP_MEAN && !c->output.rank_rows ? 1.0 / c->n : 1.0; /* in rank order: divided already */
        uint64_t first = c->geometry.block_first[block], length = c->geometry.block_first[block + 1] - first;
        if (length)
            udt_store(c->args.dtype, c->args.output, c->output.accum + first * c->geometry.accum_bytes, length, mean);
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
