/* The UDP transport's receive path (udp_recv_batch and emit_pending in native/transport_udp.c,
 * included whole) against whatever recvmmsg may report: message lengths up to and past the slot,
 * MSG_TRUNC, a GRO segment size that is absent, zero, negative, smaller than, equal to or larger
 * than the message, and the socket's drop count. recvmmsg is the one thing replaced: a seeded
 * generator writes the slots, lengths, flags and control messages as the kernel would lay them
 * out. Built with ASan and UBSan; every datagram handed out must lie inside its slot, the
 * datagrams of a slot must tile its whole datagrams in order, a truncated GRO train must end in
 * one 0-byte item, and every slot must be handed out exactly once, whatever max_items each
 * receive asks for. Exits 0 and prints a summary when all scenarios hold. */
#define recvmmsg scripted_recvmmsg
#include "transport_udp.c"
#undef recvmmsg

#include <stdio.h>

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t draw(uint32_t below) /* xorshift64*, below > 0 */
{
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32) % below;
}

/* What the scripted kernel reported for each slot of the last receive. */
static struct {
    uint32_t length;  /* bytes of the message as sent (more than the slot: cut, MSG_TRUNC) */
    int truncated;
    int has_segment;
    int segment;      /* UDP_GRO's value */
} reported[UDP_RECV_SLOTS];
static int reported_count;
static uint64_t drops_reported;

static uint32_t interesting_length(void)
{
    static const uint32_t edges[] = {0, 1, 43, 44, 45, 1472, 1473, 8972, 9000, 65000, 65507, 65535, 65536};
    switch (draw(4)) {
    case 0: return edges[draw(sizeof edges / sizeof *edges)];
    case 1: return draw(200);
    case 2: return draw(UDP_SLOT_BYTES + 1);
    default: return UDP_SLOT_BYTES + draw(70000); /* larger than the slot: the kernel sets MSG_TRUNC */
    }
}

static int interesting_segment(uint32_t length)
{
    switch (draw(6)) {
    case 0: return 0;
    case 1: return -(int)draw(5) - 1;
    case 2: return (int)length;                        /* one datagram, reported as a train */
    case 3: return (int)draw(length + 2) + 1;          /* anything up to just past the message */
    case 4: return 1472;
    default: return (int)(length / (draw(64) + 1)) + (int)draw(3);
    }
}

int scripted_recvmmsg(int fd, struct mmsghdr *messages, unsigned int count, int flags, struct timespec *timeout)
{
    (void)fd, (void)flags, (void)timeout;
    if (draw(8) == 0) {
        errno = EAGAIN;
        return -1;
    }
    int got = (int)draw(count) + 1;
    for (int i = 0; i < got; i++) {
        struct msghdr *h = &messages[i].msg_hdr;
        uint32_t length = interesting_length();
        int truncated = length > h->msg_iov[0].iov_len;
        int has_segment = draw(3) != 0, segment = interesting_segment(length);
        /* without MSG_TRUNC among recvmmsg's flags the kernel reports what it copied: at most the slot */
        messages[i].msg_len = truncated ? (unsigned)h->msg_iov[0].iov_len : length;
        h->msg_flags = truncated ? MSG_TRUNC : 0;
        struct sockaddr_in *from = h->msg_name;
        from->sin_family = AF_INET;
        from->sin_port = htons((uint16_t)(1000 + draw(3)));
        from->sin_addr.s_addr = htonl(0x7F000001);
        /* control messages, as the kernel lays them out: GRO's segment size, the drop count */
        size_t used = 0;
        char *control = h->msg_control;
        if (has_segment) {
            struct cmsghdr *c = (struct cmsghdr *)(control + used);
            c->cmsg_level = SOL_UDP, c->cmsg_type = UDP_GRO, c->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(c), &segment, sizeof segment);
            used += CMSG_SPACE(sizeof(int));
        }
        if (draw(2) && used + CMSG_SPACE(sizeof(uint32_t)) <= h->msg_controllen) {
            struct cmsghdr *c = (struct cmsghdr *)(control + used);
            drops_reported += draw(3);
            uint32_t dropped = (uint32_t)drops_reported;
            c->cmsg_level = SOL_SOCKET, c->cmsg_type = SO_RXQ_OVFL, c->cmsg_len = CMSG_LEN(sizeof(uint32_t));
            memcpy(CMSG_DATA(c), &dropped, sizeof dropped);
            used += CMSG_SPACE(sizeof(uint32_t));
        }
        h->msg_controllen = used;
        reported[i].length = length, reported[i].truncated = truncated;
        reported[i].has_segment = has_segment, reported[i].segment = segment;
    }
    reported_count = got;
    return got;
}

/* The items one reported message must become: its whole datagrams in order, then a 0-byte item
 * where a train was cut; a lone datagram that was cut, or an empty one, is one 0-byte item. */
static int expected_items(int slot, uint32_t *offsets, uint32_t *sizes)
{
    uint32_t length = reported[slot].length; /* the datagram's or train's, before any cut */
    int segment = reported[slot].has_segment && reported[slot].segment > 0 ? reported[slot].segment : 0;
    if (reported[slot].truncated) {
        length = UDP_SLOT_BYTES; /* what was copied */
        if (segment >= (int)length)
            segment = 0;
        if (!segment) {
            offsets[0] = 0, sizes[0] = 0;
            return 1;
        }
        length -= length % (uint32_t)segment;
    } else if ((uint32_t)segment >= length) {
        segment = 0;
    }
    if (length == 0) {
        offsets[0] = 0, sizes[0] = 0;
        return 1;
    }
    int n = 0;
    uint32_t step = segment ? (uint32_t)segment : length;
    for (uint32_t at = 0; at < length; at += step, n++)
        offsets[n] = at, sizes[n] = length - at < step ? length - at : step;
    if (reported[slot].truncated) /* a train cut short: a 0-byte item says so */
        offsets[n] = 0, sizes[n] = 0, n++;
    return n;
}

static int32_t expected_peer(uint16_t port) { return port == 1000 ? 0 : port == 1001 ? 1 : -1; }

int main(int argc, char **argv)
{
    long scenarios = argc > 1 ? atol(argv[1]) : 20000;
    struct udp_transport *u = calloc(1, sizeof *u);
    u->base.ops = &udp_ops;
    u->fd = -1;
    u->last_peer_hit = -1;
    u->recv_buffers = malloc((size_t)UDP_RECV_SLOTS * UDP_SLOT_BYTES);
    struct sockaddr_in peers[2] = {{.sin_family = AF_INET, .sin_port = htons(1000), .sin_addr.s_addr = htonl(0x7F000001)},
                                   {.sin_family = AF_INET, .sin_port = htons(1001), .sin_addr.s_addr = htonl(0x7F000001)}};
    u->peers = peers;
    u->peer_count = 2;
    for (int i = 0; i < UDP_RECV_SLOTS; i++) { /* as udt_udp_open lays the slots out */
        u->recv_iov[i].iov_base = u->recv_buffers + (size_t)i * UDP_SLOT_BYTES;
        u->recv_iov[i].iov_len = UDP_SLOT_BYTES;
        u->recv_msgs[i].msg_hdr.msg_iov = &u->recv_iov[i];
        u->recv_msgs[i].msg_hdr.msg_iovlen = 1;
        u->recv_msgs[i].msg_hdr.msg_name = &u->recv_from[i];
    }
    /* a 1-byte segment makes a full slot 65536 datagrams (the kernel coalesces at most 64, but
     * the transport must hand out whatever the report says) */
    struct udt_recv_item *items = malloc(sizeof *items * UDP_RECV_SLOTS * (UDP_SLOT_BYTES + 1));
    static uint32_t offsets[UDP_SLOT_BYTES + 2], sizes[UDP_SLOT_BYTES + 2];
    long items_seen = 0, trains = 0;
    for (long scenario = 0; scenario < scenarios; scenario++) {
        int max_items = (int)draw(UDP_RECV_SLOTS + 8) + 1;
        int got = udp_recv_batch(&u->base, items, max_items);
        if (got < 0 || got > max_items) {
            fprintf(stderr, "scenario %ld: receive returned %d for at most %d\n", scenario, got, max_items);
            return 1;
        }
        if (got == 0 && u->pending_slot >= u->pending_slots)
            continue; /* EAGAIN */
        /* everything the receive copied in, handed out over as many calls as max_items allows */
        int total = got;
        while (u->pending_slot < u->pending_slots) {
            int more = udp_recv_batch(&u->base, items + total, (int)draw(9) + 1);
            if (more <= 0) {
                fprintf(stderr, "scenario %ld: pending datagrams not handed out (%d)\n", scenario, more);
                return 1;
            }
            total += more;
        }
        int at = 0;
        for (int slot = 0; slot < reported_count; slot++) {
            const uint8_t *base = u->recv_iov[slot].iov_base;
            int n = expected_items(slot, offsets, sizes);
            trains += n > 1;
            for (int k = 0; k < n; k++, at++) {
                const struct udt_recv_item *item = &items[at];
                if (at >= total || item->bytes != sizes[k] || (sizes[k] && item->data != base + offsets[k]) ||
                    item->data < base || item->data + item->bytes > base + UDP_SLOT_BYTES ||
                    item->peer != expected_peer(ntohs(u->recv_from[slot].sin_port))) {
                    fprintf(stderr, "scenario %ld slot %d item %d: got %u bytes at +%td (peer %d), want %u at +%u; reported length %u"
                            " truncated %d segment %d/%d\n", scenario, slot, k, at < total ? item->bytes : 0,
                            at < total ? item->data - base : -1, at < total ? item->peer : -9, sizes[k], offsets[k],
                            reported[slot].length, reported[slot].truncated, reported[slot].has_segment, reported[slot].segment);
                    return 1;
                }
            }
        }
        if (at != total) {
            fprintf(stderr, "scenario %ld: %d items handed out, %d expected\n", scenario, total, at);
            return 1;
        }
        items_seen += total;
    }
    if (u->base.counter_receive_overflows != (uint32_t)drops_reported) {
        fprintf(stderr, "drops counted %llu, reported %llu\n", (unsigned long long)u->base.counter_receive_overflows,
                (unsigned long long)drops_reported);
        return 1;
    }
    printf("%ld receives, %ld datagrams handed out, %ld slots split into several: all inside their slots, in order\n",
           scenarios, items_seen, trains);
    free(items);
    free(u->recv_buffers);
    free(u);
    return 0;
}
