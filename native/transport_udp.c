/* UDP transport: one non-blocking socket per rank, batched with
 * sendmmsg/recvmmsg, large kernel buffers so bursts are absorbed.
 *
 * Where the kernel allows it, its own batching is used as well:
 *  - GSO (UDP_SEGMENT): consecutive send items to one peer with the same
 *    size (the last of a run may be shorter) go out as one message whose
 *    iovec is [header1, payload1, header2, payload2, ...]; the kernel (or the
 *    NIC) cuts it into datagrams of that size. One message holds at most
 *    UDP_GSO_MAX_SEGMENTS datagrams and UDP_GSO_MAX_BYTES bytes. Payloads
 *    are still read straight from the caller's memory. An item marked
 *    UDT_SEND_APART (a copy) starts a message of its own.
 *  - GRO (UDP_GRO): one receive may return many datagrams of one sender
 *    back to back; a control message gives their size and recv_batch splits
 *    them into separate items (the last may be shorter).
 * A kernel that refuses a GSO send turns GSO off for the socket, and the
 * datagrams go out again without it (udt_udp_features says so). */
#define _GNU_SOURCE
#include "transport_udp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <linux/errqueue.h>
#include <netinet/ip_icmp.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define UDP_RECV_SLOTS 64
#define UDP_SLOT_BYTES 65536u   /* one receive: a datagram, or a GRO train of them (at most 64 KiB) */
#define UDP_MAX_DATAGRAM 65507u /* 65535 - IPv4 header - UDP header */
#define UDP_IP_OVERHEAD 28u
#define UDP_SEND_MESSAGES 64    /* messages per sendmmsg */
#define UDP_SEND_ITEMS 512      /* send items per sendmmsg (bounds the iovec table) */
#define UDP_GSO_MAX_SEGMENTS 64
#define UDP_GSO_MAX_BYTES 65000u

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef SO_RXQ_OVFL
#define SO_RXQ_OVFL 40
#endif

struct udp_transport {
    struct udt_transport base;
    int fd;
    uint32_t features;
    int gso_refused_errno;
    uint32_t receive_drops_seen; /* the kernel's drop count for the socket, as last reported (SO_RXQ_OVFL) */
    uint32_t receive_buffer_asked, receive_buffer_bytes, send_buffer_bytes;
    uint32_t peer_count;
    struct sockaddr_in *peers;
    struct udt_peer_ports *ports; /* base.ports: which peers' ports came back unreachable */
    int32_t last_peer_hit;
    struct udt_udp_counters counters;

    /* send scratch: messages, how many items each carries, iovecs, GSO control */
    struct mmsghdr send_msgs[UDP_SEND_MESSAGES];
    uint32_t send_items_in[UDP_SEND_MESSAGES];
    union {
        char bytes[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } send_control[UDP_SEND_MESSAGES];
    struct iovec send_iov[2 * UDP_SEND_ITEMS];

    /* receive slots, and what the last recvmmsg put in them */
    uint8_t *recv_buffers;
    struct mmsghdr recv_msgs[UDP_RECV_SLOTS];
    struct iovec recv_iov[UDP_RECV_SLOTS];
    struct sockaddr_in recv_from[UDP_RECV_SLOTS];
    union {
        char bytes[CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(uint32_t))]; /* GRO segment size, socket drop count */
        struct cmsghdr align;
    } recv_control[UDP_RECV_SLOTS];
    uint32_t slot_bytes[UDP_RECV_SLOTS];    /* bytes of whole datagrams held (0: one empty or truncated datagram) */
    uint32_t slot_segment[UDP_RECV_SLOTS];  /* datagram size of a GRO train; 0: the slot holds one datagram */
    uint8_t slot_truncated[UDP_RECV_SLOTS]; /* a GRO train cut short: a 0-byte item follows its whole datagrams */
    int32_t slot_peer[UDP_RECV_SLOTS];
    /* datagrams of the last recvmmsg not yet handed out (they stay in their slots) */
    int pending_slots, pending_slot;
    uint32_t pending_index;
};

static const struct udt_transport_ops udp_ops;

static struct udp_transport *as_udp(const struct udt_transport *t)
{
    return t && t->ops == &udp_ops ? (struct udp_transport *)t : NULL;
}

/* Ask for `bytes` of socket buffer (FORCE ignores net.core.[rw]mem_max but
 * needs CAP_NET_ADMIN; else the plain option, which the kernel caps), then
 * read back what was granted. Returns 1 when FORCE took. */
static int set_buffer(int fd, int force_option, int option, uint32_t bytes, uint32_t *granted)
{
    int value = bytes > (uint32_t)(INT_MAX / 2) ? INT_MAX / 2 : (int)bytes;
    int forced = setsockopt(fd, SOL_SOCKET, force_option, &value, sizeof value) == 0;
    if (!forced)
        setsockopt(fd, SOL_SOCKET, option, &value, sizeof value);
    int now = 0;
    socklen_t length = sizeof now;
    *granted = getsockopt(fd, SOL_SOCKET, option, &now, &length) == 0 && now > 0 ? (uint32_t)now : 0;
    return forced;
}

static int env_disabled(const char *name)
{
    const char *value = getenv(name);
    return value && (!strcmp(value, "0") || !strcasecmp(value, "off") || !strcasecmp(value, "no") || !strcasecmp(value, "false"));
}

/* MTU of the interface that owns `address` (loopback for 127/8). */
static uint32_t interface_mtu(struct in_addr address)
{
    struct ifaddrs *list = NULL, *entry;
    uint32_t mtu = 1500;
    if (getifaddrs(&list) != 0)
        return mtu;
    int probe = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    for (entry = list; entry; entry = entry->ifa_next) {
        if (!entry->ifa_addr || entry->ifa_addr->sa_family != AF_INET)
            continue;
        struct in_addr ifaddr = ((struct sockaddr_in *)entry->ifa_addr)->sin_addr;
        int loopback_match = (ntohl(address.s_addr) >> 24) == 127 && (entry->ifa_flags & IFF_LOOPBACK);
        if (ifaddr.s_addr != address.s_addr && !loopback_match)
            continue;
        struct ifreq request;
        memset(&request, 0, sizeof request);
        snprintf(request.ifr_name, sizeof request.ifr_name, "%s", entry->ifa_name);
        if (probe >= 0 && ioctl(probe, SIOCGIFMTU, &request) == 0)
            mtu = (uint32_t)request.ifr_mtu;
        break;
    }
    if (probe >= 0)
        close(probe);
    freeifaddrs(list);
    return mtu;
}

static int udp_set_peers(struct udt_transport *t, const uint8_t *addresses, uint32_t address_bytes, uint32_t count)
{
    struct udp_transport *u = (struct udp_transport *)t;
    if (address_bytes != 6) {
        udt_error_check(&t->error, "udp: peer address must be 6 bytes (IPv4 + port), got %u", address_bytes);
        return -EINVAL;
    }
    struct sockaddr_in *peers = calloc(count ? count : 1, sizeof *peers);
    if (!peers)
        return -ENOMEM;
    for (uint32_t i = 0; i < count; i++) {
        peers[i].sin_family = AF_INET;
        memcpy(&peers[i].sin_addr, addresses + 6 * i, 4);
        memcpy(&peers[i].sin_port, addresses + 6 * i + 4, 2);
    }
    struct udt_peer_ports *ports = NULL;
    if (u->features & UDT_UDP_PORTS_WATCHED) {
        if (!(ports = calloc(1, sizeof *ports + (count ? count : 1) * sizeof ports->bounces[0]))) {
            free(peers);
            return -ENOMEM;
        }
        ports->peer_count = count;
    }
    free(u->peers);
    free(u->ports);
    u->peers = peers;
    u->ports = ports;
    t->ports = ports;
    u->peer_count = count;
    u->last_peer_hit = -1;
    return 0;
}

static int32_t lookup_peer(struct udp_transport *u, const struct sockaddr_in *from)
{
    int32_t hint = u->last_peer_hit;
    if (hint >= 0 && u->peers[hint].sin_addr.s_addr == from->sin_addr.s_addr && u->peers[hint].sin_port == from->sin_port)
        return hint;
    for (uint32_t i = 0; i < u->peer_count; i++) {
        if (u->peers[i].sin_addr.s_addr == from->sin_addr.s_addr && u->peers[i].sin_port == from->sin_port) {
            u->last_peer_hit = (int32_t)i;
            return (int32_t)i;
        }
    }
    return -1;
}

/* Errors that say this socket or this call is broken, not the network: everything else a send
 * or receive reports (an ICMP error of any type or code about an earlier datagram, delivered
 * once by whichever call comes next; a firewall's EPERM; ENOBUFS) is loss, never a failure:
 * a stranger who can send ICMP to us must not be able to end a call. */
static int socket_broken(int error)
{
    return error == EBADF || error == ENOTSOCK || error == EFAULT || error == EDESTADDRREQ || error == EAFNOSUPPORT ||
           error == EINVAL;
}

/* How many times a send refused by a pending error is tried again before its message counts as
 * lost: each refusal consumes the error it reported, so only a storm of them refuses again. */
#define SEND_REFUSALS_RETRIED 4

/* Whether the datagram an ICMP message quotes (its first `length` bytes) carries the engine's
 * mark (struct udt_peer_ports): only then did we send it. */
static int quote_is_ours(const struct udt_peer_ports *ports, const uint8_t *quoted, size_t length)
{
    return ports->quote_bytes && length >= (size_t)ports->quote_offset + ports->quote_bytes &&
           memcmp(quoted + ports->quote_offset, ports->quote, ports->quote_bytes) == 0;
}

/* Read the socket's error queue (IP_RECVERR), which also clears its pending error. A port
 * unreachable quoting one of our datagrams to a peer is counted against that peer (evidence
 * that its socket is gone, which the engine weighs); every other ICMP error, and one quoting a
 * datagram that is not ours, changes nothing but counters. */
static void drain_errors(struct udp_transport *u)
{
    for (int read = 0; read < 1024; read++) { /* bounded: a storm cannot hold a call here */
        struct sockaddr_in destination;
        union {
            char bytes[CMSG_SPACE(sizeof(struct sock_extended_err) + sizeof(struct sockaddr_in))];
            struct cmsghdr align;
        } control;
        uint8_t payload[64];
        struct iovec iov = {.iov_base = payload, .iov_len = sizeof payload};
        struct msghdr h = {.msg_name = &destination, .msg_namelen = sizeof destination, .msg_iov = &iov, .msg_iovlen = 1,
                           .msg_control = control.bytes, .msg_controllen = sizeof control.bytes};
        ssize_t quoted = recvmsg(u->fd, &h, MSG_ERRQUEUE | MSG_DONTWAIT);
        if (quoted < 0)
            return;
        u->counters.icmp_errors++;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&h); c; c = CMSG_NXTHDR(&h, c)) {
            if (c->cmsg_level != SOL_IP || c->cmsg_type != IP_RECVERR)
                continue;
            struct sock_extended_err e;
            memcpy(&e, CMSG_DATA(c), sizeof e);
            if (e.ee_origin != SO_EE_ORIGIN_ICMP || e.ee_type != ICMP_DEST_UNREACH || !u->ports)
                continue;
            int ours = quote_is_ours(u->ports, payload, (size_t)quoted);
            if (e.ee_code == ICMP_FRAG_NEEDED) /* with IP_PMTUDISC_PROBE only a diagnosis: nothing changes size */
                u->counters.icmp_too_big += (uint64_t)ours;
            if (e.ee_code != ICMP_PORT_UNREACH)
                continue;
            if (!ours) {
                u->counters.icmp_unverified++;
                continue;
            }
            int32_t peer = h.msg_namelen >= sizeof destination ? lookup_peer(u, &destination) : -1;
            if (peer >= 0) {
                u->ports->bounces[peer]++;
                u->ports->bounce_count++;
            }
        }
    }
}

/* ---- send ---------------------------------------------------------------- */

static inline uint32_t item_bytes(const struct udt_send_item *item) { return item->header_bytes + item->payload_bytes; }

/* How many items from items[0] go out as one GSO message: same peer, same
 * size as the first (one shorter item may end the run), within the kernel's
 * limits. 1 when GSO is off or the size cannot be a GSO segment. */
static int gso_run(const struct udp_transport *u, const struct udt_send_item *items, int count, int iov_room)
{
    uint32_t size = item_bytes(&items[0]);
    if (!(u->features & UDT_UDP_GSO) || size == 0 || size > u->base.max_datagram_bytes)
        return 1;
    int run = 1;
    uint32_t total = size;
    while (run < count && run < UDP_GSO_MAX_SEGMENTS && 2 * (run + 1) <= iov_room) {
        const struct udt_send_item *item = &items[run];
        uint32_t bytes = item_bytes(item);
        if (item->peer != items[0].peer || bytes == 0 || bytes > size || total + bytes > UDP_GSO_MAX_BYTES ||
            (item->flags & UDT_SEND_APART))
            break;
        total += bytes;
        run++;
        if (bytes < size)
            break; /* only the last datagram of a GSO message may be shorter */
    }
    return run;
}

/* Fill the send scratch from items; returns the number of messages. */
static int build_messages(struct udp_transport *u, const struct udt_send_item *items, int count)
{
    int messages = 0, iovs = 0, next = 0;
    while (next < count && messages < UDP_SEND_MESSAGES && iovs + 2 <= 2 * UDP_SEND_ITEMS) {
        const struct udt_send_item *first = &items[next];
        int run = gso_run(u, first, count - next, 2 * UDP_SEND_ITEMS - iovs);
        struct msghdr *h = &u->send_msgs[messages].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &u->peers[first->peer];
        h->msg_namelen = sizeof(struct sockaddr_in);
        h->msg_iov = &u->send_iov[iovs];
        for (int i = 0; i < run; i++) {
            const struct udt_send_item *item = &first[i];
            if (item->header_bytes)
                u->send_iov[iovs++] = (struct iovec){.iov_base = (void *)item->header, .iov_len = item->header_bytes};
            if (item->payload_bytes)
                u->send_iov[iovs++] = (struct iovec){.iov_base = (void *)item->payload, .iov_len = item->payload_bytes};
        }
        h->msg_iovlen = (size_t)(&u->send_iov[iovs] - h->msg_iov);
        if (run > 1) {
            uint16_t segment = (uint16_t)item_bytes(first);
            h->msg_control = u->send_control[messages].bytes;
            h->msg_controllen = CMSG_SPACE(sizeof segment);
            struct cmsghdr *c = CMSG_FIRSTHDR(h);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof segment);
            memcpy(CMSG_DATA(c), &segment, sizeof segment);
        }
        u->send_items_in[messages++] = (uint32_t)run;
        next += run;
    }
    return messages;
}

/* A socket call failed: name the socket by the address it is bound to. */
static void udp_call_failed(struct udp_transport *u, const char *call, int err)
{
    const uint8_t *a = u->base.address;
    udt_error_call(&u->base.error, call, err, NULL, "udp %u.%u.%u.%u:%u", a[0], a[1], a[2], a[3], (unsigned)(a[4] << 8 | a[5]));
}

static int udp_send_batch(struct udt_transport *t, const struct udt_send_item *items, int count)
{
    struct udp_transport *u = (struct udp_transport *)t;
    for (int i = 0; i < count; i++) {
        if (items[i].peer >= u->peer_count) {
            udt_error_check(&t->error, "udp: send to unknown peer %u", items[i].peer);
            return -EINVAL;
        }
    }
    int done = 0, refusals = 0;
    while (done < count) {
        int messages = build_messages(u, items + done, count - done);
        int sent = sendmmsg(u->fd, u->send_msgs, (unsigned)messages, MSG_DONTWAIT);
        t->counter_send_calls++;
        if (sent < 0) {
            int error = errno;
            if (error == EAGAIN || error == ENOBUFS || error == EINTR)
                return done;
            /* An error about an earlier datagram (ICMP of any type or code) is reported once, by
             * whichever call comes next: read the error queue, and send again. */
            uint64_t icmp_before = u->counters.icmp_errors;
            if (u->features & UDT_UDP_PORTS_WATCHED)
                drain_errors(u);
            int about_earlier = u->counters.icmp_errors != icmp_before;
            /* The first message failed. A GSO message the kernel will not
             * take (no UDP_SEGMENT, no checksum offload on the route, a
             * path MTU below the segment), refused twice in a row: GSO off
             * for good, send again. */
            if (!about_earlier && u->send_items_in[0] > 1 &&
                (error == EINVAL || error == ENOPROTOOPT || error == EIO || error == EOPNOTSUPP || error == EMSGSIZE)) {
                if (refusals++ == 0)
                    continue;
                refusals = 0;
                u->features = (u->features & ~UDT_UDP_GSO) | UDT_UDP_GSO_REFUSED;
                u->gso_refused_errno = error;
                continue;
            }
            if (!about_earlier && socket_broken(error)) {
                udp_call_failed(u, "sendmmsg", error);
                return -error;
            }
            /* The network refused this message (a firewall, no route) or errors about earlier
             * ones keep coming: after a few refusals in a row the message counts as lost and
             * the batch goes on. Never a failure of the call. */
            if (++refusals <= SEND_REFUSALS_RETRIED)
                continue;
            u->counters.send_refused++;
            done += (int)u->send_items_in[0];
            refusals = 0;
            continue;
        }
        for (int i = 0; i < sent; i++) {
            done += (int)u->send_items_in[i];
            if (u->send_items_in[i] > 1) {
                u->counters.send_gso_messages++;
                u->counters.send_gso_datagrams += u->send_items_in[i];
            }
        }
        u->counters.send_messages += (uint64_t)sent;
        refusals = 0;
        /* Fewer than asked: the next call reports why (a full buffer ends
         * the batch; a refused message is skipped or resent above). */
    }
    return done;
}

/* ---- receive ------------------------------------------------------------- */

static uint32_t slot_items(const struct udp_transport *u, int slot)
{
    uint32_t bytes = u->slot_bytes[slot], segment = u->slot_segment[slot];
    if (bytes == 0)
        return 1;
    return (segment ? (bytes + segment - 1) / segment : 1) + u->slot_truncated[slot];
}

/* Hand out datagrams still waiting in the slots, in arrival order. */
static int emit_pending(struct udp_transport *u, struct udt_recv_item *items, int max_items)
{
    int n = 0;
    while (n < max_items && u->pending_slot < u->pending_slots) {
        int slot = u->pending_slot;
        uint32_t count = slot_items(u, slot), bytes = u->slot_bytes[slot];
        uint32_t segment = u->slot_segment[slot] ? u->slot_segment[slot] : bytes;
        const uint8_t *base = u->recv_iov[slot].iov_base;
        while (n < max_items && u->pending_index < count) {
            uint64_t offset = (uint64_t)u->pending_index * segment;
            struct udt_recv_item *item = &items[n++];
            item->peer = u->slot_peer[slot];
            if (offset < bytes) {
                item->data = base + offset;
                item->bytes = bytes - offset < segment ? bytes - (uint32_t)offset : segment;
            } else {
                /* An empty datagram, or what a truncated receive cut off: a
                 * length no valid datagram has, so the engine drops it. */
                item->data = base;
                item->bytes = 0;
            }
            u->pending_index++;
        }
        if (u->pending_index == count) {
            u->pending_slot++;
            u->pending_index = 0;
        }
    }
    return n;
}

static int udp_recv_batch(struct udt_transport *t, struct udt_recv_item *items, int max_items)
{
    struct udp_transport *u = (struct udp_transport *)t;
    if (max_items <= 0)
        return 0;
    if (u->pending_slot < u->pending_slots)
        return emit_pending(u, items, max_items);

    int want = max_items < UDP_RECV_SLOTS ? max_items : UDP_RECV_SLOTS;
    for (int i = 0; i < want; i++) {
        struct msghdr *h = &u->recv_msgs[i].msg_hdr;
        h->msg_namelen = sizeof(struct sockaddr_in);
        h->msg_flags = 0;
        /* Always offered: a GRO train queued before GRO was turned off still
         * comes with its segment size. */
        h->msg_control = u->recv_control[i].bytes;
        h->msg_controllen = sizeof u->recv_control[i].bytes;
    }
    int got = recvmmsg(u->fd, u->recv_msgs, (unsigned)want, MSG_DONTWAIT, NULL);
    if (got < 0) {
        int error = errno;
        if (error == EAGAIN || error == EINTR)
            return 0;
        if (!socket_broken(error)) { /* an error about an earlier datagram of ours (ICMP): evidence or loss */
            if (u->features & UDT_UDP_PORTS_WATCHED)
                drain_errors(u);
            return 0;
        }
        udp_call_failed(u, "recvmmsg", error);
        return -error;
    }
    if (got > 0)
        t->counter_receive_calls++;
    for (int i = 0; i < got; i++) {
        struct msghdr *h = &u->recv_msgs[i].msg_hdr;
        uint32_t bytes = u->recv_msgs[i].msg_len, segment = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c)) {
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
                int size;
                memcpy(&size, CMSG_DATA(c), sizeof size);
                segment = size > 0 ? (uint32_t)size : 0;
            } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL && c->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
                uint32_t dropped; /* the socket's drop count since it opened (wraps at 2^32) */
                memcpy(&dropped, CMSG_DATA(c), sizeof dropped);
                t->counter_receive_overflows += (uint32_t)(dropped - u->receive_drops_seen);
                u->receive_drops_seen = dropped;
            }
        }
        if (segment >= bytes)
            segment = 0;
        u->slot_truncated[i] = 0;
        if (h->msg_flags & MSG_TRUNC) {
            /* Larger than the slot: a lone datagram is reported as 0 bytes;
             * of a GRO train, the whole datagrams are kept. */
            u->slot_truncated[i] = segment != 0;
            bytes = segment ? bytes - bytes % segment : 0;
        }
        u->slot_bytes[i] = bytes;
        u->slot_segment[i] = segment;
        u->slot_peer[i] = lookup_peer(u, &u->recv_from[i]);
        if (segment) {
            u->counters.recv_gro_messages++;
            u->counters.recv_gro_datagrams += slot_items(u, i) - u->slot_truncated[i];
        }
    }
    u->counters.recv_messages += (uint64_t)got;
    u->pending_slots = got;
    u->pending_slot = 0;
    u->pending_index = 0;
    return emit_pending(u, items, max_items);
}

static int udp_wait(struct udt_transport *t, int timeout_us)
{
    struct udp_transport *u = (struct udp_transport *)t;
    if (u->pending_slot < u->pending_slots)
        return 0; /* datagrams of a GRO train are still to be handed out */
    struct pollfd pfd = {.fd = u->fd, .events = POLLIN};
    struct timespec timeout = {.tv_sec = timeout_us / 1000000, .tv_nsec = (long)(timeout_us % 1000000) * 1000};
    int ready = ppoll(&pfd, 1, &timeout, NULL);
    if (ready > 0 && (pfd.revents & POLLERR)) /* the error queue holds something: poll would not sleep again */
        drain_errors(u);
    return ready < 0 && errno != EINTR ? -errno : 0;
}

static void udp_destroy(struct udt_transport *t)
{
    struct udp_transport *u = (struct udp_transport *)t;
    if (u->fd >= 0)
        close(u->fd);
    free(u->peers);
    free(u->ports);
    free(u->recv_buffers);
    free(u);
}

static const struct udt_transport_ops udp_ops = {
    .name = "udp",
    .set_peers = udp_set_peers,
    .send_batch = udp_send_batch,
    .recv_batch = udp_recv_batch,
    .wait = udp_wait,
    .destroy = udp_destroy,
};

/* ---- features and buffers ------------------------------------------------ */

static int enable_gso(struct udp_transport *u)
{
    int off = 0; /* per-socket default 0: segments come per message; this only asks whether the kernel knows UDP_SEGMENT */
    return setsockopt(u->fd, SOL_UDP, UDP_SEGMENT, &off, sizeof off) == 0;
}

static int set_gro(struct udp_transport *u, int on)
{
    return setsockopt(u->fd, SOL_UDP, UDP_GRO, &on, sizeof on) == 0;
}

uint32_t udt_udp_features(const struct udt_transport *t)
{
    const struct udp_transport *u = as_udp(t);
    return u ? u->features : 0;
}

int udt_udp_disable(struct udt_transport *t, uint32_t features)
{
    struct udp_transport *u = as_udp(t);
    if (!u)
        return -EINVAL;
    if ((features & UDT_UDP_GRO) && (u->features & UDT_UDP_GRO))
        set_gro(u, 0);
    u->features &= ~(features & (UDT_UDP_GSO | UDT_UDP_GRO));
    return 0;
}

uint32_t udt_udp_receive_buffer_bytes(const struct udt_transport *t)
{
    const struct udp_transport *u = as_udp(t);
    return u ? u->receive_buffer_bytes : 0;
}

uint32_t udt_udp_send_buffer_bytes(const struct udt_transport *t)
{
    const struct udp_transport *u = as_udp(t);
    return u ? u->send_buffer_bytes : 0;
}

int udt_udp_counters(const struct udt_transport *t, struct udt_udp_counters *out)
{
    const struct udp_transport *u = as_udp(t);
    if (!u)
        return -EINVAL;
    *out = u->counters;
    out->send_calls = t->counter_send_calls; /* counted once, in the base the engine reads */
    out->recv_calls = t->counter_receive_calls;
    return 0;
}

int udt_udp_describe(const struct udt_transport *t, char *text, int text_bytes)
{
    const struct udp_transport *u = as_udp(t);
    if (!u || text_bytes <= 0)
        return -EINVAL;
    char gso[64];
    if (u->features & UDT_UDP_GSO)
        snprintf(gso, sizeof gso, "on");
    else if (u->features & UDT_UDP_GSO_REFUSED)
        snprintf(gso, sizeof gso, "off (kernel refused: %s)", strerror(u->gso_refused_errno));
    else
        snprintf(gso, sizeof gso, "off");
    const char *buffer_note = (u->features & UDT_UDP_RCVBUF_FORCED) ? " (SO_RCVBUFFORCE)"
                              : u->receive_buffer_bytes / 2 < u->receive_buffer_asked ? " (capped by net.core.rmem_max)"
                                                                                      : "";
    return snprintf(text, (size_t)text_bytes, "gso=%s gro=%s rcvbuf=%u%s (asked %u) sndbuf=%u max_datagram=%u", gso,
                    (u->features & UDT_UDP_GRO) ? "on" : "off", u->receive_buffer_bytes, buffer_note,
                    u->receive_buffer_asked, u->send_buffer_bytes, u->base.max_datagram_bytes);
}

struct udt_transport *udt_udp_open(const char *bind_ipv4, uint16_t port, uint32_t socket_buffer_bytes, struct udt_error *error)
{
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, bind_ipv4, &address.sin_addr) != 1) {
        udt_error_check(error, "udp: bind address %s is not an IPv4 address", bind_ipv4);
        return NULL;
    }
    if (address.sin_addr.s_addr == htonl(INADDR_ANY)) {
        udt_error_check(error, "udp: bind to a specific address, not 0.0.0.0: peers need an address to send to");
        return NULL;
    }
    struct udp_transport *u = calloc(1, sizeof *u);
    if (!u) {
        udt_error_call(error, "calloc", ENOMEM, NULL, "udp transport of %zu bytes", sizeof *u);
        return NULL;
    }
    u->base.ops = &udp_ops;
    u->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (u->fd < 0) {
        udt_error_call(error, "socket", errno, NULL, "AF_INET SOCK_DGRAM");
        free(u);
        return NULL;
    }
    u->receive_buffer_asked = socket_buffer_bytes;
    if (set_buffer(u->fd, SO_RCVBUFFORCE, SO_RCVBUF, socket_buffer_bytes, &u->receive_buffer_bytes))
        u->features |= UDT_UDP_RCVBUF_FORCED;
    set_buffer(u->fd, SO_SNDBUFFORCE, SO_SNDBUF, socket_buffer_bytes, &u->send_buffer_bytes);
    if (!env_disabled("UD_UDP_GSO") && enable_gso(u))
        u->features |= UDT_UDP_GSO;
    if (!env_disabled("UD_UDP_GRO") && set_gro(u, 1))
        u->features |= UDT_UDP_GRO;
    /* Our datagram size is the interface's (or the mtu option's), never a route's path MTU: one
     * forged "fragmentation needed" would otherwise shrink it for net.ipv4.route.mtu_expires
     * (ten minutes), and every larger datagram would be refused or cut into IP fragments, each
     * lost alike. DF stays set: nothing we send is fragmented on the way either. */
    int probe = IP_PMTUDISC_PROBE;
    if (setsockopt(u->fd, SOL_IP, IP_MTU_DISCOVER, &probe, sizeof probe) == 0)
        u->features |= UDT_UDP_PATH_MTU_IGNORED;
    int on = 1; /* every receive says how many datagrams the kernel dropped for want of buffer */
    if (setsockopt(u->fd, SOL_SOCKET, SO_RXQ_OVFL, &on, sizeof on) == 0)
        u->features |= UDT_UDP_DROPS_COUNTED;
    /* ICMP errors for our datagrams come back on the error queue: a peer's closed port is
     * how a rank learns at once that another has exited (see drain_errors) */
    if (!env_disabled("UD_UDP_ICMP") && setsockopt(u->fd, SOL_IP, IP_RECVERR, &on, sizeof on) == 0)
        u->features |= UDT_UDP_PORTS_WATCHED;
    if (bind(u->fd, (struct sockaddr *)&address, sizeof address) != 0) {
        udt_error_call(error, "bind", errno, errno == EADDRINUSE ? "the port is taken; pass port 0 to pick a free one" : NULL, "udp %s:%u",
                       bind_ipv4, port);
        close(u->fd);
        free(u);
        return NULL;
    }
    socklen_t length = sizeof address;
    getsockname(u->fd, (struct sockaddr *)&address, &length);
    memcpy(u->base.address, &address.sin_addr, 4);
    memcpy(u->base.address + 4, &address.sin_port, 2);
    u->base.address_bytes = 6;

    uint32_t mtu = interface_mtu(address.sin_addr);
    uint32_t max_datagram = mtu > UDP_IP_OVERHEAD ? mtu - UDP_IP_OVERHEAD : 512;
    u->base.max_datagram_bytes = max_datagram < UDP_MAX_DATAGRAM ? max_datagram : UDP_MAX_DATAGRAM;

    u->recv_buffers = malloc((size_t)UDP_RECV_SLOTS * UDP_SLOT_BYTES);
    if (!u->recv_buffers) {
        udt_error_call(error, "malloc", ENOMEM, NULL, "udp receive slots, %d bytes", UDP_RECV_SLOTS * UDP_SLOT_BYTES);
        udp_destroy(&u->base);
        return NULL;
    }
    for (int i = 0; i < UDP_RECV_SLOTS; i++) {
        u->recv_iov[i].iov_base = u->recv_buffers + (size_t)i * UDP_SLOT_BYTES;
        u->recv_iov[i].iov_len = UDP_SLOT_BYTES;
        u->recv_msgs[i].msg_hdr.msg_iov = &u->recv_iov[i];
        u->recv_msgs[i].msg_hdr.msg_iovlen = 1;
        u->recv_msgs[i].msg_hdr.msg_name = &u->recv_from[i];
    }
    u->last_peer_hit = -1;
    return &u->base;
}
