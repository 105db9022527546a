/* One point-to-point stream of DATA datagrams through the verbs UD transport
 * (native/transport_verbs.c, nothing else of the library), sender or receiver: the
 * measurement of tests/verbs_guest/bench_rig.py, in C so that the loops cost what the
 * engine's would. bench_rig.py compiles it (with transport_verbs.c, -libverbs) and runs
 * both ends as processes on the guest's rxe device.
 *
 *   verbs_stream send|recv DEVICE PORT GID_INDEX QKEY COUNT DATAGRAM_BYTES SESSION [RECV_DEPTH]
 *
 * Each end prints its 26-byte address as hex on a line, then reads one line from stdin:
 * the peer table, "SENDER_HEX RECEIVER_HEX". The receiver then prints "ready" and
 * receives until COUNT arrived, nothing came for 2 s after the first, or nothing at all
 * for 60 s; the sender sends COUNT datagrams (header included, chunk_index numbering them)
 * to peer 1 as fast as its send ring allows. Each prints one JSON line:
 *   send: {"sent", "seconds", "ring_full_waits"}
 *   recv: {"received", "foreign", "invalid", "seconds" (first to last), "max_index", "out_of_order"} */
#define _GNU_SOURCE
#include "transport_verbs.h"
#include "wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FIRST_TIMEOUT_S 60.0
#define IDLE_TIMEOUT_S 2.0
#define BATCH 32

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int read_peers(uint8_t table[2][UDT_VERBS_ADDRESS_BYTES])
{
    char line[256];
    if (!fgets(line, sizeof line, stdin))
        return -1;
    const char *p = line;
    for (int peer = 0; peer < 2; peer++) {
        while (*p == ' ')
            p++;
        for (unsigned i = 0; i < UDT_VERBS_ADDRESS_BYTES; i++, p += 2) {
            unsigned byte;
            if (sscanf(p, "%2x", &byte) != 1)
                return -1;
            table[peer][i] = (uint8_t)byte;
        }
    }
    return 0;
}

static int stream_send(struct udt_transport *t, uint64_t count, uint32_t datagram_bytes, uint64_t session)
{
    struct udt_send_item items[BATCH];
    uint8_t headers[BATCH][UDT_WIRE_HEADER_BYTES];
    uint8_t *payload = malloc(datagram_bytes);
    uint64_t sent = 0, full_waits = 0;
    int rc = 0;
    if (!payload)
        return 1;
    memset(payload, 0xA5, datagram_bytes);
    struct udt_wire_header h = {.magic = UDT_WIRE_MAGIC, .version = UDT_WIRE_VERSION, .kind = UDT_KIND_DATA,
                                .session_id = session, .contributions = 1,
                                .payload_bytes = datagram_bytes - UDT_WIRE_HEADER_BYTES};
    double start = now();
    while (sent < count) {
        int n = count - sent < BATCH ? (int)(count - sent) : BATCH;
        for (int i = 0; i < n; i++) {
            h.chunk_index = (uint32_t)(sent + (uint64_t)i);
            udt_wire_encode(&h, headers[i]);
            items[i] = (struct udt_send_item){.peer = 1, .header = headers[i], .header_bytes = UDT_WIRE_HEADER_BYTES,
                                              .payload = payload, .payload_bytes = h.payload_bytes};
        }
        rc = udt_transport_send(t, items, n);
        if (rc < 0)
            break;
        if (rc < n) {
            full_waits++;
            udt_transport_wait(t, 1000);
        }
        sent += (uint64_t)rc;
    }
    double elapsed = now() - start;
    free(payload);
    if (rc < 0) {
        fprintf(stderr, "send: %s\n", t->error.message);
        return 1;
    }
    printf("{\"sent\": %llu, \"seconds\": %.6f, \"ring_full_waits\": %llu}\n", (unsigned long long)sent, elapsed,
           (unsigned long long)full_waits);
    return 0;
}

static int stream_receive(struct udt_transport *t, uint64_t count, uint64_t session)
{
    struct udt_recv_item items[64];
    struct udt_wire_header h;
    uint64_t received = 0, foreign = 0, invalid = 0, out_of_order = 0;
    int64_t last_index = -1;
    double first = 0, last = 0, started = now();
    while (received < count) {
        int got = udt_transport_recv(t, items, 64);
        if (got < 0) {
            fprintf(stderr, "recv: %s\n", t->error.message);
            return 1;
        }
        double at = now();
        for (int i = 0; i < got; i++) {
            if (udt_wire_decode(items[i].data, items[i].bytes, &h) != 0 ||
                items[i].bytes != UDT_WIRE_HEADER_BYTES + h.payload_bytes) {
                invalid++;
            } else if (h.magic != UDT_WIRE_MAGIC || h.session_id != session || items[i].peer < 0) {
                foreign++;
            } else {
                if (received == 0)
                    first = at;
                last = at;
                received++;
                if ((int64_t)h.chunk_index < last_index)
                    out_of_order++;
                else
                    last_index = h.chunk_index;
            }
        }
        if (got == 0) {
            if (received == 0 && at - started > FIRST_TIMEOUT_S)
                break;
            if (received > 0 && at - last > IDLE_TIMEOUT_S)
                break;
            udt_transport_wait(t, 10000);
        }
    }
    printf("{\"received\": %llu, \"foreign\": %llu, \"invalid\": %llu, \"seconds\": %.6f, \"max_index\": %lld, "
           "\"out_of_order\": %llu}\n",
           (unsigned long long)received, (unsigned long long)foreign, (unsigned long long)invalid, last - first,
           (long long)last_index, (unsigned long long)out_of_order);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 9) {
        fprintf(stderr, "usage: %s send|recv DEVICE PORT GID_INDEX QKEY COUNT DATAGRAM_BYTES SESSION [RECV_DEPTH]\n",
                argv[0]);
        return 2;
    }
    int sender = !strcmp(argv[1], "send");
    uint64_t count = strtoull(argv[6], NULL, 0), session = strtoull(argv[8], NULL, 0);
    uint32_t datagram_bytes = (uint32_t)strtoul(argv[7], NULL, 0);
    struct udt_verbs_config config = {.device = argv[2], .port = (uint8_t)atoi(argv[3]), .gid_index = atoi(argv[4]),
                                      .qkey = (uint32_t)strtoul(argv[5], NULL, 0),
                                      .recv_depth = argc > 9 ? (uint32_t)strtoul(argv[9], NULL, 0) : 0, .spin_us = 20};
    struct udt_error error = {0};
    struct udt_transport *t = udt_verbs_open(&config, &error);
    if (!t) {
        fprintf(stderr, "%s\n", error.message);
        return 1;
    }
    if (datagram_bytes < UDT_WIRE_HEADER_BYTES || datagram_bytes > t->max_datagram_bytes) {
        fprintf(stderr, "datagram_bytes must be between %u and %u\n", UDT_WIRE_HEADER_BYTES, t->max_datagram_bytes);
        return 2;
    }
    for (uint32_t i = 0; i < t->address_bytes; i++)
        printf("%02x", t->address[i]);
    printf("\n");
    fflush(stdout);
    uint8_t table[2][UDT_VERBS_ADDRESS_BYTES];
    if (read_peers(table) < 0) {
        fprintf(stderr, "expected a line: SENDER_HEX RECEIVER_HEX\n");
        return 2;
    }
    if (udt_transport_set_peers(t, &table[0][0], UDT_VERBS_ADDRESS_BYTES, 2) < 0) {
        fprintf(stderr, "set_peers: %s\n", t->error.message);
        return 1;
    }
    int rc;
    if (sender) {
        rc = stream_send(t, count, datagram_bytes, session);
    } else {
        printf("ready\n");
        fflush(stdout);
        rc = stream_receive(t, count, session);
    }
    fflush(stdout);
    udt_transport_destroy(t);
    return rc;
}
