/* Loss injection: a transport wrapper that drops received datagrams under a
 * seeded model (Bernoulli, or Gilbert-Elliott for bursts), so experiments are
 * repeatable. It sits below the engine, which cannot tell it from a network. */
#include "transport_lossy.h"

#include <stdlib.h>
#include <string.h>

#include "prng.h"

struct lossy_transport {
    struct udt_transport base;
    struct udt_transport *inner;
    struct udt_loss_model model;
    uint64_t rng_state;
    int in_bad_state;
};

static double uniform(struct lossy_transport *l) { return udt_prng_uniform(&l->rng_state); }

static int should_drop(struct lossy_transport *l)
{
    const struct udt_loss_model *m = &l->model;
    switch (m->kind) {
    case UDT_LOSS_BERNOULLI:
        return uniform(l) < m->loss;
    case UDT_LOSS_GILBERT_ELLIOTT:
        if (l->in_bad_state ? uniform(l) < m->bad_to_good : uniform(l) < m->good_to_bad)
            l->in_bad_state = !l->in_bad_state;
        return uniform(l) < (l->in_bad_state ? m->loss_in_bad : m->loss_in_good);
    default:
        return 0;
    }
}

static int lossy_set_peers(struct udt_transport *t, const uint8_t *a, uint32_t b, uint32_t n)
{
    struct lossy_transport *l = (struct lossy_transport *)t;
    int rc = udt_transport_set_peers(l->inner, a, b, n);
    if (rc < 0)
        t->error = l->inner->error;
    t->ports = l->inner->ports; /* what the sender learns of closed ports is news here too */
    return rc;
}

/* The inner transport's counters, as the engine reads them from the wrapper. */
static void mirror_counters(struct lossy_transport *l)
{
    l->base.counter_receive_overflows = l->inner->counter_receive_overflows;
    l->base.counter_send_calls = l->inner->counter_send_calls;
    l->base.counter_receive_calls = l->inner->counter_receive_calls;
}

static int lossy_send(struct udt_transport *t, const struct udt_send_item *items, int count)
{
    struct lossy_transport *l = (struct lossy_transport *)t;
    int rc = udt_transport_send(l->inner, items, count);
    mirror_counters(l);
    if (rc < 0)
        t->error = l->inner->error;
    return rc;
}

static int lossy_recv(struct udt_transport *t, struct udt_recv_item *items, int max_items)
{
    struct lossy_transport *l = (struct lossy_transport *)t;
    int got = udt_transport_recv(l->inner, items, max_items);
    mirror_counters(l);
    if (got < 0) {
        t->error = l->inner->error;
        return got;
    }
    int kept = 0;
    for (int i = 0; i < got; i++) {
        if (should_drop(l)) {
            t->counter_injected_drops++;
            continue;
        }
        items[kept++] = items[i];
    }
    return kept;
}

static int lossy_wait(struct udt_transport *t, int timeout_us) { return udt_transport_wait(((struct lossy_transport *)t)->inner, timeout_us); }

static void lossy_destroy(struct udt_transport *t)
{
    struct lossy_transport *l = (struct lossy_transport *)t;
    udt_transport_destroy(l->inner);
    free(l);
}

static const struct udt_transport_ops lossy_ops = {
    .name = "lossy",
    .set_peers = lossy_set_peers,
    .send_batch = lossy_send,
    .recv_batch = lossy_recv,
    .wait = lossy_wait,
    .destroy = lossy_destroy,
};

struct udt_transport *udt_lossy_wrap(struct udt_transport *inner, const struct udt_loss_model *model)
{
    struct lossy_transport *l = calloc(1, sizeof *l);
    if (!l)
        return NULL;
    l->base.ops = &lossy_ops;
    l->base.max_datagram_bytes = inner->max_datagram_bytes;
    l->base.address_bytes = inner->address_bytes;
    memcpy(l->base.address, inner->address, sizeof l->base.address);
    l->inner = inner;
    mirror_counters(l); /* they start where the inner transport's are */
    l->model = *model;
    l->rng_state = model->seed;
    return &l->base;
}
