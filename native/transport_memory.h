/* The simulator's network: endpoints in one process, no sockets. */
#ifndef UDT_TRANSPORT_MEMORY_H
#define UDT_TRANSPORT_MEMORY_H

#include <stdint.h>

#include "transport.h"

/* In-memory network of N endpoints in one process (the simulator's): in-order
 * delivery, at once or after a fixed delay; endpoint i's peer j is endpoint j. */
struct udt_memory_network;
struct udt_memory_network *udt_memory_network_create(uint32_t world_size, uint32_t max_datagram_bytes);
void udt_memory_network_destroy(struct udt_memory_network *network);
struct udt_transport *udt_memory_open(struct udt_memory_network *network, uint32_t rank);
/* A sender that can hand out only so many data datagrams (a busy CPU or a slow
 * NIC, paced by the simulator): endpoint `rank` takes at most `datagrams` more
 * datagrams with a payload (data, verdicts), refusing the rest like a full
 * socket (-1: no limit). Header-only datagrams (credits, END markers, JOIN)
 * always go. The second call reads what is left of the allowance. */
void udt_memory_set_send_allowance(struct udt_memory_network *network, uint32_t rank, int64_t datagrams);
int64_t udt_memory_send_allowance(const struct udt_memory_network *network, uint32_t rank);
/* How long after it is sent a datagram is delivered (0, the default: at once), and the
 * simulator's clock, which that delay counts on. */
void udt_memory_set_delay(struct udt_memory_network *network, uint64_t delay_ns);
void udt_memory_set_clock(struct udt_memory_network *network, uint64_t now_ns);
/* When the first datagram queued for `rank` is delivered (UINT64_MAX: none queued). */
uint64_t udt_memory_next_arrival(const struct udt_memory_network *network, uint32_t rank);

#endif
