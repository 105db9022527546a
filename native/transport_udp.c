/* UDP transport: one non-blocking socket per rank, batched with
 * sendmmsg/recvmmsg, large kernel buffers so bursts are absorbed. */
#define _GNU_SOURCE
#include "transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define UDP_RECV_SLOTS 64
#define UDP_MAX_DATAGRAM 65507u /* 65535 - IPv4 header - UDP header */
#define UDP_IP_OVERHEAD 28u

struct udp_transport {
    struct udt_transport base;
    int fd;
    uint32_t peer_count;
    struct sockaddr_in *peers;
    int32_t last_peer_hit;
    uint8_t *recv_buffers;
    struct mmsghdr recv_msgs[UDP_RECV_SLOTS];
    struct iovec recv_iov[UDP_RECV_SLOTS];
    struct sockaddr_in recv_from[UDP_RECV_SLOTS];
};

static void set_buffer(int fd, int force_option, int option, uint32_t bytes)
{
    int value = (int)bytes;
    /* FORCE ignores net.core.[rw]mem_max but needs CAP_NET_ADMIN; fall back. */
    if (setsockopt(fd, SOL_SOCKET, force_option, &value, sizeof value) != 0)
        setsockopt(fd, SOL_SOCKET, option, &value, sizeof value);
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
        snprintf(t->error, sizeof t->error, "udp: peer address must be 6 bytes (IPv4 + port), got %u", address_bytes);
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
    free(u->peers);
    u->peers = peers;
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

static int udp_send_batch(struct udt_transport *t, const struct udt_send_item *items, int count)
{
    struct udp_transport *u = (struct udp_transport *)t;
    struct mmsghdr msgs[64];
    struct iovec iov[64][2];
    int done = 0;
    while (done < count) {
        int batch = count - done > 64 ? 64 : count - done;
        for (int i = 0; i < batch; i++) {
            const struct udt_send_item *item = &items[done + i];
            if (item->peer >= u->peer_count) {
                snprintf(t->error, sizeof t->error, "udp: send to unknown peer %u", item->peer);
                return -EINVAL;
            }
            iov[i][0].iov_base = (void *)item->header;
            iov[i][0].iov_len = item->header_bytes;
            iov[i][1].iov_base = (void *)item->payload;
            iov[i][1].iov_len = item->payload_bytes;
            memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_name = &u->peers[item->peer];
            msgs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
            msgs[i].msg_hdr.msg_iov = iov[i];
            msgs[i].msg_hdr.msg_iovlen = item->payload_bytes ? 2 : 1;
        }
        int sent = sendmmsg(u->fd, msgs, (unsigned)batch, MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EAGAIN || errno == ENOBUFS || errno == EINTR)
                return done;
            /* The network refused this one datagram (a firewall, no route,
             * an ICMP error from an earlier send): that is loss, not a
             * failure of the call. Skip it and go on. */
            if (errno == EPERM || errno == ECONNREFUSED || errno == EHOSTUNREACH || errno == ENETUNREACH || errno == EMSGSIZE) {
                done += 1;
                continue;
            }
            snprintf(t->error, sizeof t->error, "udp: sendmmsg failed: %s (%d)", strerror(errno), errno);
            return -errno;
        }
        done += sent;
        if (sent < batch)
            return done;
    }
    return done;
}

static int udp_recv_batch(struct udt_transport *t, struct udt_recv_item *items, int max_items)
{
    struct udp_transport *u = (struct udp_transport *)t;
    int want = max_items < UDP_RECV_SLOTS ? max_items : UDP_RECV_SLOTS;
    for (int i = 0; i < want; i++) {
        u->recv_msgs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
        u->recv_msgs[i].msg_hdr.msg_flags = 0;
    }
    int got = recvmmsg(u->fd, u->recv_msgs, (unsigned)want, MSG_DONTWAIT, NULL);
    if (got < 0) {
        if (errno == EAGAIN || errno == EINTR || errno == ECONNREFUSED)
            return 0;
        snprintf(t->error, sizeof t->error, "udp: recvmmsg failed: %s (%d)", strerror(errno), errno);
        return -errno;
    }
    for (int i = 0; i < got; i++) {
        items[i].data = u->recv_iov[i].iov_base;
        /* A datagram larger than our slot is cut short: report a length that
         * no valid datagram has, so the engine drops it as truncated. */
        items[i].bytes = (u->recv_msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? 0 : u->recv_msgs[i].msg_len;
        items[i].peer = lookup_peer(u, &u->recv_from[i]);
    }
    return got;
}

static int udp_wait(struct udt_transport *t, int timeout_us)
{
    struct udp_transport *u = (struct udp_transport *)t;
    struct pollfd pfd = {.fd = u->fd, .events = POLLIN};
    struct timespec timeout = {.tv_sec = timeout_us / 1000000, .tv_nsec = (long)(timeout_us % 1000000) * 1000};
    int ready = ppoll(&pfd, 1, &timeout, NULL);
    return ready < 0 && errno != EINTR ? -errno : 0;
}

static void udp_destroy(struct udt_transport *t)
{
    struct udp_transport *u = (struct udp_transport *)t;
    if (u->fd >= 0)
        close(u->fd);
    free(u->peers);
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

struct udt_transport *udt_udp_open(const char *bind_ipv4, uint16_t port, uint32_t socket_buffer_bytes, char *error, int error_bytes)
{
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, bind_ipv4, &address.sin_addr) != 1) {
        snprintf(error, (size_t)error_bytes, "udp: bind address %s is not an IPv4 address", bind_ipv4);
        return NULL;
    }
    if (address.sin_addr.s_addr == htonl(INADDR_ANY)) {
        snprintf(error, (size_t)error_bytes, "udp: bind to a specific address, not 0.0.0.0: peers need an address to send to");
        return NULL;
    }
    struct udp_transport *u = calloc(1, sizeof *u);
    if (!u) {
        snprintf(error, (size_t)error_bytes, "udp: out of memory");
        return NULL;
    }
    u->base.ops = &udp_ops;
    u->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (u->fd < 0) {
        snprintf(error, (size_t)error_bytes, "udp: socket failed: %s (%d)", strerror(errno), errno);
        free(u);
        return NULL;
    }
    set_buffer(u->fd, SO_RCVBUFFORCE, SO_RCVBUF, socket_buffer_bytes);
    set_buffer(u->fd, SO_SNDBUFFORCE, SO_SNDBUF, socket_buffer_bytes);
    if (bind(u->fd, (struct sockaddr *)&address, sizeof address) != 0) {
        snprintf(error, (size_t)error_bytes, "udp: bind %s:%u failed: %s (%d)", bind_ipv4, port, strerror(errno), errno);
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

    u->recv_buffers = malloc((size_t)UDP_RECV_SLOTS * UDP_MAX_DATAGRAM);
    if (!u->recv_buffers) {
        snprintf(error, (size_t)error_bytes, "udp: out of memory for receive slots");
        udp_destroy(&u->base);
        return NULL;
    }
    for (int i = 0; i < UDP_RECV_SLOTS; i++) {
        u->recv_iov[i].iov_base = u->recv_buffers + (size_t)i * UDP_MAX_DATAGRAM;
        u->recv_iov[i].iov_len = UDP_MAX_DATAGRAM;
        u->recv_msgs[i].msg_hdr.msg_iov = &u->recv_iov[i];
        u->recv_msgs[i].msg_hdr.msg_iovlen = 1;
        u->recv_msgs[i].msg_hdr.msg_name = &u->recv_from[i];
    }
    u->last_peer_hit = -1;
    return &u->base;
}
