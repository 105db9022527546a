/* The credits a receiver hands out when a call starts (tests/test_credit_share.py): rank 0 of a
 * world of 8 starts a call over the in-memory transport, and the peers' endpoints read the
 * CREDIT datagrams it sent them. Prints, for each peer, the chunks its first credit covers in its
 * first step to rank 0 (0: no credit), then the window. The engine is native/ as built; the
 * other ranks are endpoints only, so nothing arrives and nothing is seen yet.
 *
 * With a third argument "arrive", rank 1's whole piece then arrives (a gather: the exchange may turn
 * from long to short), and a second line prints the chunks all senders together hold credit for
 * beyond what rank 0 has seen, then the window: never more than the window.
 *
 * With "tail" instead, rank 1 sends its piece only as far as its credits reach, on a clock that
 * never gets to the 2 ms refresh, and a second line prints how many chunks of the piece it could
 * send: all of them, when the credit that reaches a step's end goes out at once.
 *
 * With "empty" instead (allreduce only), the world is EMPTY_WORLD ranks, the window its floor of 16
 * chunks and the tensor EMPTY_COUNT elements: one element a block for the first ranks, none for the
 * last ones. Each of rank 0's reduce-scatter steps is one chunk, the window runs out before the
 * last senders' steps, and those senders' all-gather steps are empty. Only a line "outstanding N
 * window W" is printed: the chunks all senders hold credit for, never more than the window (a
 * credit walk that gave an empty step a position would credit its sender's uncovered step too).
 *
 * Usage: credit_share gather|all_to_all|allreduce CHUNKS [arrive|tail|empty] (CHUNKS: each sender's piece to rank 0) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "elementwise.h"
#include "engine.h"
#include "engine_internal.h"
#include "transport_memory.h"
#include "wire.h"

#define MAX_WORLD 32
#define EMPTY_WORLD 20
#define EMPTY_COUNT 17
#define CHUNK_BYTES 64                /* 16 float32 a chunk */
#define MAX_BLOCK_CHUNKS 1024
#define WINDOW_CHUNKS 192
#define SESSION 0x5566778899aabbccull

/* The chunks of rank 0's open receive steps, not yet seen, that their senders hold credit for. */
static uint64_t outstanding_credit(const struct udt_comm *comm)
{
    const struct call *c = &comm->call;
    uint64_t outstanding = 0;
    for (uint32_t g = c->data.recv_step; g < c->schedule.steps; g++) {
        int32_t p = c->step[g].recv_peer;
        if (p == UDT_NO_PEER || c->state[g].closed)
            continue;
        uint32_t from = g * c->geometry.max_chunks + c->state[g].seen_end, room = c->state[g].expected - c->state[g].seen_end;
        uint32_t granted = comm->peers[p].in_call.granted;
        uint32_t held = granted > from ? granted - from : 0;
        outstanding += held < room ? held : room;
    }
    return outstanding;
}

static int finish(struct udt_comm *comm, struct udt_transport **peers, uint32_t world, struct udt_memory_network *net)
{
    udt_comm_destroy(comm);
    for (uint32_t r = 1; r < world; r++)
        udt_transport_destroy(peers[r]);
    udt_memory_network_destroy(net);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3 && argc != 4)
        return 2;
    uint64_t block_chunks = strtoull(argv[2], NULL, 10);
    if (block_chunks < 1 || block_chunks > MAX_BLOCK_CHUNKS)
        return 2;
    int collective = strcmp(argv[1], "gather") == 0       ? UDT_GATHER
                     : strcmp(argv[1], "all_to_all") == 0 ? UDT_ALL_TO_ALL
                     : strcmp(argv[1], "allreduce") == 0  ? UDT_ALLREDUCE
                                                          : -1;
    if (collective < 0)
        return 2;
    int empty = argc == 4 && strcmp(argv[3], "empty") == 0;
    if (empty && collective != UDT_ALLREDUCE)
        return 2;
    uint32_t world = empty ? EMPTY_WORLD : 8;
    struct udt_memory_network *net = udt_memory_network_create(world, UDT_WIRE_HEADER_BYTES + CHUNK_BYTES);
    struct udt_transport *peers[MAX_WORLD] = {0};
    for (uint32_t r = 1; r < world; r++)
        peers[r] = udt_memory_open(net, r);
    struct udt_engine_options options = {.chunk_bytes = CHUNK_BYTES, .window_bytes = (empty ? 16 : WINDOW_CHUNKS) * CHUNK_BYTES,
                                         .end_repeats = 2, .credit_refresh_us = 2000, .reorder_grace_us = 200,
                                         .idle_close_us = 20000, .agree_resend_us = 1000, .join_timeout_ms = 1000};
    struct udt_error error;
    struct udt_comm *comm = udt_comm_create(udt_memory_open(net, 0), 0, world, SESSION, &options, &error);
    if (!comm)
        return 3;
    static float input[MAX_WORLD * MAX_BLOCK_CHUNKS * 16], output[MAX_WORLD * MAX_BLOCK_CHUNKS * 16];
    struct udt_collective_args args = {.collective = collective, .algorithm = UDT_ALGORITHM_DIRECT, .input = input,
                                       .output = output, .count = empty ? EMPTY_COUNT : world * block_chunks * 16, .dtype = UDT_FLOAT32, .op = UDT_OP_SUM,
                                       .estimator = UDT_ESTIMATOR_UNBIASED, .root = 0, .loss_budget = 1.0,
                                       .deadline_s = 1.0};
    struct udt_collective_stats stats;
    if (udt_call_start(comm, &args, &stats, 1000000000ull) != UDT_OK) {
        fprintf(stderr, "%s\n", udt_comm_error(comm)->message);
        return 3;
    }
    uint32_t max_chunks = (uint32_t)comm->call.geometry.max_chunks, first_covered[MAX_WORLD] = {0};
    if (empty) {
        printf("outstanding %llu window %u\n", (unsigned long long)outstanding_credit(comm), comm->call.data.window_chunks);
        return finish(comm, peers, world, net);
    }
    for (uint32_t r = 1; r < world; r++) {
        uint32_t covered = 0; /* the largest credit's chunks past the start of the step it falls in */
        struct udt_recv_item items[16];
        int got;
        while ((got = udt_transport_recv(peers[r], items, 16)) > 0)
            for (int i = 0; i < got; i++) {
                struct udt_wire_header h;
                if (udt_wire_decode(items[i].data, items[i].bytes, &h) != 0 || h.kind != UDT_KIND_CREDIT || h.credit == 0)
                    continue;
                uint32_t chunks = (h.credit - 1) % max_chunks + 1;
                if (chunks > covered)
                    covered = chunks;
            }
        first_covered[r] = covered;
        printf("%u ", covered);
    }
    printf("window %u\n", comm->call.data.window_chunks);
    if (argc == 4) { /* rank 1's piece arrives (whole, or as far as its credits reach) */
        const struct call *c = &comm->call;
        int tail = strcmp(argv[3], "tail") == 0;
        uint32_t credited = first_covered[1]; /* rank 1's chunks credited in its step (tail) */
        uint32_t g1 = 0;
        while (g1 < c->schedule.steps && c->step[g1].recv_peer != 1)
            g1++;
        uint8_t datagram[UDT_WIRE_HEADER_BYTES + CHUNK_BYTES];
        memset(datagram, 0, sizeof datagram);
        uint64_t now = 1000000000ull, wake;
        for (uint32_t k = 0; k < c->state[g1].expected; k++) {
            if (tail) { /* the credits that reached rank 1 so far */
                struct udt_recv_item items[16];
                int got;
                while ((got = udt_transport_recv(peers[1], items, 16)) > 0)
                    for (int i = 0; i < got; i++) {
                        struct udt_wire_header h;
                        if (udt_wire_decode(items[i].data, items[i].bytes, &h) == 0 && h.kind == UDT_KIND_CREDIT &&
                            h.credit > g1 * max_chunks && h.credit - g1 * max_chunks > credited)
                            credited = h.credit - g1 * max_chunks;
                    }
                if (k >= credited)
                    break;
            }
            struct udt_wire_header h = {.magic = UDT_WIRE_MAGIC, .version = UDT_WIRE_VERSION, .kind = UDT_KIND_DATA,
                                        .phase = c->step[g1].phase, .session_id = SESSION, .sequence = c->sequence,
                                        .step = (uint16_t)g1, .source_rank = 1, .chunk_index = k, .contributions = 1,
                                        .payload_bytes = CHUNK_BYTES, .layout_tag = c->layout_tag,
                                        .credit = c->state[g1].expected};
            udt_wire_encode(&h, datagram);
            struct udt_send_item item = {.peer = 0, .header = datagram, .header_bytes = sizeof datagram};
            if (udt_transport_send(peers[1], &item, 1) != 1)
                return 4;
            now += 1000; /* rank 0 takes each datagram as it comes (the memory network's queues are short) */
            if (udt_call_progress(comm, now, &wake) < 0)
                return 4;
        }
        if (tail)
            printf("sent %u of %u\n", credited < c->state[g1].expected ? credited : c->state[g1].expected,
                   c->state[g1].expected);
        if (!tail)
            printf("outstanding %llu window %u step_closed %d\n", (unsigned long long)outstanding_credit(comm),
                   c->data.window_chunks, (int)c->state[g1].closed);
    }
    return finish(comm, peers, world, net);
}
