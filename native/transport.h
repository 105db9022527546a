/* The one interface every datagram transport implements (UDP, verbs UD, the
 * loss-injection wrapper). The ring engine knows nothing else about them.
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

struct udt_send_item {
    uint32_t peer;
    const void *header;
    uint32_t header_bytes;
    const void *payload;
    uint32_t payload_bytes;
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
 * know it), and even then the engine asks its peers before it names anyone (engine.c,
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

/* UDP: one non-blocking socket bound to bind_ipv4:port (port 0 picks one).
 * Where the kernel allows, consecutive send items to one peer with the same
 * size go out as one UDP GSO message (UDP_SEGMENT), and the socket takes GRO
 * receives (UDP_GRO), split back into datagrams by recv_batch. Environment:
 * UD_UDP_GSO=0 / UD_UDP_GRO=0 turn either off when the transport opens. */
struct udt_transport *udt_udp_open(const char *bind_ipv4, uint16_t port, uint32_t socket_buffer_bytes, struct udt_error *error);

/* What a UDP transport is doing (udt_udp_features). The functions below take
 * the UDP transport itself, not a loss-injection wrapper around it; given
 * anything else they return 0 (or -EINVAL). */
#define UDT_UDP_GSO 1u              /* sends coalesced with UDP_SEGMENT */
#define UDT_UDP_GRO 2u              /* receives may hold many datagrams (UDP_GRO) */
#define UDT_UDP_RCVBUF_FORCED 4u    /* SO_RCVBUFFORCE took: the buffer is not capped by net.core.rmem_max */
#define UDT_UDP_GSO_REFUSED 8u      /* the kernel refused a GSO send; GSO is off since (datagrams resent without it) */
#define UDT_UDP_DROPS_COUNTED 16u   /* SO_RXQ_OVFL took: datagrams dropped at the full socket are counted */
#define UDT_UDP_PORTS_WATCHED 32u   /* IP_RECVERR took: a peer's closed port is noticed (struct udt_peer_ports) */
#define UDT_UDP_PATH_MTU_IGNORED 64u /* IP_PMTUDISC_PROBE took: datagrams are sized by the interface, never by an ICMP message */
uint32_t udt_udp_features(const struct udt_transport *t);
/* Turn features off (UDT_UDP_GSO, UDT_UDP_GRO) on an open transport, e.g. to
 * measure or test the plain path. Returns 0, or -EINVAL if t is not UDP. */
int udt_udp_disable(struct udt_transport *t, uint32_t features);
/* The receive buffer the kernel granted, as getsockopt(SO_RCVBUF) reports it:
 * twice what was asked (the kernel's bookkeeping share), capped at
 * 2 x net.core.rmem_max unless UDT_UDP_RCVBUF_FORCED. Each queued datagram is
 * charged its skb truesize against it, well above its payload; see
 * scripts/bench_wire.py --fill for measured payload per granted byte. */
uint32_t udt_udp_receive_buffer_bytes(const struct udt_transport *t);
uint32_t udt_udp_send_buffer_bytes(const struct udt_transport *t);
/* One line for logs and `info`, e.g. "gso=on gro=on rcvbuf=8388608
 * (capped by net.core.rmem_max) (asked 67108864) sndbuf=8388608 max_datagram=1472". */
int udt_udp_describe(const struct udt_transport *t, char *text, int text_bytes);
struct udt_udp_counters {
    uint64_t send_calls;         /* sendmmsg calls */
    uint64_t send_messages;      /* messages they took (a GSO message counts once) */
    uint64_t send_gso_messages;  /* of which carried UDP_SEGMENT */
    uint64_t send_gso_datagrams; /* datagrams inside those */
    uint64_t recv_calls;         /* recvmmsg calls that returned something */
    uint64_t recv_messages;      /* messages they returned */
    uint64_t recv_gro_messages;  /* of which held more than one datagram */
    uint64_t recv_gro_datagrams; /* datagrams split out of those */
    uint64_t icmp_errors;        /* ICMP errors read from the error queue (a closed port is one kind) */
    uint64_t icmp_unverified;    /* of which port unreachable quoting a datagram that was not ours (forged): dropped */
    uint64_t send_refused;       /* messages the network refused (an errno other than a full buffer): skipped as loss */
    uint64_t icmp_too_big;       /* "fragmentation needed" quoting one of our datagrams: a link on the path is narrower
                                    than our datagrams, which it drops (lower the mtu option); forged ones are not counted */
};
int udt_udp_counters(const struct udt_transport *t, struct udt_udp_counters *out);

/* Seeded loss injection in front of another transport's receive path. */
enum udt_loss_kind { UDT_LOSS_NONE = 0, UDT_LOSS_BERNOULLI = 1, UDT_LOSS_GILBERT_ELLIOTT = 2 };
struct udt_loss_model {
    int kind;
    double loss;            /* Bernoulli: drop probability */
    double good_to_bad;     /* Gilbert-Elliott: per-datagram transition probabilities */
    double bad_to_good;
    double loss_in_good;
    double loss_in_bad;
    uint64_t seed;
};
struct udt_transport *udt_lossy_wrap(struct udt_transport *inner, const struct udt_loss_model *model);

/* In-memory network of N endpoints in one process (the simulator's): instant,
 * in-order delivery; endpoint i's peer j is endpoint j. */
struct udt_memory_network;
struct udt_memory_network *udt_memory_network_create(uint32_t world_size, uint32_t max_datagram_bytes);
void udt_memory_network_destroy(struct udt_memory_network *network);
struct udt_transport *udt_memory_open(struct udt_memory_network *network, uint32_t rank);
/* A sender that can hand out only so many data datagrams (a busy CPU or a slow
 * NIC, paced by the simulator): endpoint `rank` takes at most `datagrams` more
 * datagrams with a payload, refusing the rest like a full socket (-1: no limit).
 * Header-only datagrams (credits, END markers, JOIN, verdicts) always go. The
 * second call reads what is left of the allowance. */
void udt_memory_set_send_allowance(struct udt_memory_network *network, uint32_t rank, int64_t datagrams);
int64_t udt_memory_send_allowance(const struct udt_memory_network *network, uint32_t rank);

#endif
