/* Finding 11 of issue 10: a verbs datagram's sender is (source QPN, source GID from the
 * 40 bytes in front of the datagram). Those bytes are written by the device only in part
 * (RoCEv2 over IPv4: the last 20) or not at all (no GRH), so what an earlier datagram left
 * in a receive slot must not decide who sent the new one: read with a stale IPv6 version
 * nibble in front, a RoCEv2 datagram's sender was taken from a GID half old, half new
 * (no peer's: the datagram was dropped as a stranger's), and without a GRH a RoCE
 * datagram was matched on its QPN alone.
 *
 * Built against the transport's own code (included, so its static functions are reached
 * without a device). Exits 0 when every check holds; prints the one that failed. */
#include "transport_verbs.c"

static int failures;

static void check(int ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "FAILED: %s\n", what);
        failures++;
    }
}

/* What a device leaves in a slot for an IB / RoCE-over-IPv6 datagram: a GRH, source GID at byte 8. */
static void write_ipv6_grh(uint8_t *slot, const uint8_t gid[16])
{
    memset(slot, 0, GRH_BYTES);
    slot[0] = 0x60;
    memcpy(slot + 8, gid, 16);
}

/* What rxe leaves for a RoCEv2-over-IPv4 datagram looped back inside one device: the IPv4
 * header in the last 20 bytes, its checksum not computed; the first 20 bytes untouched. */
static void write_ipv4_header(uint8_t *slot, const uint8_t source[4])
{
    uint8_t *ip4 = slot + 20;
    memset(ip4, 0, 20);
    ip4[0] = 0x45;
    ip4[8] = 64;
    ip4[9] = 17;
    memcpy(ip4 + 12, source, 4);
}

int main(void)
{
    static const uint8_t ipv6_gid[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55};
    static const uint8_t ipv4[4] = {198, 18, 0, 2};
    uint8_t ipv4_gid[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    memcpy(ipv4_gid + 12, ipv4, 4);

    /* two peers with the same QPN on different hosts (QPNs collide across hosts) */
    struct verbs_peer peers[2] = {{.qpn = 0x11, .lid = 0}, {.qpn = 0x11, .lid = 0}};
    memcpy(peers[0].gid, ipv6_gid, 16);
    memcpy(peers[1].gid, ipv4_gid, 16);
    struct verbs_transport v = {.peers = peers, .peer_count = 2, .last_peer_hit = -1};
    uint8_t slot[GRH_BYTES];
    struct ibv_wc wc = {.src_qp = 0x11, .wc_flags = IBV_WC_GRH};

    /* the hazard: peer 0's IPv6 header left in the slot, then an IPv4 datagram from peer 1 */
    write_ipv6_grh(slot, ipv6_gid);
    write_ipv4_header(slot, ipv4);
    check(lookup_peer(&v, &wc, slot) != 1, "control: without clearing, the stale header hides peer 1");

    /* the transport clears every slot before posting it: the datagram is peer 1's */
    v.last_peer_hit = -1;
    write_ipv6_grh(slot, ipv6_gid);
    clear_grh(slot);
    write_ipv4_header(slot, ipv4);
    check(lookup_peer(&v, &wc, slot) == 1, "a cleared slot names the IPv4 sender, peer 1");

    /* an IPv6 GRH written for this datagram still names its sender */
    v.last_peer_hit = -1;
    clear_grh(slot);
    write_ipv6_grh(slot, ipv6_gid);
    check(lookup_peer(&v, &wc, slot) == 0, "an IPv6 GRH names peer 0");

    /* no GRH on a RoCE link (LIDs are 0): nothing names the sender, whatever the slot holds */
    v.last_peer_hit = -1;
    struct ibv_wc no_grh = {.src_qp = 0x11, .slid = 0, .wc_flags = 0};
    write_ipv6_grh(slot, ipv6_gid);
    check(lookup_peer(&v, &no_grh, slot) == -1, "a RoCE datagram without a GRH is no peer's");

    /* no GRH on IB within a subnet: the LID names the sender */
    peers[1].lid = 7;
    v.last_peer_hit = -1;
    no_grh.slid = 7;
    check(lookup_peer(&v, &no_grh, slot) == 1, "an IB datagram without a GRH is named by its LID");

    return failures ? 1 : 0;
}
