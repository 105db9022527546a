/* The call's control datagrams: every header the engine sends (data, END, CREDIT, JOIN, the
 * verdict) is filled here, and every header-only or verdict datagram leaves through the one
 * sender below. */
#include "engine_internal.h"

#include <string.h>

#include "blocks.h"
#include "elementwise.h"

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
        h->phase = c->step[step].phase == UDT_STEP_GATHER ? UDT_PHASE_GATHER : UDT_PHASE_REDUCE;
    }
}

int udt_send_control(struct call *c, uint8_t kind, uint32_t step, uint32_t peer, uint32_t credit, int copies)
{
    struct udt_comm *comm = udt_comm_of(c);
    struct udt_wire_header h;
    udt_fill_header(c, &h, kind, step);
    h.credit = credit;
    uint8_t *slot = comm->headers[SEND_BATCH];
    udt_wire_encode(&h, slot);
    struct udt_send_item items[UDT_MAX_END_REPEATS];
    int n = copies < UDT_MAX_END_REPEATS ? copies : UDT_MAX_END_REPEATS;
    for (int i = 0; i < n; i++)
        items[i] = (struct udt_send_item){.peer = peer, .header = slot, .header_bytes = UDT_WIRE_HEADER_BYTES};
    int rc = udt_transport_send(comm->transport, items, n);
    if (rc > 0)
        c->stats->datagrams_sent += (uint64_t)rc;
    return rc; /* how many copies were queued (the socket may be full), or -errno */
}
