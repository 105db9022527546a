/* A wider fuzz harness than fuzz_engine.c: the fuzz input also picks the call's shape and the
 * communicator's history, where fuzz_engine.c fixes them (3 ranks, rank 0, 96 float32, SUM).
 *  - world 2..5, any rank, count 0..255 (uneven and empty blocks), every dtype, MEAN, zero fill,
 *    copies 1..4, allreduce in place (its saves and put-back), chunk masks, four chunk sizes;
 *  - up to 3 calls on one communicator, with datagrams of the previous and the next call (the
 *    kept verdict's answers; early credits, JOINs and verdicts checked when the next call starts);
 *  - a foreign layout tag on request (the layout vote);
 *  - every received datagram copied into a heap block of its exact size, so that a read past
 *    its end is an ASan report (the in-memory transport's padded slots would hide it);
 *  - a record flag that makes DATA, END, CREDIT, JOIN and AGREE consistent with the schedule,
 *    so that deep paths are reached, not only the early drops.
 * Input: 5 configuration bytes, then records [flags][selector][length lo][length hi][bytes]. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "elementwise.h"
#include "engine_internal.h"
#include "transport_memory.h"
#include "wire.h"
#include "blocks.h"
#include "fuzz_records.h"

#define SESSION 0x1122334455667788ull
#define MAX_DATAGRAM (UDT_WIRE_HEADER_BYTES + 256)

struct exact_size {
    struct udt_transport base;
    struct udt_transport *inner;
    uint8_t *held[64];
    int nheld;
};
static void exact_release(struct exact_size *e)
{
    for (int i = 0; i < e->nheld; i++)
        free(e->held[i]);
    e->nheld = 0;
}
static int ex_set_peers(struct udt_transport *t, const uint8_t *a, uint32_t b, uint32_t n) { return udt_transport_set_peers(((struct exact_size *)t)->inner, a, b, n); }
static int ex_send(struct udt_transport *t, const struct udt_send_item *i, int n) { return udt_transport_send(((struct exact_size *)t)->inner, i, n); }
static int ex_recv(struct udt_transport *t, struct udt_recv_item *items, int max)
{
    struct exact_size *e = (struct exact_size *)t;
    exact_release(e);
    if (max > 64)
        max = 64;
    int got = udt_transport_recv(e->inner, items, max);
    for (int i = 0; i < got; i++) {
        uint8_t *copy = malloc(items[i].bytes ? items[i].bytes : 1);
        memcpy(copy, items[i].data, items[i].bytes);
        items[i].data = copy;
        e->held[e->nheld++] = copy;
    }
    return got;
}
static int ex_wait(struct udt_transport *t, int us) { return udt_transport_wait(((struct exact_size *)t)->inner, us); }
static void ex_destroy(struct udt_transport *t)
{
    struct exact_size *e = (struct exact_size *)t;
    exact_release(e);
    udt_transport_destroy(e->inner);
    free(e);
}
static const struct udt_transport_ops exact_ops = {"exact", ex_set_peers, ex_send, ex_recv, ex_wait, ex_destroy};
static struct udt_transport *exact_wrap(struct udt_transport *inner)
{
    struct exact_size *e = calloc(1, sizeof *e);
    e->base = *inner;
    e->base.ops = &exact_ops;
    e->base.ports = NULL;
    e->inner = inner;
    return &e->base;
}

static void drain_all(struct udt_transport **peers, uint32_t world, uint32_t rank)
{
    struct udt_recv_item items[16];
    for (uint32_t r = 0; r < world; r++)
        if (r != rank)
            while (udt_transport_recv(peers[r], items, 16) > 0) {
            }
}

static uint32_t chunks_of(const struct call *c, uint32_t block) { return (uint32_t)(c->geometry.chunk_base[block + 1] - c->geometry.chunk_base[block]); }
static uint64_t chunk_len(const struct call *c, uint32_t block, uint32_t chunk)
{
    uint64_t end = c->geometry.block_first[block + 1], first = c->geometry.block_first[block] + (uint64_t)chunk * c->geometry.chunk_elements;
    return end - first < c->geometry.chunk_elements ? end - first : c->geometry.chunk_elements;
}

static int run_out(struct udt_comm *comm, struct udt_transport **peers, uint32_t world, uint32_t rank, uint64_t *now)
{
    int rc = 0;
    for (int i = 0; i < 100000 && rc != 2; i++) {
        uint64_t wake = *now;
        rc = udt_call_progress(comm, *now, &wake);
        if (rc < 0)
            abort();
        *now = wake > *now ? wake : *now + 1000;
        drain_all(peers, world, rank);
    }
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 5)
        return 0;
    uint32_t world = 2 + data[1] % 4, rank = data[4] % world;
    static const uint32_t chunk_sizes[4] = {64, 16, 24, 100};
    uint32_t chunk_bytes = chunk_sizes[(data[3] >> 3) & 3];
    int calls = 1 + ((data[3] >> 5) % 3);
    struct udt_memory_network *net = udt_memory_network_create(world, MAX_DATAGRAM);
    struct udt_transport *peers[8] = {0};
    for (uint32_t r = 0; r < world; r++)
        if (r != rank)
            peers[r] = udt_memory_open(net, r);
    struct udt_engine_options options = {.chunk_bytes = chunk_bytes, .window_bytes = 4 * chunk_bytes, .end_repeats = 2,
                                         .credit_refresh_us = 1000, .reorder_grace_us = 100, .idle_close_us = 500,
                                         .agree_resend_us = 1000, .join_timeout_ms = 1000, .in_place_min_bytes = 0};
    struct udt_error error;
    struct udt_comm *comm = udt_comm_create(exact_wrap(udt_memory_open(net, rank)), rank, world, SESSION, &options, &error);
    if (!comm)
        abort();

    struct udt_collective_args args = {0};
    args.collective = (data[0] & 7) % UDT_COLLECTIVE_COUNT; /* bit 3 is the algorithm's */
    args.algorithm = (data[0] >> 3) & 1;
    args.root = (data[0] >> 4) % world;
    args.dtype = ((data[1] >> 2) & 7) % UDT_DTYPE_COUNT; /* bits 5-7: in place, copies */
    int in_place = (data[1] >> 5) & 1;
    args.copies = 1 + ((data[1] >> 6) & 3);
    args.count = data[2];
    if (args.collective == UDT_ALL_TO_ALL)
        args.count -= args.count % world; /* equal blocks */
    args.op = data[3] & 1;
    args.estimator = (data[3] >> 1) & 1;
    int want_mask = (data[3] >> 2) & 1;
    args.loss_budget = 1.0;
    args.deadline_s = 0.01;
    args.agree_value = 7;
    size_t wire = udt_wire_elem_bytes(args.dtype);
    uint64_t shard = udt_block_length(args.count, world, rank);
    uint64_t in_count = args.collective == UDT_ALL_GATHER ? shard : args.count;
    uint64_t out_count = args.collective == UDT_REDUCE_SCATTER ? shard : args.count;
    if (args.collective == UDT_AGREE)
        in_count = out_count = 0;
    uint8_t *input = malloc(in_count * wire + 1), *output = malloc(out_count * wire + 1);
    for (uint64_t i = 0; i < in_count * wire; i++)
        input[i] = (uint8_t)(i * 7);
    for (uint64_t i = 0; i < out_count * wire; i++)
        output[i] = (uint8_t)(i * 3);
    args.input = in_count ? input : NULL;
    args.output = out_count ? output : NULL;
    if (in_place && (args.collective == UDT_ALLREDUCE || args.collective == UDT_ALL_TO_ALL))
        args.input = args.output;
    uint8_t *mask = NULL;
    if (want_mask) {
        uint64_t mb = udt_chunk_mask_bytes(args.collective, args.algorithm, args.count, args.dtype, rank, world, chunk_bytes);
        if (mb) {
            mask = malloc(mb);
            args.chunk_mask = mask;
            args.chunk_mask_bytes = mb;
        }
    }

    struct udt_collective_stats stats;
    uint64_t now = 1000000000ull;
    if (udt_call_start(comm, &args, &stats, now) != UDT_OK)
        abort();
    int call_no = 1;
    const struct call *c = &comm->call;

    size_t at = 5;
    struct fuzz_record record;
    while (fuzz_next_record(data, size, &at, MAX_DATAGRAM, &record)) {
        uint8_t flags = record.flags, sel = record.selector;
        uint32_t peer = (rank + 1 + sel % (world - 1)) % world;
        uint32_t length = record.length;
        uint8_t datagram[MAX_DATAGRAM];
        memset(datagram, 0, sizeof datagram);
        memcpy(datagram, record.bytes, length);
        if ((flags & 0x30) == 0x30) { /* control: end this call, start the next */
            if (call_no < calls) {
                if (run_out(comm, peers, world, rank, &now) != 2) {
                    fprintf(stderr, "the call did not end\n");
                    abort();
                }
                udt_call_finish(comm, now); /* its status is not what this harness checks */
                if (udt_call_start(comm, &args, &stats, now) != UDT_OK)
                    abort();
                call_no++;
            }
            continue;
        }
        if ((flags & 1) && length >= UDT_WIRE_HEADER_BYTES) {
            struct udt_wire_header h;
            fuzz_header_of(datagram, length, SESSION, &h);
            h.sequence = c->sequence + ((flags >> 1) & 1) - ((flags >> 6) & 1);
            int keep_layout = (h.reserved & 0x8000u) != 0; /* the fuzzer's own tag: another layout */
            if (!keep_layout)
                h.layout_tag = c->layout_tag;
            if (flags & 4) { /* smart: consistent with the schedule */
                if (h.kind < 1 || h.kind > 5)
                    h.kind = 1 + h.kind % 5;
                h.reserved = 0;
                uint32_t steps = c->schedule.steps;
                if ((h.kind == UDT_KIND_DATA || h.kind == UDT_KIND_END) && steps) {
                    uint32_t g = h.step % steps;
                    const struct udt_step *st = &c->step[g];
                    h.step = (uint16_t)g;
                    h.flags = 0;
                    if (st->recv_peer >= 0)
                        peer = (uint32_t)st->recv_peer;
                    h.phase = st->phase;
                    if (h.kind == UDT_KIND_END) {
                        h.payload_bytes = 0;
                        length = UDT_WIRE_HEADER_BYTES;
                    } else {
                        uint32_t chunks = chunks_of(c, st->recv_block);
                        if (chunks)
                            h.chunk_index %= chunks;
                        uint64_t el = chunks ? chunk_len(c, st->recv_block, h.chunk_index) : 0;
                        h.payload_bytes = (uint32_t)(el * c->geometry.wire_bytes);
                        length = UDT_WIRE_HEADER_BYTES + h.payload_bytes;
                        if (length > MAX_DATAGRAM)
                            length = MAX_DATAGRAM;
                        if (h.contributions & 0x8000u)
                            h.contributions = (uint16_t)(h.contributions % (c->n + 1));
                        else
                            h.contributions = (uint16_t)(1 + h.contributions % (st->recv_contributions ? st->recv_contributions : c->n));
                        if (chunks)
                            h.credit = st->recv_whole || !(h.credit & 0x80000000u) ? chunks : 1 + h.credit % chunks;
                    }
                } else if (h.kind == UDT_KIND_CREDIT) {
                    h.flags = h.phase = 0;
                    h.step = 0;
                    h.chunk_index = h.contributions = 0;
                    h.payload_bytes = 0;
                    h.credit %= comm->peers[peer].in_call.credit_ceiling + 2;
                    length = UDT_WIRE_HEADER_BYTES;
                } else if (h.kind == UDT_KIND_JOIN) {
                    h.flags &= UDT_JOIN_REPLY;
                    h.phase = 0;
                    h.step = 0;
                    h.chunk_index = h.contributions = 0;
                    h.payload_bytes = 0;
                    h.credit %= steps + 2;
                    length = UDT_WIRE_HEADER_BYTES;
                } else if (h.kind == UDT_KIND_AGREE) {
                    h.flags &= 3;
                    h.payload_bytes = UDT_VERDICT_BYTES;
                    length = UDT_WIRE_HEADER_BYTES + UDT_VERDICT_BYTES;
                    if (flags & 8) { /* a plausible verdict */
                        struct udt_verdict v;
                        udt_verdict_decode(datagram + UDT_WIRE_HEADER_BYTES, &v);
                        v.cause = (v.cause & 0x30000u) | ((v.cause & 0xFFFFu) % c->n);
                        if (v.cause >> 16 == 0)
                            v.cause = 0;
                        v.fresh_elements %= c->args.count + 1;
                        v.reduce_weighted %= (uint64_t)c->n * ((c->args.count + c->n - 1) / c->n) + 1;
                        v.loss_budget = 1.0 - (v.agree_value & 0xff) / 255.0;
                        udt_verdict_encode(&v, datagram + UDT_WIRE_HEADER_BYTES);
                    }
                }
            }
            h.source_rank = (uint16_t)((flags & 0x80) ? h.source_rank % 8 : peer);
            udt_wire_encode(&h, datagram);
        }
        struct udt_send_item item = {.peer = rank, .header = datagram, .header_bytes = length};
        udt_transport_send(peers[peer], &item, 1);
        uint64_t wake;
        now += 20000 + (uint64_t)(sel >> 4) * ((flags & 0x10) ? 1000000 : 0);
        if (udt_call_progress(comm, now, &wake) < 0)
            abort();
        drain_all(peers, world, rank);
    }
    if (run_out(comm, peers, world, rank, &now) != 2) {
        fprintf(stderr, "the call did not end\n");
        abort();
    }
    udt_call_finish(comm, now);
    udt_comm_destroy(comm);
    for (uint32_t r = 0; r < world; r++)
        udt_transport_destroy(peers[r]);
    udt_memory_network_destroy(net);
    free(input);
    free(output);
    free(mask);
    return 0;
}
