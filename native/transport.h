/* The one interface every datagram transport implements (UDP: transport_udp.h, verbs UD:
 * transport_verbs.h, the loss-injection wrapper: transport_lossy.h, the simulator's memory
 * network: transport_memory.h). The engine knows nothing else about them.
 *
 * Contract:
 *  - send_batch is done with the header and payload memory when it returns
 *    (it copies or completes), and never blocks: it returns how many it
 *    queued, possibly 0, or -errno.
 *  - recv_batch never blocks; the items it returns stay valid until the next
 *    recv_batch call on the same transport.
 *  - wait blocks up to timeout_us until a receive is likely to succeed.
 *  - A datagram's sender is identified by the transport (peer index), not
 *    trusted from the payload; -1 means "not one of our peers". */
#ifndef UDT_TRANSPORT_H
#define UDT_TRANSPORT_H

#include <stdint.h>

#include "error.h"

#define UDT_ADDRESS_MAX 64

/* flags of a send item */
/* The item repeats one sent earlier in the same batch (a copy): it starts a kernel message of its
 * own. Copies inside one GSO message are one packet until segmentation, and whatever drops that
 * packet whole (a qdisc, netfilter on loopback or on a bridge of containers, netem) drops them
 * all, which is the one loss copies are there to survive. */
#define UDT_SEND_APART 1u

struct udt_send_item {
    uint32_t peer;
    const void *header;
    uint32_t header_bytes;
    const void *payload;
    uint32_t payload_bytes;
    uint32_t flags; /* UDT_SEND_* */
};

struct udt_recv_item {
    const uint8_t *data;
    uint32_t bytes;
    int32_t peer;
};

struct udt_transport;

struct udt_transport_ops {
    const char *name;
    int (*set_peers)(struct udt_transport *t, const uint8_t *addresses, uint32_t address_bytes, uint32_t count);
    int (*send_batch)(struct udt_transport *t, const struct udt_send_item *items, int count);
    int (*recv_batch)(struct udt_transport *t, struct udt_recv_item *items, int max_items);
    int (*wait)(struct udt_transport *t, int timeout_us);
    void (*destroy)(struct udt_transport *t);
};

/* What the transport heard of peers' ports: UDP counts the ICMP port unreachable messages
 * that come back for datagrams sent to each peer (IP_RECVERR). Evidence, never a verdict:
 * anyone who can send to us can send ICMP, so one counts only when the datagram it quotes
 * carries `quote` at `quote_offset` (the engine puts its session id there: a stranger cannot
 * know it), and even then the engine asks its peers before it names anyone (liveness.c,
 * "evidence of a closed port"). Kept by the transport that sends; wrappers share the pointer. */
#define UDT_QUOTE_MAX 16
struct udt_peer_ports {
    uint32_t bounce_count;  /* sum of bounces[]: the engine scans only when it moves */
    uint32_t peer_count;
    uint32_t quote_offset, quote_bytes; /* 0 bytes: nothing is counted */
    uint8_t quote[UDT_QUOTE_MAX];
    uint32_t bounces[];     /* per peer */
};

struct udt_transport {
    const struct udt_transport_ops *ops;
    uint32_t max_datagram_bytes; /* header + payload that one datagram can carry */
    uint32_t address_bytes;
    uint8_t address[UDT_ADDRESS_MAX]; /* what peers need to reach us */
    uint64_t counter_injected_drops; /* filled by the loss-injection wrapper */
    uint64_t counter_receive_overflows; /* datagrams the kernel dropped at our socket, its receive queue full
                                         * (UDP: SO_RXQ_OVFL, as reported with the next datagram received) */
    uint64_t counter_send_calls;    /* send system calls made, refused ones too (UDP: sendmmsg); 0 where not counted (verbs, memory) */
    uint64_t counter_receive_calls; /* system calls that returned datagrams (UDP: recvmmsg) */
    struct udt_peer_ports *ports; /* bounces from peers' ports; NULL where the transport cannot tell (verbs, memory) */
    struct udt_error error; /* of the last failed operation */
};

static inline int udt_transport_set_peers(struct udt_transport *t, const uint8_t *a, uint32_t b, uint32_t n) { return t->ops->set_peers(t, a, b, n); }
static inline int udt_transport_send(struct udt_transport *t, const struct udt_send_item *i, int n) { return t->ops->send_batch(t, i, n); }
static inline int udt_transport_recv(struct udt_transport *t, struct udt_recv_item *i, int n) { return t->ops->recv_batch(t, i, n); }
static inline int udt_transport_wait(struct udt_transport *t, int us) { return t->ops->wait(t, us); }
static inline void udt_transport_destroy(struct udt_transport *t) { if (t) t->ops->destroy(t); }

/* A transport built in another extension (the optional verbs one, ud_transport._verbs) reaches
 * the engine in ud_transport._native as a PyCapsule of this name holding its struct udt_transport *.
 * The engine renames the capsule when it adopts the transport, so the capsule's destructor
 * destroys only a transport nobody took. Both extensions come from one build of this header. */
#define UDT_TRANSPORT_CAPSULE "ud_transport.udt_transport"
#define UDT_TRANSPORT_CAPSULE_ADOPTED "ud_transport.udt_transport.adopted"

#endif
