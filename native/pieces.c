/* An all_to_all whose pieces each have their own size (udt_collective_args.piece_counts), as a
 * mixture of experts routes a different number of tokens to each rank every step. Each rank
 * knows only its own pieces' sizes (torch's all_to_all_single gives every rank what it sends and
 * what it takes), and nothing is exchanged to learn the others': the output's blocks are the
 * pieces this rank takes, the input's the pieces it sends, and the verdict carries a checksum in
 * which every piece counts once as sent and once as taken. It sums to 0 over the ranks when every
 * sender and its receiver agree, so a disagreement fails the call alike on every rank (verdict.c)
 * instead of padding every piece to the widest or sending the sizes first. */
#include "engine_internal.h"

#include "blocks.h"
#include "elementwise.h"

/* Positions on the wire are step * stride + chunk: below 2^32 with room for a window of up to
 * 256 MiB. A rank knows only its own pieces, so the stride is what every rank computes alike from
 * the world size alone; a piece may then have up to 2^32 / (4.6 world size) chunks. */
#define POSITIONS_ROOM 0xE0000000ull
#define WINDOW_ROOM 0x10000000ull
/* Counts past this (2^48 elements) are refused: their sums cannot wrap. */
#define MOST_ELEMENTS (1ull << 48)

uint32_t udt_pieces_stride(uint32_t steps) { return (uint32_t)(POSITIONS_ROOM / ((uint64_t)steps + 1) - 1); }

uint64_t udt_pieces_input_count(const struct udt_collective_args *a, uint32_t world_size)
{
    uint64_t sent = 0;
    for (uint32_t q = 0; q < world_size; q++)
        sent += a->piece_counts[q];
    return sent;
}

const char *udt_pieces_refusal(const struct udt_comm *comm, const struct udt_collective_args *a)
{
    const struct udt_collective_facts *facts = udt_collective_facts(a->collective);
    uint32_t n = comm->world_size;
    if (!facts->equal_blocks) /* the collective whose blocks are pieces between pairs (all_to_all) */
        return "piece_counts: only an all_to_all has pieces of their own sizes";
    uint64_t chunk_elements = comm->options.chunk_bytes / udt_wire_elem_bytes(a->dtype);
    uint32_t stride = udt_pieces_stride(udt_schedule_steps(a->collective, a->algorithm, n));
    uint64_t taken = 0, chunks = 0;
    for (uint32_t k = 0; k < 2 * n; k++) {
        if (a->piece_counts[k] >= MOST_ELEMENTS || (chunk_elements && udt_chunks_for(a->piece_counts[k], chunk_elements) >= stride))
            return "piece_counts: a piece of too many chunks for one call (raise chunk_bytes)";
        if (k >= n) {
            taken += a->piece_counts[k];
            chunks += chunk_elements ? udt_chunks_for(a->piece_counts[k], chunk_elements) : 0;
        }
    }
    if (taken != a->count)
        return "piece_counts: the pieces taken must sum to count";
    if (n == 1 && a->piece_counts[0] != a->piece_counts[1]) /* no verdict round to find it */
        return "piece_counts: a world of one takes from itself what it sends";
    if (comm->options.window_bytes >= WINDOW_ROOM)
        return "window_bytes: 256 MiB or more, too large for an all_to_all with piece_counts";
    if (a->chunk_mask && a->chunk_mask_bytes != chunks)
        return "chunk_mask_bytes: one per chunk of the pieces taken";
    return NULL;
}

/* The call's geometry from its pieces: block p of the output is what rank p sends us, block q of
 * the input what we send rank q. Returns the most chunks of any block taken (a bitmap's width). */
uint64_t udt_pieces_geometry(struct call *c)
{
    const uint64_t *counts = c->args.piece_counts;
    struct call_geometry *g = &c->geometry;
    uint64_t most = 0;
    g->block_first[0] = g->send_first[0] = g->chunk_base[0] = 0;
    for (uint32_t b = 0; b < c->n; b++) {
        uint64_t chunks = udt_chunks_for(counts[c->n + b], g->chunk_elements);
        g->send_first[b + 1] = g->send_first[b] + counts[b];
        g->block_first[b + 1] = g->block_first[b] + counts[c->n + b];
        g->chunk_base[b + 1] = g->chunk_base[b] + chunks;
        most = chunks > most ? chunks : most;
    }
    return most;
}

/* One piece's term, added by its sender and taken away by its receiver: where their counts
 * differ, what is left cancels out with another such difference with a chance of 2^-64. */
static uint64_t piece_term(uint32_t sender, uint32_t receiver, uint64_t elements)
{
    uint64_t x = (((uint64_t)sender << 32 | receiver) + 1) * 0x9E3779B97F4A7C15ull ^ elements;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull; /* splitmix64's finisher */
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* This rank's share of the checksum: what it sends each rank less what it takes from each (its
 * own piece too: where the two differ, the call fails before the output is written). The sum
 * over ranks, wrapping, is 0 when every pair agrees. */
uint64_t udt_pieces_checksum(const struct call *c)
{
    uint64_t sum = 0;
    for (uint32_t q = 0; q < c->n; q++)
        sum += piece_term(c->rank, q, c->args.piece_counts[q]) - piece_term(q, c->rank, c->args.piece_counts[c->n + q]);
    return sum;
}
