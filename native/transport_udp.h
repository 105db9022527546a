/* The UDP transport: its constructor, what it is doing, and its counters. */
#ifndef UDT_TRANSPORT_UDP_H
#define UDT_TRANSPORT_UDP_H

#include <stdint.h>

#include "transport.h"

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

#endif
