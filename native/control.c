/* The call's control datagrams: every header the engine sends (data, END, CREDIT, JOIN, the
 * verdict) is filled here, and every header-only or verdict datagram leaves through the one
 * sender below. */
#include "engine_internal.h"

#include <string.h>

void udt_fill_header(struct call *c, struct udt_wire_header *h, uint8_t kind, uint32_t step)
{
    memset(h, 0, sizeof *h);
    h->magic = UDT_WIRE_MAGIC;
    h->version = UDT_WIRE_VERSION;
    h->kind = kind;
    h->session_id = udt_comm_of(c)->session_id;
    h->sequence = c->sequence;
    h->source_rank = (uint16_t)c->rank;
    h->layout_tag = c->layout_tag;
    if (kind == UDT_KIND_DATA || kind == UDT_KIND_END) {
        h->step = (uint16_t)step;
        h->phase = c->step[step].phase;
    }
}

/* One slot of comm->headers per kind, apart from the data batch's: a control datagram sent
 * between two data batches never overwrites a header the transport may still read. */
static uint8_t *header_slot(struct udt_comm *comm, uint8_t kind)
{
    switch (kind) {
    case UDT_KIND_AGREE: return comm->headers[SEND_BATCH + 1];
    case UDT_KIND_JOIN: return comm->headers[SEND_BATCH + 2];
    default: return comm->headers[SEND_BATCH]; /* END, CREDIT */
    }
}

/* The one sender of control datagrams: fills and encodes the header, sends up to
 * UDT_MAX_END_REPEATS copies, counts them. Returns how many copies were queued (the socket
 * may be full), or -errno. */
int udt_send_control(struct call *c, uint32_t peer, const struct udt_control *m)
{
    struct udt_comm *comm = udt_comm_of(c);
    struct udt_wire_header h;
    udt_fill_header(c, &h, m->kind, m->step);
    h.sequence = m->sequence;
    h.layout_tag = m->layout_tag;
    h.flags = m->flags;
    h.chunk_index = m->chunk_index;
    h.credit = m->credit;
    h.payload_bytes = m->payload ? UDT_VERDICT_BYTES : 0;
    uint8_t *slot = header_slot(comm, m->kind);
    udt_wire_encode(&h, slot);
    struct udt_send_item items[UDT_MAX_END_REPEATS];
    int n = m->copies < 1 ? 1 : m->copies < UDT_MAX_END_REPEATS ? m->copies : UDT_MAX_END_REPEATS;
    for (int i = 0; i < n; i++)
        items[i] = (struct udt_send_item){.peer = peer, .header = slot, .header_bytes = UDT_WIRE_HEADER_BYTES,
                                          .payload = m->payload, .payload_bytes = h.payload_bytes,
                                          .flags = i ? UDT_SEND_APART : 0u};
    int rc = udt_transport_send(comm->transport, items, n);
    if (rc > 0) {
        c->stats->datagrams_sent += (uint64_t)rc;
        if (m->kind == UDT_KIND_JOIN)
            c->stats->join_messages_sent += (uint64_t)rc;
        if (m->kind == UDT_KIND_AGREE)
            c->stats->agree_messages_sent += (uint64_t)rc;
        if (m->kind == UDT_KIND_CREDIT)
            c->stats->credits_sent += (uint64_t)rc;
        if (m->kind == UDT_KIND_END)
            c->stats->ends_sent += (uint64_t)rc;
    }
    return rc;
}
