/* Verbs UD transport: one Unreliable Datagram QP per rank.
 *
 *  - Sends: header + payload are copied into a registered send ring (so the
 *    caller's memory is free on return), posted as one linked list of work
 *    requests, one in `signal_every` signalled; a signalled completion frees
 *    its slot and every slot before it (completions are in order on a QP).
 *  - Receives: a registered ring of `recv_depth` buffers, each with 40 bytes
 *    in front for the GRH; the buffers handed out by one recv_batch are
 *    re-posted, as one list, at the start of the next, so the queue never
 *    runs dry while the engine works (an unposted receive drops silently).
 *  - Both CQs hold at least every WR their queue can have outstanding, so
 *    they cannot overflow (an overflow would kill the QP).
 *  - wait() polls briefly, then sleeps on a completion channel.
 *  - A datagram's sender is (source QPN, source GID from the GRH) looked up in
 *    the peer table; anything else is peer -1.
 * Nothing here is specific to rxe: the same code runs on RoCE and IB NICs. */
#define _GNU_SOURCE
#include "transport_verbs.h"

#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define GRH_BYTES 40u
#define POST_CHUNK 64        /* work requests per ibv_post_send / ibv_post_recv list */
#define POLL_BATCH 64        /* completions per ibv_poll_cq */
#define DEFAULT_SEND_DEPTH 512u
#define DEFAULT_RECV_DEPTH 1024u
#define DEFAULT_SIGNAL_EVERY 32u
#define HOP_LIMIT 64

struct verbs_peer {
    uint8_t gid[16];
    uint32_t qpn;
    uint16_t lid;
    uint32_t qkey;
    struct ibv_ah *ah;
};

struct verbs_transport {
    struct udt_transport base;
    char device_name[64];
    uint8_t port;
    int gid_index;
    uint32_t qkey;
    uint8_t gid[16];
    uint16_t lid;
    uint32_t spin_us;

    struct ibv_context *context;
    struct ibv_pd *pd;
    struct ibv_comp_channel *channel;
    struct ibv_cq *send_cq, *recv_cq;
    struct ibv_qp *qp;

    /* send ring: slots [send_tail, send_head) are in flight (absolute counters) */
    uint8_t *send_buffer;
    struct ibv_mr *send_mr;
    uint32_t send_depth, send_slot_bytes, signal_every;
    uint64_t send_head, send_tail;
    int send_blocked; /* the last send_batch could not queue everything */

    /* receive ring */
    uint8_t *recv_buffer;
    struct ibv_mr *recv_mr;
    uint32_t recv_depth, recv_slot_bytes;
    uint32_t *repost;        /* slots handed out by the last recv_batch */
    uint32_t repost_count;
    struct ibv_wc *stash;    /* completions wait() polled, for recv_batch */
    uint32_t stash_head, stash_count;

    struct verbs_peer *peers;
    uint32_t peer_count;
    int32_t last_peer_hit;

    uint64_t receive_errors; /* receive completions with an error status */
};

/* libibverbs reports errors either as a positive return value or through errno. */
static int verbs_errno(int rc) { return rc > 0 ? rc : (errno ? errno : EIO); }

static uint32_t mtu_bytes(enum ibv_mtu mtu)
{
    switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
    default: return 0;
    }
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* ---- peers --------------------------------------------------------------------- */

static void destroy_peers(struct verbs_transport *v)
{
    for (uint32_t i = 0; i < v->peer_count; i++)
        if (v->peers[i].ah)
            ibv_destroy_ah(v->peers[i].ah);
    free(v->peers);
    v->peers = NULL;
    v->peer_count = 0;
}

static int verbs_set_peers(struct udt_transport *t, const uint8_t *addresses, uint32_t address_bytes, uint32_t count)
{
    struct verbs_transport *v = (struct verbs_transport *)t;
    if (address_bytes != UDT_VERBS_ADDRESS_BYTES) {
        udt_error_check(&t->error, "verbs: peer address must be %u bytes (GID, QPN, LID, Q_Key), got %u: "
                 "are all ranks using the verbs transport?", UDT_VERBS_ADDRESS_BYTES, address_bytes);
        return -EINVAL;
    }
    struct verbs_peer *peers = calloc(count ? count : 1, sizeof *peers);
    if (!peers)
        return -ENOMEM;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *a = addresses + (size_t)i * address_bytes;
        struct verbs_peer *p = &peers[i];
        memcpy(p->gid, a, 16);
        p->qpn = (uint32_t)a[16] | (uint32_t)a[17] << 8 | (uint32_t)a[18] << 16 | (uint32_t)a[19] << 24;
        p->lid = (uint16_t)(a[20] | a[21] << 8);
        p->qkey = (uint32_t)a[22] | (uint32_t)a[23] << 8 | (uint32_t)a[24] << 16 | (uint32_t)a[25] << 24;
        /* RoCE needs the GRH (it carries the IP addresses); IB within a subnet does not, but it does no harm. */
        struct ibv_ah_attr attr = {
            .is_global = 1,
            .dlid = p->lid,
            .sl = 0,
            .port_num = v->port,
            .grh = {.sgid_index = (uint8_t)v->gid_index, .hop_limit = HOP_LIMIT},
        };
        memcpy(attr.grh.dgid.raw, p->gid, 16);
        p->ah = ibv_create_ah(v->pd, &attr);
        if (!p->ah) {
            int err = verbs_errno(-1);
            char gid_text[48];
            snprintf(gid_text, sizeof gid_text, "%02x%02x:%02x%02x:...:%02x%02x:%02x%02x", p->gid[0], p->gid[1], p->gid[2], p->gid[3],
                     p->gid[12], p->gid[13], p->gid[14], p->gid[15]);
            udt_error_call(&t->error, "ibv_create_ah", err, NULL, "dev=%s port=%u gid_index=%d peer=%u dgid=%s", v->device_name,
                       v->port, v->gid_index, i, gid_text);
            for (uint32_t j = 0; j < i; j++)
                ibv_destroy_ah(peers[j].ah);
            free(peers);
            return -err;
        }
    }
    destroy_peers(v);
    v->peers = peers;
    v->peer_count = count;
    v->last_peer_hit = -1;
    return 0;
}

/* The source GID of a received datagram, from the 40 bytes in front of it.
 * RoCEv2 over IPv4 puts the IPv4 header in the last 20 of them (the first 20
 * are undefined); IB and RoCE over IPv6 put a GRH / IPv6 header there. Like
 * libibverbs' ibv_init_ah_from_wc, an IPv4 header is recognised by version,
 * length and checksum; but a packet looped back inside one device (rxe) has
 * no checksum computed, so an IPv4-looking header also counts when the first
 * bytes are not an IPv6 header. */
static int source_gid(const uint8_t *grh, uint8_t gid[16])
{
    const uint8_t *ip4 = grh + 20;
    int ipv6 = (grh[0] >> 4) == 6;
    if (ip4[0] == 0x45) {
        uint32_t sum = 0;
        for (int i = 0; i < 20; i += 2)
            sum += (uint32_t)ip4[i] << 8 | ip4[i + 1];
        while (sum >> 16)
            sum = (sum & 0xffff) + (sum >> 16);
        if (sum == 0xffff || !ipv6) {
            memset(gid, 0, 10);
            gid[10] = gid[11] = 0xff;
            memcpy(gid + 12, ip4 + 12, 4);
            return 0;
        }
    }
    if (ipv6) {
        memcpy(gid, grh + 8, 16);
        return 0;
    }
    return -1;
}

static int peer_matches(const struct verbs_peer *p, const struct ibv_wc *wc, const uint8_t *gid)
{
    if (p->qpn != wc->src_qp)
        return 0;
    if (gid)
        return memcmp(p->gid, gid, 16) == 0;
    /* No GRH: IB within a subnet, where the LID names the sender. RoCE has no LIDs
     * (0 everywhere) and always carries a GRH, so a RoCE peer is never matched on
     * its QPN alone. */
    return p->lid != 0 && p->lid == wc->slid;
}

/* Called on a receive slot before it is posted. The device writes the 40 bytes in
 * front of a datagram only in part (RoCEv2 over IPv4 leaves the first 20 undefined)
 * or not at all (no GRH), so without this an earlier datagram's header left in the
 * slot could be read as this one's and name its sender. */
static void clear_grh(uint8_t *slot)
{
    memset(slot, 0, GRH_BYTES);
}

static int32_t lookup_peer(struct verbs_transport *v, const struct ibv_wc *wc, const uint8_t *grh)
{
    uint8_t gid_bytes[16];
    const uint8_t *gid = (wc->wc_flags & IBV_WC_GRH) && source_gid(grh, gid_bytes) == 0 ? gid_bytes : NULL;
    int32_t hint = v->last_peer_hit;
    if (hint >= 0 && peer_matches(&v->peers[hint], wc, gid))
        return hint;
    for (uint32_t i = 0; i < v->peer_count; i++) {
        if (peer_matches(&v->peers[i], wc, gid)) {
            v->last_peer_hit = (int32_t)i;
            return (int32_t)i;
        }
    }
    return -1;
}

/* ---- sending -------------------------------------------------------------------- */

/* Free the slots of completed sends. Returns how many completions it read, or -errno. */
static int reclaim_sends(struct verbs_transport *v)
{
    struct ibv_wc wc[POLL_BATCH];
    int total = 0;
    for (;;) {
        int got = ibv_poll_cq(v->send_cq, POLL_BATCH, wc);
        if (got < 0) {
            udt_error_call(&v->base.error, "ibv_poll_cq", EIO, NULL, "send cq, dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
            return -EIO;
        }
        for (int i = 0; i < got; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                udt_error_check(&v->base.error, "verbs: send completed with %s (wc status %d, vendor error 0x%x) [dev=%s qpn=0x%x]",
                         ibv_wc_status_str(wc[i].status), wc[i].status, wc[i].vendor_err, v->device_name, v->qp->qp_num);
                return -EIO;
            }
            if (wc[i].wr_id + 1 > v->send_tail)
                v->send_tail = wc[i].wr_id + 1;
        }
        total += got;
        if (got < POLL_BATCH)
            return total;
    }
}

static int verbs_send_batch(struct udt_transport *t, const struct udt_send_item *items, int count)
{
    struct verbs_transport *v = (struct verbs_transport *)t;
    if (count <= 0)
        return 0;
    if (v->send_head - v->send_tail + (uint64_t)count > v->send_depth) {
        int rc = reclaim_sends(v);
        if (rc < 0)
            return rc;
    }
    uint64_t free_slots = v->send_depth - (v->send_head - v->send_tail);
    int queue = count < (int64_t)free_slots ? count : (int)free_slots;
    v->send_blocked = queue < count;
    struct ibv_send_wr wrs[POST_CHUNK];
    struct ibv_sge sges[POST_CHUNK];
    int done = 0;
    while (done < queue) {
        int n = queue - done < POST_CHUNK ? queue - done : POST_CHUNK;
        for (int i = 0; i < n; i++) {
            const struct udt_send_item *item = &items[done + i];
            uint32_t bytes = item->header_bytes + item->payload_bytes;
            if (item->peer >= v->peer_count) {
                udt_error_check(&t->error, "verbs: send to unknown peer %u (%u peers)", item->peer, v->peer_count);
                return done ? done : -EINVAL;
            }
            if (bytes > v->base.max_datagram_bytes) {
                /* a UD send above the path MTU would complete "successfully" and send nothing */
                udt_error_check(&t->error, "verbs: datagram of %u bytes exceeds the %u-byte MTU [dev=%s port=%u]", bytes,
                         v->base.max_datagram_bytes, v->device_name, v->port);
                return done ? done : -EMSGSIZE;
            }
            uint64_t index = v->send_head + (uint64_t)i;
            uint8_t *slot = v->send_buffer + (size_t)(index % v->send_depth) * v->send_slot_bytes;
            memcpy(slot, item->header, item->header_bytes);
            if (item->payload_bytes)
                memcpy(slot + item->header_bytes, item->payload, item->payload_bytes);
            const struct verbs_peer *peer = &v->peers[item->peer];
            sges[i] = (struct ibv_sge){.addr = (uintptr_t)slot, .length = bytes, .lkey = v->send_mr->lkey};
            wrs[i] = (struct ibv_send_wr){
                .wr_id = index,
                .next = i + 1 < n ? &wrs[i + 1] : NULL,
                .sg_list = &sges[i],
                .num_sge = 1,
                .opcode = IBV_WR_SEND,
                .send_flags = index % v->signal_every == v->signal_every - 1 ? IBV_SEND_SIGNALED : 0,
            };
            wrs[i].wr.ud.ah = peer->ah;
            wrs[i].wr.ud.remote_qpn = peer->qpn;
            wrs[i].wr.ud.remote_qkey = peer->qkey;
        }
        struct ibv_send_wr *bad = NULL;
        int rc = ibv_post_send(v->qp, wrs, &bad);
        if (rc) {
            int posted = bad ? (int)(bad - wrs) : 0;
            v->send_head += (uint64_t)posted;
            done += posted;
            udt_error_call(&t->error, "ibv_post_send", verbs_errno(rc), NULL, "dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
            return done ? done : -verbs_errno(rc);
        }
        v->send_head += (uint64_t)n;
        done += n;
    }
    return done;
}

/* ---- receiving ------------------------------------------------------------------ */

static int post_receives(struct verbs_transport *v, const uint32_t *slots, uint32_t count)
{
    struct ibv_recv_wr wrs[POST_CHUNK];
    struct ibv_sge sges[POST_CHUNK];
    uint32_t done = 0;
    while (done < count) {
        uint32_t n = count - done < POST_CHUNK ? count - done : POST_CHUNK;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t slot = slots ? slots[done + i] : done + i;
            clear_grh(v->recv_buffer + (size_t)slot * v->recv_slot_bytes);
            sges[i] = (struct ibv_sge){.addr = (uintptr_t)(v->recv_buffer + (size_t)slot * v->recv_slot_bytes),
                                       .length = v->recv_slot_bytes, .lkey = v->recv_mr->lkey};
            wrs[i] = (struct ibv_recv_wr){.wr_id = slot, .next = i + 1 < n ? &wrs[i + 1] : NULL, .sg_list = &sges[i], .num_sge = 1};
        }
        struct ibv_recv_wr *bad = NULL;
        int rc = ibv_post_recv(v->qp, wrs, &bad);
        if (rc) {
            udt_error_call(&v->base.error, "ibv_post_recv", verbs_errno(rc), NULL, "dev=%s qpn=0x%x", v->device_name,
                       v->qp->qp_num);
            return -verbs_errno(rc);
        }
        done += n;
    }
    return 0;
}

/* Move whatever the receive CQ holds into the stash. Returns the stash size or -errno. */
static int fill_stash(struct verbs_transport *v)
{
    if (v->stash_count)
        return (int)v->stash_count;
    v->stash_head = 0;
    int got = ibv_poll_cq(v->recv_cq, POLL_BATCH, v->stash);
    if (got < 0) {
        udt_error_call(&v->base.error, "ibv_poll_cq", EIO, NULL, "recv cq, dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
        return -EIO;
    }
    v->stash_count = (uint32_t)got;
    return got;
}

static int verbs_recv_batch(struct udt_transport *t, struct udt_recv_item *items, int max_items)
{
    struct verbs_transport *v = (struct verbs_transport *)t;
    /* the previous batch's buffers are the caller's no longer: post them again */
    if (v->repost_count) {
        int rc = post_receives(v, v->repost, v->repost_count);
        if (rc < 0)
            return rc;
        v->repost_count = 0;
    }
    int rc = fill_stash(v);
    if (rc < 0)
        return rc;
    int want = max_items < POLL_BATCH ? max_items : POLL_BATCH;
    int got = 0;
    while (got < want && v->stash_count) {
        const struct ibv_wc *wc = &v->stash[v->stash_head++];
        v->stash_count--;
        uint32_t slot = (uint32_t)wc->wr_id;
        v->repost[v->repost_count++] = slot;
        if (wc->status != IBV_WC_SUCCESS) {
            v->receive_errors++;
            if (wc->status == IBV_WC_WR_FLUSH_ERR) {
                udt_error_check(&t->error, "verbs: the QP went to the error state, receives flushed [dev=%s qpn=0x%x]",
                         v->device_name, v->qp->qp_num);
                return -EIO;
            }
            continue; /* a bad datagram, not a broken QP: it is simply not delivered */
        }
        const uint8_t *buffer = v->recv_buffer + (size_t)slot * v->recv_slot_bytes;
        items[got].data = buffer + GRH_BYTES;
        /* byte_len counts the 40 GRH bytes, present or not */
        items[got].bytes = wc->byte_len >= GRH_BYTES ? wc->byte_len - GRH_BYTES : 0;
        items[got].peer = lookup_peer(v, wc, buffer);
        got++;
    }
    return got;
}

/* ---- waiting -------------------------------------------------------------------- */

static int consume_events(struct verbs_transport *v)
{
    for (;;) {
        struct ibv_cq *cq;
        void *context;
        if (ibv_get_cq_event(v->channel, &cq, &context) != 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -errno;
        ibv_ack_cq_events(cq, 1);
    }
}

/* Something for the engine to do: a receive completion, or room in a blocked send ring. */
static int ready(struct verbs_transport *v)
{
    int rc = fill_stash(v);
    if (rc != 0)
        return rc;
    if (v->send_blocked) {
        uint64_t tail = v->send_tail;
        if ((rc = reclaim_sends(v)) < 0)
            return rc;
        if (v->send_tail != tail)
            return 1;
    }
    return 0;
}

static int verbs_wait(struct udt_transport *t, int timeout_us)
{
    struct verbs_transport *v = (struct verbs_transport *)t;
    int rc = ready(v);
    if (rc != 0)
        return rc < 0 ? rc : 0;
    uint64_t start = now_ns();
    uint64_t spin_ns = (uint64_t)(v->spin_us < (uint32_t)timeout_us ? v->spin_us : (uint32_t)(timeout_us > 0 ? timeout_us : 0)) * 1000ull;
    while (now_ns() - start < spin_ns)
        if ((rc = ready(v)) != 0)
            return rc < 0 ? rc : 0;
    /* Arm, then look again: a completion that came before the arm raises no event. */
    if (ibv_req_notify_cq(v->recv_cq, 0) || (v->send_blocked && ibv_req_notify_cq(v->send_cq, 0))) {
        udt_error_call(&t->error, "ibv_req_notify_cq", verbs_errno(-1), NULL, "dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
        return -EIO;
    }
    if ((rc = ready(v)) != 0)
        return rc < 0 ? rc : 0;
    int64_t left_us = (int64_t)timeout_us - (int64_t)((now_ns() - start) / 1000);
    if (left_us <= 0)
        return 0;
    struct pollfd pfd = {.fd = v->channel->fd, .events = POLLIN};
    struct timespec timeout = {.tv_sec = left_us / 1000000, .tv_nsec = (long)(left_us % 1000000) * 1000};
    int n = ppoll(&pfd, 1, &timeout, NULL);
    if (n < 0 && errno != EINTR)
        return -errno;
    if (n > 0 && (rc = consume_events(v)) < 0) {
        udt_error_call(&t->error, "ibv_get_cq_event", -rc, NULL, "dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
        return rc;
    }
    return 0;
}

/* ---- lifetime ------------------------------------------------------------------- */

static void verbs_destroy(struct udt_transport *t)
{
    struct verbs_transport *v = (struct verbs_transport *)t;
    if (v->qp)
        ibv_destroy_qp(v->qp);
    destroy_peers(v);
    if (v->channel)
        consume_events(v); /* every event must be acked before its CQ is destroyed */
    if (v->send_cq)
        ibv_destroy_cq(v->send_cq);
    if (v->recv_cq)
        ibv_destroy_cq(v->recv_cq);
    if (v->channel)
        ibv_destroy_comp_channel(v->channel);
    if (v->send_mr)
        ibv_dereg_mr(v->send_mr);
    if (v->recv_mr)
        ibv_dereg_mr(v->recv_mr);
    if (v->pd)
        ibv_dealloc_pd(v->pd);
    if (v->context)
        ibv_close_device(v->context);
    free(v->send_buffer);
    free(v->recv_buffer);
    free(v->repost);
    free(v->stash);
    free(v);
}

static const struct udt_transport_ops verbs_ops = {
    .name = "verbs",
    .set_peers = verbs_set_peers,
    .send_batch = verbs_send_batch,
    .recv_batch = verbs_recv_batch,
    .wait = verbs_wait,
    .destroy = verbs_destroy,
};

static int open_device(struct verbs_transport *v, const char *name, struct udt_error *error)
{
    int count = 0;
    errno = 0;
    struct ibv_device **devices = ibv_get_device_list(&count);
    if (!devices) {
        int err = errno ? errno : ENODEV;
        udt_error_call(error, "ibv_get_device_list", err, err == ENOSYS ? "this kernel has no RDMA support" : NULL, "dev=%s", name);
        return -err;
    }
    char names[128] = "", detail[160];
    for (int i = 0; i < count; i++) {
        const char *candidate = ibv_get_device_name(devices[i]);
        if (strcmp(candidate, name) == 0) {
            v->context = ibv_open_device(devices[i]);
            if (!v->context) {
                int err = verbs_errno(-1);
                udt_error_call(error, "ibv_open_device", err, NULL, "dev=%s", name);
                ibv_free_device_list(devices);
                return -err;
            }
            break;
        }
        size_t used = strlen(names);
        snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", candidate);
    }
    ibv_free_device_list(devices);
    if (!v->context) {
        snprintf(detail, sizeof detail, "no such device; devices here: %s", count ? names : "none");
        udt_error_call(error, "ibv_open_device", ENODEV, detail, "dev=%s", name);
        return -ENODEV;
    }
    return 0;
}

static int to_rts(struct verbs_transport *v, struct udt_error *error)
{
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = v->port, .qkey = v->qkey};
    int rc = ibv_modify_qp(v->qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
    if (rc) {
        udt_error_call(error, "ibv_modify_qp", verbs_errno(rc), NULL, "RESET->INIT dev=%s port=%u qpn=0x%x qkey=0x%x", v->device_name,
                   v->port, v->qp->qp_num, v->qkey);
        return -1;
    }
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_RTR;
    if ((rc = ibv_modify_qp(v->qp, &attr, IBV_QP_STATE))) {
        udt_error_call(error, "ibv_modify_qp", verbs_errno(rc), NULL, "INIT->RTR dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
        return -1;
    }
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = 0;
    if ((rc = ibv_modify_qp(v->qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN))) {
        udt_error_call(error, "ibv_modify_qp", verbs_errno(rc), NULL, "RTR->RTS dev=%s qpn=0x%x", v->device_name, v->qp->qp_num);
        return -1;
    }
    return 0;
}

static uint32_t clamp(uint32_t value, uint32_t low, uint32_t high) { return value < low ? low : value > high ? high : value; }

struct udt_transport *udt_verbs_open(const struct udt_verbs_config *config, struct udt_error *error)
{
    if (!config->device || !config->device[0] || config->port == 0 || config->gid_index < 0) {
        udt_error_check(error, "verbs: device, port and gid_index must be given (the Python layer chooses them)");
        return NULL;
    }
    if (config->qkey & 0x80000000u) {
        udt_error_check(error, "verbs: Q_Key 0x%x has the high bit set (privileged); use one below 0x80000000", config->qkey);
        return NULL;
    }
    struct verbs_transport *v = calloc(1, sizeof *v);
    if (!v) {
        udt_error_check(error, "verbs: out of memory");
        return NULL;
    }
    v->base.ops = &verbs_ops;
    snprintf(v->device_name, sizeof v->device_name, "%s", config->device);
    v->port = config->port;
    v->gid_index = config->gid_index;
    v->qkey = config->qkey;
    v->spin_us = config->spin_us;
    v->last_peer_hit = -1;
    if (open_device(v, config->device, error) < 0)
        goto fail;

    struct ibv_device_attr device_attr;
    int rc = ibv_query_device(v->context, &device_attr);
    if (rc) {
        udt_error_call(error, "ibv_query_device", verbs_errno(rc), NULL, "dev=%s", v->device_name);
        goto fail;
    }
    struct ibv_port_attr port_attr;
    if ((rc = ibv_query_port(v->context, v->port, &port_attr))) {
        char detail[64];
        snprintf(detail, sizeof detail, "the device has %u port%s", device_attr.phys_port_cnt, device_attr.phys_port_cnt == 1 ? "" : "s");
        udt_error_call(error, "ibv_query_port", verbs_errno(rc), detail, "dev=%s port=%u", v->device_name, v->port);
        goto fail;
    }
    if (port_attr.state != IBV_PORT_ACTIVE) {
        char detail[64];
        snprintf(detail, sizeof detail, "port is not active (state %s)", ibv_port_state_str(port_attr.state));
        udt_error_call(error, "ibv_query_port", ENETDOWN, detail, "dev=%s port=%u", v->device_name, v->port);
        goto fail;
    }
    struct ibv_gid_entry gid_entry;
    if ((rc = ibv_query_gid_ex(v->context, v->port, (uint32_t)v->gid_index, &gid_entry, 0))) {
        char detail[64];
        snprintf(detail, sizeof detail, "no such GID table entry (table size %d)", port_attr.gid_tbl_len);
        udt_error_call(error, "ibv_query_gid_ex", verbs_errno(rc), detail, "dev=%s port=%u gid_index=%d", v->device_name, v->port,
                          v->gid_index);
        goto fail;
    }
    memcpy(v->gid, gid_entry.gid.raw, 16);
    v->lid = port_attr.lid;

    uint32_t mtu = mtu_bytes(port_attr.active_mtu);
    if (config->max_datagram_bytes > mtu) {
        udt_error_check(error, "verbs: max_datagram_bytes %u exceeds the port's active MTU %u [dev=%s port=%u]", config->max_datagram_bytes,
                 mtu, v->device_name, v->port);
        goto fail;
    }
    v->base.max_datagram_bytes = config->max_datagram_bytes ? config->max_datagram_bytes : mtu;
    if (v->base.max_datagram_bytes < 64) {
        udt_error_check(error, "verbs: max_datagram_bytes %u is too small (at least 64)", v->base.max_datagram_bytes);
        goto fail;
    }

    /* Depths within what the device allows; every CQ as deep as its queue. */
    uint32_t device_limit = (uint32_t)(device_attr.max_qp_wr < device_attr.max_cqe ? device_attr.max_qp_wr : device_attr.max_cqe);
    v->send_depth = clamp(config->send_depth ? config->send_depth : DEFAULT_SEND_DEPTH, 2, device_limit);
    v->recv_depth = clamp(config->recv_depth ? config->recv_depth : DEFAULT_RECV_DEPTH, 2 * POLL_BATCH, device_limit);
    v->signal_every = clamp(config->signal_every ? config->signal_every : DEFAULT_SIGNAL_EVERY, 1, v->send_depth / 2 ? v->send_depth / 2 : 1);
    v->send_slot_bytes = (v->base.max_datagram_bytes + 63u) & ~63u;
    v->recv_slot_bytes = ((GRH_BYTES + v->base.max_datagram_bytes) + 63u) & ~63u;

    if (!(v->pd = ibv_alloc_pd(v->context))) {
        udt_error_call(error, "ibv_alloc_pd", verbs_errno(-1), NULL, "dev=%s", v->device_name);
        goto fail;
    }
    if (!(v->channel = ibv_create_comp_channel(v->context))) {
        udt_error_call(error, "ibv_create_comp_channel", verbs_errno(-1), NULL, "dev=%s", v->device_name);
        goto fail;
    }
    int flags = fcntl(v->channel->fd, F_GETFL);
    if (flags < 0 || fcntl(v->channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        udt_error_call(error, "fcntl", errno, NULL, "completion channel fd of dev=%s", v->device_name);
        goto fail;
    }
    if (!(v->send_cq = ibv_create_cq(v->context, (int)v->send_depth, NULL, v->channel, 0))) {
        udt_error_call(error, "ibv_create_cq", verbs_errno(-1), NULL, "dev=%s cqe=%u (send)", v->device_name, v->send_depth);
        goto fail;
    }
    if (!(v->recv_cq = ibv_create_cq(v->context, (int)v->recv_depth, NULL, v->channel, 0))) {
        udt_error_call(error, "ibv_create_cq", verbs_errno(-1), NULL, "dev=%s cqe=%u (recv)", v->device_name, v->recv_depth);
        goto fail;
    }
    struct ibv_qp_init_attr qp_attr = {
        .send_cq = v->send_cq,
        .recv_cq = v->recv_cq,
        .cap = {.max_send_wr = v->send_depth, .max_recv_wr = v->recv_depth, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_UD,
        .sq_sig_all = 0,
    };
    if (!(v->qp = ibv_create_qp(v->pd, &qp_attr))) {
        udt_error_call(error, "ibv_create_qp", verbs_errno(-1), NULL, "dev=%s type=UD send_wr=%u recv_wr=%u", v->device_name, v->send_depth,
                   v->recv_depth);
        goto fail;
    }
    if (to_rts(v, error) < 0)
        goto fail;

    size_t send_bytes = (size_t)v->send_depth * v->send_slot_bytes, recv_bytes = (size_t)v->recv_depth * v->recv_slot_bytes;
    if (posix_memalign((void **)&v->send_buffer, 4096, send_bytes) || posix_memalign((void **)&v->recv_buffer, 4096, recv_bytes) ||
        !(v->repost = calloc(v->recv_depth, sizeof *v->repost)) || !(v->stash = calloc(POLL_BATCH, sizeof *v->stash))) {
        udt_error_check(error, "verbs: out of memory for %zu + %zu bytes of rings", send_bytes, recv_bytes);
        goto fail;
    }
    memset(v->send_buffer, 0, send_bytes);
    if (!(v->send_mr = ibv_reg_mr(v->pd, v->send_buffer, send_bytes, IBV_ACCESS_LOCAL_WRITE))) {
        udt_error_call(error, "ibv_reg_mr", verbs_errno(-1), NULL, "dev=%s send ring %zu bytes", v->device_name, send_bytes);
        goto fail;
    }
    if (!(v->recv_mr = ibv_reg_mr(v->pd, v->recv_buffer, recv_bytes, IBV_ACCESS_LOCAL_WRITE))) {
        udt_error_call(error, "ibv_reg_mr", verbs_errno(-1), NULL, "dev=%s receive ring %zu bytes", v->device_name, recv_bytes);
        goto fail;
    }
    if (post_receives(v, NULL, v->recv_depth) < 0) {
        *error = v->base.error;
        goto fail;
    }

    uint8_t *a = v->base.address;
    uint32_t qpn = v->qp->qp_num;
    memcpy(a, v->gid, 16);
    a[16] = (uint8_t)qpn, a[17] = (uint8_t)(qpn >> 8), a[18] = (uint8_t)(qpn >> 16), a[19] = (uint8_t)(qpn >> 24);
    a[20] = (uint8_t)v->lid, a[21] = (uint8_t)(v->lid >> 8);
    a[22] = (uint8_t)v->qkey, a[23] = (uint8_t)(v->qkey >> 8), a[24] = (uint8_t)(v->qkey >> 16), a[25] = (uint8_t)(v->qkey >> 24);
    v->base.address_bytes = UDT_VERBS_ADDRESS_BYTES;
    return &v->base;

fail:
    verbs_destroy(&v->base);
    return NULL;
}
