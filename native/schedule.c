/* Schedule builders: the ring and the direct (transpose) exchange, as step
 * tables. Each builder is a few lines that read like the algorithm. */
#include "schedule.h"

#include <string.h>

static uint32_t wrap(int64_t value, uint32_t n)
{
    int64_t m = value % (int64_t)n;
    return (uint32_t)(m < 0 ? m + n : m);
}

struct builder {
    uint32_t rank, n, rotation;
    uint32_t holder; /* a broadcast's root, which holds every block: the gather sends it nothing (n: none) */
    struct udt_step *steps;
    uint32_t next; /* index of the next step to fill */
};

static uint32_t block(const struct builder *b, int64_t virtual_block) { return wrap(virtual_block + b->rotation, b->n); }

static struct udt_step *add_step(struct builder *b, uint8_t phase)
{
    struct udt_step *s = &b->steps[b->next++];
    memset(s, 0, sizeof *s);
    s->send_peer = UDT_NO_PEER;
    s->recv_peer = UDT_NO_PEER;
    s->send_after = UDT_NO_STEP;
    s->phase = phase;
    s->recv_contributions = (uint16_t)b->n;
    return s;
}

static void set_send(struct udt_step *s, uint32_t peer, uint32_t block_index, int32_t after)
{
    s->send_peer = (int32_t)peer;
    s->send_block = block_index;
    s->send_after = after;
}

static void set_recv(struct udt_step *s, uint32_t peer, uint32_t block_index, uint8_t mode)
{
    s->recv_peer = (int32_t)peer;
    s->recv_block = block_index;
    s->recv_mode = mode;
}

/* Ring reduce-scatter, N-1 steps: send block r-g downstream (what we summed
 * in the previous step), add block r-g-1 from upstream. We end owning r+1. */
static void ring_reduce(struct builder *b)
{
    uint32_t up = wrap((int64_t)b->rank - 1, b->n), down = wrap((int64_t)b->rank + 1, b->n);
    for (uint32_t g = 0; g + 1 < b->n; g++) {
        struct udt_step *s = add_step(b, UDT_PHASE_REDUCE);
        set_send(s, down, block(b, (int64_t)b->rank - g), g == 0 ? UDT_NO_STEP : (int32_t)b->next - 2);
        set_recv(s, up, block(b, (int64_t)b->rank - g - 1), UDT_RECV_REDUCE);
        s->recv_contributions = (uint16_t)(g + 1); /* the partial upstream summed over g + 1 ranks */
    }
}

/* Ring all-gather, N-1 steps: forward block r+1-t (owned, or just received),
 * overwrite block r-t from upstream. `first_after` gates the first send. A
 * holder (a broadcast's root) receives nothing and sends from what it holds,
 * and its upstream neighbour sends it nothing. */
static void ring_gather(struct builder *b, int32_t first_after)
{
    uint32_t up = wrap((int64_t)b->rank - 1, b->n), down = wrap((int64_t)b->rank + 1, b->n);
    for (uint32_t t = 0; t + 1 < b->n; t++) {
        struct udt_step *s = add_step(b, UDT_PHASE_GATHER);
        if (down != b->holder)
            set_send(s, down, block(b, (int64_t)b->rank + 1 - t),
                     t == 0 || b->rank == b->holder ? first_after : (int32_t)b->next - 2);
        if (b->rank != b->holder)
            set_recv(s, up, block(b, (int64_t)b->rank - t), UDT_RECV_OVERWRITE);
    }
}

/* Direct reduce-scatter, N-1 rounds: in round k send our piece of block r+k
 * to its owner r+k, and add r-k's piece of our block r. The stagger (round k
 * serves r+k) keeps N-1 senders from converging on one owner at once. */
static void direct_reduce(struct builder *b)
{
    for (uint32_t k = 1; k < b->n; k++) {
        struct udt_step *s = add_step(b, UDT_PHASE_REDUCE);
        set_send(s, wrap((int64_t)b->rank + k, b->n), block(b, (int64_t)b->rank + k), UDT_NO_STEP);
        set_recv(s, wrap((int64_t)b->rank - k, b->n), block(b, b->rank), UDT_RECV_REDUCE);
        s->recv_contributions = 1; /* the sender's own input, nothing else */
    }
}

/* Direct all-gather, N-1 rounds: send our (final) block r to r+k, take
 * block r-k from its owner. */
static void direct_gather(struct builder *b, int32_t send_after)
{
    for (uint32_t k = 1; k < b->n; k++) {
        struct udt_step *s = add_step(b, UDT_PHASE_GATHER);
        if (wrap((int64_t)b->rank + k, b->n) != b->holder) /* a holder needs nothing */
            set_send(s, wrap((int64_t)b->rank + k, b->n), block(b, b->rank), send_after);
        if (b->rank != b->holder)
            set_recv(s, wrap((int64_t)b->rank - k, b->n), block(b, (int64_t)b->rank - k), UDT_RECV_OVERWRITE);
    }
}

/* All-to-all, N-1 rounds: in round k send input block r+k to rank r+k, take
 * output block r-k from rank r-k: each piece travels once, straight to the
 * rank it is for (the direct reduce-scatter's pattern, nothing summed). Sends
 * read the input and receives write the output, so no receive waits on a
 * send and nothing is relayed. */
static void all_to_all(struct builder *b)
{
    for (uint32_t k = 1; k < b->n; k++) {
        struct udt_step *s = add_step(b, UDT_PHASE_GATHER);
        set_send(s, wrap((int64_t)b->rank + k, b->n), wrap((int64_t)b->rank + k, b->n), UDT_NO_STEP);
        set_recv(s, wrap((int64_t)b->rank - k, b->n), wrap((int64_t)b->rank - k, b->n), UDT_RECV_OVERWRITE);
        s->recv_contributions = 1;
    }
}

/* Broadcast's first half, N-1 rounds: the root hands block root+k to rank
 * root+k in round k; every other rank receives its own block once. */
static void scatter_from_root(struct builder *b, uint32_t root)
{
    uint32_t distance = wrap((int64_t)b->rank - root, b->n);
    for (uint32_t k = 1; k < b->n; k++) {
        struct udt_step *s = add_step(b, UDT_PHASE_REDUCE);
        if (b->rank == root)
            set_send(s, wrap((int64_t)root + k, b->n), block(b, (int64_t)root + k), UDT_NO_STEP);
        else if (k == distance)
            set_recv(s, root, block(b, b->rank), UDT_RECV_OVERWRITE);
    }
}

/* Gather, N-1 rounds: in round k rank root+k sends its block to the root,
 * which takes it; each piece crosses the network once and only the root
 * receives. The root grants its credit window step by step, so senders of
 * blocks larger than the window go roughly one after another. */
static void gather_to_root(struct builder *b, uint32_t root)
{
    uint32_t distance = wrap((int64_t)b->rank - root, b->n);
    for (uint32_t k = 1; k < b->n; k++) {
        struct udt_step *s = add_step(b, UDT_PHASE_GATHER);
        if (b->rank == root)
            set_recv(s, wrap((int64_t)root + k, b->n), wrap((int64_t)root + k, b->n), UDT_RECV_OVERWRITE);
        else if (k == distance)
            set_send(s, root, b->rank, UDT_NO_STEP);
        s->recv_contributions = 1;
    }
}

/* For each receive: how many sends must be done before it may land (the
 * last send at or before it that reads the same block). `last_send` holds
 * one entry per block. */
static void mark_receive_hazards(struct udt_step *steps, uint32_t count, uint32_t blocks, uint32_t *last_send)
{
    memset(last_send, 0, blocks * sizeof *last_send); /* 0 = no send yet, else step + 1 */
    for (uint32_t g = 0; g < count; g++) {
        if (steps[g].send_peer != UDT_NO_PEER)
            last_send[steps[g].send_block] = g + 1;
        if (steps[g].recv_peer != UDT_NO_PEER)
            steps[g].recv_needs_sent = last_send[steps[g].recv_block];
    }
}

static const struct udt_collective_facts FACTS[UDT_COLLECTIVE_COUNT] = {
    [UDT_ALLREDUCE] = {.name = "allreduce", .moves_data = 1, .reduces = 1, .gathers = 1, .rotates = 1, .may_sum_in_place = 1,
                       .output = UDT_OUTPUT_REDUCED},
    [UDT_REDUCE_SCATTER] = {.name = "reduce_scatter", .moves_data = 1, .reduces = 1, .output_is_shard = 1,
                            .mask_by_sender = 1, .output = UDT_OUTPUT_REDUCED_SHARD},
    [UDT_ALL_GATHER] = {.name = "all_gather", .moves_data = 1, .gathers = 1, .input_is_shard = 1, .holds_own_block = 1,
                        .output = UDT_OUTPUT_GATHERED},
    [UDT_BROADCAST] = {.name = "broadcast", .moves_data = 1, .gathers = 1, .root_holds_all = 1, .output = UDT_OUTPUT_GATHERED},
    [UDT_AGREE] = {.name = "agree", .output = UDT_OUTPUT_NONE},
    [UDT_ALL_TO_ALL] = {.name = "all_to_all", .moves_data = 1, .gathers = 1, .sends_input = 1, .holds_own_block = 1,
                        .equal_blocks = 1, .output = UDT_OUTPUT_GATHERED},
    [UDT_SCATTER] = {.name = "scatter", .moves_data = 1, .gathers = 1, .root_holds_all = 1, .wants = UDT_WANTS_OWN_BLOCK,
                     .output = UDT_OUTPUT_GATHERED},
    [UDT_GATHER] = {.name = "gather", .moves_data = 1, .gathers = 1, .input_is_shard = 1, .sends_input = 1, .holds_own_block = 1,
                    .wants = UDT_WANTS_ALL_AT_ROOT, .output = UDT_OUTPUT_GATHERED},
};

const struct udt_collective_facts *udt_collective_facts(int collective)
{
    return collective >= 0 && collective < UDT_COLLECTIVE_COUNT ? &FACTS[collective] : NULL;
}

uint32_t udt_schedule_steps(int collective, int algorithm, uint32_t world_size)
{
    (void)algorithm;
    if (world_size < 2)
        return 0;
    switch (collective) {
    case UDT_ALLREDUCE:
    case UDT_BROADCAST:
        return 2 * (world_size - 1);
    case UDT_REDUCE_SCATTER:
    case UDT_ALL_GATHER:
    case UDT_ALL_TO_ALL:
    case UDT_SCATTER:
    case UDT_GATHER:
        return world_size - 1;
    default:
        return 0;
    }
}

int udt_schedule_build(int collective, int algorithm, uint32_t rank, uint32_t world_size, uint32_t root, uint32_t rotation,
                       struct udt_schedule *schedule, struct udt_step *out, uint32_t *block_scratch)
{
    if (collective < 0 || collective >= UDT_COLLECTIVE_COUNT || algorithm < 0 || algorithm >= UDT_ALGORITHM_COUNT ||
        world_size == 0 || rank >= world_size || root >= world_size)
        return -1;
    struct builder b = {.rank = rank, .n = world_size, .rotation = rotation % world_size, .holder = world_size, .steps = out,
                        .next = 0};
    int ring = algorithm == UDT_ALGORITHM_RING;
    uint32_t n = world_size;
    memset(schedule, 0, sizeof *schedule);
    schedule->facts = udt_collective_facts(collective);
    schedule->world_size = n;
    schedule->finalize_after = UDT_NO_STEP;
    schedule->owned_block = block(&b, ring && collective == UDT_ALLREDUCE ? (int64_t)rank + 1 : rank);
    if (n > 1) {
        int32_t last_first_half = (int32_t)n - 2;
        switch (collective) {
        case UDT_ALLREDUCE:
            ring ? ring_reduce(&b) : direct_reduce(&b);
            schedule->finalize_after = last_first_half;
            ring ? ring_gather(&b, last_first_half) : direct_gather(&b, last_first_half);
            schedule->reduce_steps = n - 1;
            schedule->critical_path = ring ? 2 * (int32_t)(n - 1) : 2;
            break;
        case UDT_REDUCE_SCATTER:
            /* rank r ends owning block r: the ring's natural owner is r+1 */
            if (ring)
                b.rotation = wrap((int64_t)rotation - 1, n);
            ring ? ring_reduce(&b) : direct_reduce(&b);
            schedule->owned_block = rank;
            schedule->finalize_after = last_first_half;
            schedule->reduce_steps = n - 1;
            schedule->critical_path = ring ? (int32_t)(n - 1) : 1;
            break;
        case UDT_ALL_GATHER:
            if (ring)
                b.rotation = wrap((int64_t)rotation - 1, n);
            ring ? ring_gather(&b, UDT_NO_STEP) : direct_gather(&b, UDT_NO_STEP);
            schedule->owned_block = rank;
            schedule->critical_path = ring ? (int32_t)(n - 1) : 1;
            break;
        case UDT_BROADCAST:
            scatter_from_root(&b, root);
            b.holder = root; /* it has every block: nobody sends it one back */
            schedule->reduce_steps = n - 1;
            if (rank != root)
                schedule->finalize_after = (int32_t)wrap((int64_t)rank - root, n) - 1;
            if (ring)
                b.rotation = wrap((int64_t)rotation - 1, n);
            ring ? ring_gather(&b, last_first_half) : direct_gather(&b, last_first_half);
            schedule->owned_block = rank;
            schedule->critical_path = ring ? (int32_t)n : 2;
            break;
        case UDT_ALL_TO_ALL: /* one schedule whatever the algorithm: a ring would relay every piece */
            all_to_all(&b);
            schedule->owned_block = rank;
            schedule->critical_path = 1;
            break;
        case UDT_SCATTER: /* a broadcast's first half alone; one schedule whatever the algorithm */
            scatter_from_root(&b, root);
            schedule->owned_block = rank;
            schedule->critical_path = 1;
            break;
        case UDT_GATHER:
            gather_to_root(&b, root);
            schedule->owned_block = rank;
            schedule->critical_path = 1;
            break;
        default: /* UDT_AGREE: no data */
            break;
        }
    }
    schedule->steps = b.next;
    if (collective == UDT_ALL_TO_ALL) { /* input and output are apart: no hazards, every piece whole */
        for (uint32_t g = 0; g < b.next; g++)
            out[g].recv_whole = 1;
        return 0;
    }
    mark_receive_hazards(out, b.next, world_size, block_scratch);
    if (collective == UDT_SCATTER || collective == UDT_GATHER) { /* every piece comes whole from the rank that holds it */
        for (uint32_t g = 0; g < b.next; g++)
            out[g].recv_whole = 1;
        return 0;
    }
    /* whole blocks: every reduce step (each rank holds its input everywhere, a
     * scatter comes from the root), a broadcast's root, and an owner sending
     * its final block (direct gather, the ring's first gather step) */
    uint32_t first_gather = collective == UDT_ALL_GATHER ? 0 : n - 1;
    for (uint32_t g = 0; g < b.next; g++)
        if (out[g].recv_peer != UDT_NO_PEER)
            out[g].recv_whole = out[g].phase == UDT_PHASE_REDUCE ||
                                (collective == UDT_BROADCAST ? out[g].recv_peer == (int32_t)root : !ring || g == first_gather);
    return 0;
}
