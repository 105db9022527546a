/* libFuzzer harness for the engine's receive path (decode, admission,
 * placement, credits, the verdict round): one rank of a world of three runs
 * a real call over the in-memory transport while the input, cut into
 * datagrams, arrives "from" its peers. Sanitizers (ASan, UBSan) report any
 * out-of-bounds access or undefined behaviour; the harness also checks that
 * a call always ends.
 *
 * Input: byte 0 picks the collective (bit 7: all_to_all; with bit 6, one of pieces of their own
 * sizes, PIECES) and algorithm; then records of
 * [flags][peer][length: 2 bytes LE][datagram]. Flag bit 0 overwrites magic,
 * version, session, sequence, source rank and layout tag with the call's own,
 * so the fuzzer reaches the checks behind them without guessing 20 bytes. Flag bit 2: before
 * the datagram, the transport reports an ICMP port unreachable for one sent to that peer (a
 * bounce, as UDP's error queue does), so the evidence of closed ports meets every datagram order.
 * Build and run: scripts/fuzz.sh */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "elementwise.h"
#include "engine_internal.h"
#include "fuzz_records.h"
#include "transport_memory.h"
#include "wire.h"

#define WORLD 3
#define COUNT 96        /* 32 elements a block */
#define CHUNK_BYTES 64  /* 16 float32 a chunk: 2 chunks a block */
#define SESSION 0x1122334455667788ull
/* bits 7 and 6: rank 0 sends ranks 0, 1, 2 pieces of 20, 17 and 0 float32 and takes 20, 40 and 9
 * (3 chunks from rank 1, the last short; 1 from rank 2): what make_seeds.py sends it */
static const uint64_t PIECES[2 * WORLD] = {20, 17, 0, 20, 40, 9};
#define MAX_DATAGRAM (UDT_WIRE_HEADER_BYTES + 256)

static void drain(struct udt_transport *t)
{
    struct udt_recv_item items[16];
    while (udt_transport_recv(t, items, 16) > 0) {
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    struct udt_memory_network *net = udt_memory_network_create(WORLD, MAX_DATAGRAM);
    struct udt_transport *peers[WORLD] = {0};
    for (uint32_t r = 1; r < WORLD; r++)
        peers[r] = udt_memory_open(net, r);
    struct udt_engine_options options = {.chunk_bytes = CHUNK_BYTES, .window_bytes = 4 * CHUNK_BYTES, .end_repeats = 2,
                                         .credit_refresh_us = 1000, .reorder_grace_us = 100, .idle_close_us = 500,
                                         .agree_resend_us = 1000, .join_timeout_ms = 1000};
    struct udt_error error;
    struct udt_comm *comm = udt_comm_create(udt_memory_open(net, 0), 0, WORLD, SESSION, &options, &error);
    if (!comm)
        abort();
    /* the memory transport cannot hear of closed ports: the harness plays its error queue */
    struct udt_peer_ports *ports = calloc(1, sizeof *ports + WORLD * sizeof ports->bounces[0]);
    if (!ports)
        abort();
    ports->peer_count = WORLD;
    comm->transport->ports = ports;

    float input[COUNT], output[COUNT];
    for (int i = 0; i < COUNT; i++)
        input[i] = output[i] = (float)i;
    struct udt_collective_args args = {
        .collective = data[0] & 0x80 ? UDT_ALL_TO_ALL : data[0] % 4, .algorithm = (data[0] >> 2) & 1, .input = input, .output = output, .count = COUNT,
        .dtype = UDT_FLOAT32, .op = UDT_OP_SUM, .estimator = UDT_ESTIMATOR_UNBIASED, .root = (data[0] >> 3) % WORLD,
        .loss_budget = 1.0, .deadline_s = 0.01};
    if ((data[0] & 0xC0) == 0xC0) {
        args.piece_counts = PIECES;
        args.count = PIECES[3] + PIECES[4] + PIECES[5];
    }
    /* reduce_scatter writes a shard, all_gather reads one: both fit in COUNT */
    struct udt_collective_stats stats;
    uint64_t now = 1000000000ull;
    if (udt_call_start(comm, &args, &stats, now) != UDT_OK)
        abort();
    const struct call *c = &comm->call;

    size_t at = 1;
    struct fuzz_record record;
    while (fuzz_next_record(data, size, &at, MAX_DATAGRAM, &record)) {
        uint8_t flags = record.flags, peer = (uint8_t)(1 + record.selector % (WORLD - 1));
        uint32_t length = record.length;
        uint8_t datagram[MAX_DATAGRAM];
        memcpy(datagram, record.bytes, length);
        if ((flags & 1) && length >= UDT_WIRE_HEADER_BYTES) {
            struct udt_wire_header h;
            fuzz_header_of(datagram, length, SESSION, &h);
            h.sequence = c->sequence + ((flags >> 1) & 1); /* this call, or the next */
            h.source_rank = peer;
            h.layout_tag = c->layout_tag;
            udt_wire_encode(&h, datagram);
        }
        if (flags & 4) {
            ports->bounces[peer]++;
            ports->bounce_count++;
        }
        struct udt_send_item item = {.peer = 0, .header = datagram, .header_bytes = length};
        udt_transport_send(peers[peer], &item, 1);
        uint64_t wake;
        now += 20000; /* 20 us between datagrams: timers fire as they would */
        if (udt_call_progress(comm, now, &wake) < 0)
            abort();
        drain(peers[1]);
        drain(peers[2]);
    }
    /* run the call out: it must end by its hard deadline */
    int rc = 0;
    for (int i = 0; i < 100000 && rc != 2; i++) {
        uint64_t wake = now;
        rc = udt_call_progress(comm, now, &wake);
        if (rc < 0)
            abort();
        now = wake > now ? wake : now + 1000;
        drain(peers[1]);
        drain(peers[2]);
    }
    if (rc != 2) {
        fprintf(stderr, "the call did not end\n");
        abort();
    }
    udt_call_finish(comm, now);
    comm->transport->ports = NULL;
    free(ports);
    udt_comm_destroy(comm);
    udt_transport_destroy(peers[1]);
    udt_transport_destroy(peers[2]);
    udt_memory_network_destroy(net);
    return 0;
}
