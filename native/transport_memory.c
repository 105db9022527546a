/* An in-memory network of N endpoints in one process, for the simulator: a
 * send copies the datagram into the receiver's queue, delivered in order, at
 * once or a fixed delay of the simulator's clock later. Loss comes from the
 * loss-injection wrapper, as on a real socket. */
#include "transport_memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEMORY_RECV_BATCH 64
#define SLOT_HEADER 16u

struct memory_queue {
    uint8_t *slots;    /* capacity slots of (8-byte delivery time, 4-byte sender, 4-byte length, datagram) */
    uint32_t capacity, head, count;
};

struct udt_memory_network {
    uint32_t world_size, max_datagram_bytes, slot_bytes;
    struct memory_queue *queues;
    int64_t *send_allowance; /* per endpoint: data datagrams it may still send (-1: no limit) */
    uint64_t now_ns, delay_ns; /* the simulator's clock, and how long after it a datagram sent now arrives */
};

struct memory_transport {
    struct udt_transport base;
    struct udt_memory_network *network;
    uint32_t rank;
    uint8_t *received; /* the last batch handed out, valid until the next receive */
};

static int queue_push(struct memory_queue *q, uint32_t slot_bytes, uint32_t from, uint64_t arrives_ns, const struct udt_send_item *item)
{
    if (q->count == q->capacity) {
        uint32_t capacity = q->capacity ? 2 * q->capacity : 64;
        uint8_t *slots = malloc((size_t)capacity * slot_bytes);
        if (!slots)
            return -1;
        for (uint32_t i = 0; i < q->count; i++) /* unwrap the ring into the new one */
            memcpy(slots + (size_t)i * slot_bytes, q->slots + (size_t)((q->head + i) % q->capacity) * slot_bytes, slot_bytes);
        free(q->slots);
        q->slots = slots;
        q->capacity = capacity;
        q->head = 0;
    }
    uint8_t *slot = q->slots + (size_t)((q->head + q->count) % q->capacity) * slot_bytes;
    uint32_t bytes = item->header_bytes + item->payload_bytes;
    memcpy(slot, &arrives_ns, 8);
    memcpy(slot + 8, &from, 4);
    memcpy(slot + 12, &bytes, 4);
    memcpy(slot + SLOT_HEADER, item->header, item->header_bytes);
    if (item->payload_bytes)
        memcpy(slot + SLOT_HEADER + item->header_bytes, item->payload, item->payload_bytes);
    q->count++;
    return 0;
}

static int memory_set_peers(struct udt_transport *t, const uint8_t *addresses, uint32_t address_bytes, uint32_t count)
{
    (void)t, (void)addresses, (void)address_bytes, (void)count;
    return 0; /* peer i is endpoint i */
}

static int memory_send(struct udt_transport *t, const struct udt_send_item *items, int count)
{
    struct memory_transport *m = (struct memory_transport *)t;
    struct udt_memory_network *net = m->network;
    int64_t *allowance = &net->send_allowance[m->rank];
    for (int i = 0; i < count; i++) {
        if (items[i].payload_bytes && *allowance == 0)
            return i; /* paced out: the rest goes on a later pass, as on a full socket */
        if (items[i].peer >= net->world_size || items[i].header_bytes + items[i].payload_bytes > net->max_datagram_bytes) {
            udt_error_check(&t->error, "memory transport: bad send to %u (%u bytes)", items[i].peer,
                     items[i].header_bytes + items[i].payload_bytes);
            return -22;
        }
        if (queue_push(&net->queues[items[i].peer], net->slot_bytes, m->rank, net->now_ns + net->delay_ns, &items[i]) != 0) {
            udt_error_check(&t->error, "memory transport: out of memory");
            return -12;
        }
        if (items[i].payload_bytes && *allowance > 0)
            --*allowance;
    }
    return count;
}

static int memory_recv(struct udt_transport *t, struct udt_recv_item *items, int max_items)
{
    struct memory_transport *m = (struct memory_transport *)t;
    struct udt_memory_network *net = m->network;
    struct memory_queue *q = &net->queues[m->rank];
    int n = 0;
    if (max_items > MEMORY_RECV_BATCH)
        max_items = MEMORY_RECV_BATCH;
    for (; n < max_items && q->count > 0; n++) {
        uint8_t *slot = q->slots + (size_t)q->head * net->slot_bytes;
        uint64_t arrives_ns;
        memcpy(&arrives_ns, slot, 8);
        if (arrives_ns > net->now_ns)
            break; /* still on the way, and so is everything behind it (one delay for all) */
        uint8_t *copy = m->received + (size_t)n * net->slot_bytes;
        memcpy(copy, slot, net->slot_bytes);
        uint32_t from, bytes;
        memcpy(&from, copy + 8, 4);
        memcpy(&bytes, copy + 12, 4);
        items[n] = (struct udt_recv_item){.data = copy + SLOT_HEADER, .bytes = bytes, .peer = (int32_t)from};
        q->head = (q->head + 1) % q->capacity;
        q->count--;
    }
    return n;
}

static int memory_wait(struct udt_transport *t, int timeout_us)
{
    (void)t, (void)timeout_us;
    return 0; /* the simulator's clock is virtual: nothing to wait for */
}

static void memory_destroy(struct udt_transport *t)
{
    struct memory_transport *m = (struct memory_transport *)t;
    free(m->received);
    free(m);
}

static const struct udt_transport_ops memory_ops = {
    .name = "memory",
    .set_peers = memory_set_peers,
    .send_batch = memory_send,
    .recv_batch = memory_recv,
    .wait = memory_wait,
    .destroy = memory_destroy,
};

struct udt_memory_network *udt_memory_network_create(uint32_t world_size, uint32_t max_datagram_bytes)
{
    struct udt_memory_network *net = calloc(1, sizeof *net);
    if (!net)
        return NULL;
    net->world_size = world_size;
    net->max_datagram_bytes = max_datagram_bytes;
    net->slot_bytes = (max_datagram_bytes + SLOT_HEADER + 7) & ~7u;
    net->queues = calloc(world_size, sizeof *net->queues);
    net->send_allowance = malloc(world_size * sizeof *net->send_allowance);
    if (!net->queues || !net->send_allowance) {
        free(net->queues);
        free(net->send_allowance);
        free(net);
        return NULL;
    }
    for (uint32_t i = 0; i < world_size; i++)
        net->send_allowance[i] = -1;
    return net;
}

void udt_memory_network_destroy(struct udt_memory_network *net)
{
    if (!net)
        return;
    for (uint32_t i = 0; i < net->world_size; i++)
        free(net->queues[i].slots);
    free(net->queues);
    free(net->send_allowance);
    free(net);
}

void udt_memory_set_send_allowance(struct udt_memory_network *net, uint32_t rank, int64_t datagrams)
{
    net->send_allowance[rank] = datagrams;
}

int64_t udt_memory_send_allowance(const struct udt_memory_network *net, uint32_t rank) { return net->send_allowance[rank]; }

void udt_memory_set_delay(struct udt_memory_network *net, uint64_t delay_ns) { net->delay_ns = delay_ns; }

void udt_memory_set_clock(struct udt_memory_network *net, uint64_t now_ns) { net->now_ns = now_ns; }

uint64_t udt_memory_next_arrival(const struct udt_memory_network *net, uint32_t rank)
{
    const struct memory_queue *q = &net->queues[rank];
    uint64_t arrives_ns = UINT64_MAX;
    if (q->count)
        memcpy(&arrives_ns, q->slots + (size_t)q->head * net->slot_bytes, 8);
    return arrives_ns;
}

struct udt_transport *udt_memory_open(struct udt_memory_network *net, uint32_t rank)
{
    struct memory_transport *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    m->received = malloc((size_t)MEMORY_RECV_BATCH * net->slot_bytes);
    if (!m->received) {
        free(m);
        return NULL;
    }
    m->base.ops = &memory_ops;
    m->base.max_datagram_bytes = net->max_datagram_bytes;
    m->base.address_bytes = 4;
    memcpy(m->base.address, &rank, 4);
    m->network = net;
    m->rank = rank;
    return &m->base;
}
