/* The verdict round: after its data phase every rank tells every other rank
 * what it saw (struct udt_verdict), and all of them combine the same set of
 * messages the same way, so every rank returns the same outcome.
 *
 * One round, all to all: O(N) small messages per rank, O(1) rounds, and a
 * dead rank is seen directly by everyone.
 * Control messages are repeated until acknowledged ("no retransmission" is
 * about data). The acknowledgement is HAVE_YOURS, and a rank sends it only
 * once it has decided: to every peer whose verdict it holds at that moment,
 * and in its messages to them after. A rank that holds a peer's verdict
 * before deciding says so (HOLDING), so that the peer need not answer. A
 * request is answered with a REPLY; a reply is answered only where it brings
 * a verdict after we decided or an acknowledgement that lacks ours. A rank decides
 * once it holds every verdict, and returns once every peer acknowledged (or
 * at the hard deadline): a peer that has not decided is still in the call,
 * and would otherwise time out blaming us while we succeeded.
 *
 * Because a decided rank waits for the others to decide, it is there to help
 * them: a rank that lacks a verdict names it in its messages (chunk_index),
 * and a rank that holds it passes it on (RELAYED). So a verdict that reached
 * one rank can reach all of them while a holder is still in the call, even
 * where its sender's link to some rank drops everything or the sender died
 * after sending (a closed port's verdict is asked for before deciding without
 * it). Peers one call ahead are answered from the kept verdict of the previous call. */
#include <stdio.h>
#include <string.h>

#include "engine_internal.h"

/* A decided rank that holds a peer's verdict waits only for the peer's acknowledgement, which the
 * peer sends when it decides and in answer to us after: ask again after a quarter of the first
 * resend interval, backing off to at most one interval. Under loss the rank that answers last
 * stays ANSWER_WAIT_INTERVALS first-resend intervals after its last answer, in which a peer that
 * lost every copy of that answer asks at least twice more. One interval was enough while a rank
 * acknowledged on receipt; acknowledging at deciding, one left a rank waiting 64 intervals for a
 * presumed acknowledgement on 1-3% of 8-rank calls at 10% loss (scripts/verdict_round.py), two
 * on under 1%. A quarter interval is also how long an undecided rank takes a peer's request to
 * have crossed its own (udt_verdict_receive), and how long a rank waits for a relay of a closed
 * port's verdict. */
#define ACK_INTERVAL_DIVISOR 4u
#define ACK_INTERVAL_MAX_SHIFT 2u
#define ANSWER_WAIT_INTERVALS 2u
/* quarter intervals a rank asks the open peers for the verdicts of closed ports before deciding
 * without them (udt_verdict_progress) */
#define CLOSED_ASK_INTERVALS 8u
/* A decided rank still waiting for a peer's acknowledgement stops waiting once the peer has been
 * silent ACK_QUIET_INTERVALS first-resend intervals and our verdict has gone to it ACK_QUIET_SENDS
 * times since we decided. Any one of those copies would have given the peer our verdict and our
 * decision, and a peer that has not decided would still be answering; silence means it decided
 * and left, its answers to us lost (a burst took the last of them), and it cannot answer again
 * until its next call. Waiting on would hold us to the hard deadline for nothing. The count is
 * what makes this safe: loss that takes 64 copies in a row (p^64 independently) would take the data first. */
#define ACK_QUIET_INTERVALS 64u
#define ACK_QUIET_SENDS 64u

/* Whether the peer's verdict for this call came before its port closed: it decided and left, as
 * a peer does after the last call; nothing it owed us is missing. */
static int left_after_its_verdict(const struct call *c, const struct udt_comm *comm, uint32_t peer)
{
    const struct peer_state *p = &comm->peers[peer];
    return (p->slot[c->sequence & 1].flags & VERDICT_GOT) && p->slot[c->sequence & 1].sequence == c->sequence &&
           p->bounced_ns >= c->start_ns && p->bounced_ns > p->alive_ns;
}

/* Our verdict went to the peer (a request, an answer or an acknowledgement). */
static void note_ours_sent(struct peer_in_call *in, uint64_t now)
{
    if (!in->ours_sent)
        in->ours_first_sent_ns = now;
    in->ours_sent = 1;
}

/* Asking for an acknowledgement keeps to agree_resend_us: a peer that answered last stays a
 * fixed two of them (answer_wait_end). Asking for a verdict waits as long as rounds here usually
 * take (udt_verdict_resend_base_ns). */
static uint64_t resend_interval(const struct call *c, const struct udt_comm *comm, uint32_t attempts, int only_ack_missing)
{
    if (only_ack_missing)
        return (uint64_t)comm->options.agree_resend_us * 1000ull / ACK_INTERVAL_DIVISOR
               << (attempts < ACK_INTERVAL_MAX_SHIFT ? attempts : ACK_INTERVAL_MAX_SHIFT);
    uint64_t backed_off = udt_verdict_resend_base_ns(c, comm) << (attempts < 4 ? attempts : 4);
    uint64_t longest = (uint64_t)comm->options.agree_resend_us * 1000ull << 4; /* as long as before it waited rounds */
    return backed_off < longest ? backed_off : longest;
}

/* `copies`: FINAL (an END marker's) where the message may be the last the peer needs from us before we leave (a
 * decided rank's answer, the notice to a peer it gave up on); the acknowledgement at deciding as many as
 * udt_answer_copies says. Anything else goes once: the peer or we ask again while it lacks it. */
#define FINAL(comm) ((int)(comm)->options.end_repeats)
static int send_verdict(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t sequence, uint32_t layout_tag,
                        const uint8_t *payload, uint8_t flags, uint32_t chunk_index, int copies)
{
    if (sequence == c->sequence && !(flags & UDT_AGREE_RELAYED) && comm->peers[peer].in_call.ours_sent)
        flags |= UDT_AGREE_AGAIN; /* ours went to it before: a verdict that comes this way lost its first copy */
    struct udt_control verdict = {.kind = UDT_KIND_AGREE, .flags = flags, .sequence = sequence, .layout_tag = layout_tag,
                                  .chunk_index = chunk_index, .payload = payload,
                                  .copies = copies};
    int rc = udt_send_control(c, peer, &verdict);
    c->verdict.ours_missing |= rc < verdict.copies; /* the socket was full: a copy never left */
    return rc < 0 ? rc : 0;
}

/* What one rank that called with our layout can report of this call: at most every contribution
 * to the longest block (a sized all_to_all's checksum: anything), at most every element fresh, a
 * budget in [0, 1]. (A rank with another layout is named by the layout check.) */
static int verdict_plausible(const struct call *c, const uint8_t *payload)
{
    struct udt_verdict v;
    udt_verdict_decode(payload, &v);
    uint64_t longest_block = (c->args.count + c->n - 1) / c->n;
    return (c->args.piece_counts || v.reduce_weighted <= (uint64_t)c->n * longest_block) && v.fresh_elements <= udt_fresh_scale(c) &&
           v.loss_budget >= 0.0 && v.loss_budget <= 1.0;
}

static struct verdict_slot *slot_for(struct udt_comm *comm, uint32_t peer, uint32_t sequence)
{
    struct verdict_slot *slot = &comm->peers[peer].slot[sequence & 1];
    if (slot->sequence != sequence) {
        slot->sequence = sequence;
        slot->flags = 0;
    }
    return slot;
}

/* The peer's verdict is in: its data phase is over, it sends us nothing more. */
static void note_finished(struct udt_comm *comm, uint32_t peer, uint64_t now)
{
    struct peer_in_call *in = &comm->peers[peer].in_call;
    if (!in->finished) {
        in->finished = 1;
        in->finished_at_ns = now;
    }
}

static void mark_finished(struct call *c, struct udt_comm *comm, uint32_t peer, uint64_t now)
{
    udt_hear(c, comm, peer, now);
    note_finished(comm, peer, now);
}

/* A peer's verdict that carries a cause fails the call on every rank whatever else arrives: the
 * data phase can end; one that names a closed port lets us stop waiting for that rank's verdict. */
static void heed_cause(struct call *c, struct udt_comm *comm, const uint8_t *payload)
{
    struct udt_verdict v;
    udt_verdict_decode(payload, &v);
    if (v.cause == CAUSE_NONE)
        return;
    c->live.doomed = 1;
    if (v.cause & CAUSE_PORT_CLOSED)
        udt_note_port_closed(c, comm, CAUSE_RANK(v.cause));
}

/* A peer that sends us anything of the next call has decided this one, so
 * it holds our verdict: that is its acknowledgement, even if the answer
 * saying so was lost. */
static void verdict_peer_moved_on(struct call *c, struct udt_comm *comm, uint32_t peer)
{
    struct verdict_slot *slot = slot_for(comm, peer, c->sequence);
    if ((slot->flags & VERDICT_GOT) && !(slot->flags & VERDICT_ACKED)) {
        slot->flags |= VERDICT_ACKED;
        c->verdict.verdicts_acked++;
    }
}

/* At the start of a call: verdicts that peers one call ahead sent early. */
void udt_verdict_begin_peers(struct call *c, struct udt_comm *comm, uint64_t now)
{
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->rank)
            continue;
        struct verdict_slot *slot = slot_for(comm, p, c->sequence);
        if ((slot->flags & VERDICT_GOT) && slot->layout_tag == c->layout_tag && !verdict_plausible(c, slot->payload)) {
            slot->flags = 0; /* sent before this call started, by a peer or a forger: it will send its real one again */
            c->stats->dropped_invalid++;
        }
        if (slot->flags & VERDICT_GOT) {
            c->verdict.verdicts_got++;
            mark_finished(c, comm, p, now);
            heed_cause(c, comm, slot->payload);
        }
        if (slot->flags & VERDICT_ACKED)
            c->verdict.verdicts_acked++;
    }
}

void udt_verdict_begin(struct call *c, struct udt_comm *comm, uint64_t now)
{
    /* the join timeout ran out (until every peer is heard from, the deadline is the join
     * timeout's): a peer we never heard from did not join in time. We say so in our verdict
     * (blaming the highest such rank, as decide does), so that a peer coming after the timeout,
     * which finds our verdict waiting, fails as we do instead of passing on the counts we could
     * gather without it. (A call can also end unheard with nothing to exchange, a peer's block
     * empty: no timeout, no cause.) Layouts are compared from the tags every verdict carries. */
    uint32_t absent = CAUSE_NONE;
    if (!c->live.all_heard_ns && now >= c->live.deadline_ns)
        for (uint32_t p = 0; p < c->n; p++)
            if (p != c->rank && !comm->peers[p].in_call.heard)
                absent = CAUSE_WORD(CAUSE_PEER_TIMEOUT, p);
    /* a closed port we saw is named in the first copy of our verdict, so that every rank that
     * combines it fails alike (evidence seen after this is combined where we decide) */
    for (uint32_t p = 0; p < c->n && c->live.ports_closed; p++)
        if (comm->peers[p].in_call.port_closed && !(slot_for(comm, p, c->sequence)->flags & VERDICT_GOT))
            absent = udt_cause_max(absent, CAUSE_WORD(CAUSE_PEER_TIMEOUT, p) | CAUSE_PORT_CLOSED);
    struct udt_verdict mine = {
        .cause = absent,
        .agree_value = c->args.agree_value,
        .reduce_weighted = udt_reduce_weighted(c),
        .fresh_elements = udt_fresh_elements(c),
        .loss_budget = c->args.loss_budget,
    };
    udt_verdict_encode(&mine, c->verdict.my_verdict);
    c->phase = PHASE_VERDICT;
    c->verdict.verdict_started_ns = now;
    for (uint32_t p = 0; p < c->n; p++)
        comm->peers[p].in_call.verdict_resend_ns = now; /* everyone is due at once */
    c->verdict.verdict_resend_due_ns = now;
}

/* A rank whose verdict we lack, + 1, to name in a message to `to` (0: none, or decided), so that a
 * peer holding it passes it on. Successive calls walk round the missing ranks, so that one whose
 * verdict nobody holds (it died before sending) does not hide the others. */
static uint32_t lacking_hint(struct call *c, struct udt_comm *comm, uint32_t to)
{
    if (c->verdict.decided || c->phase < PHASE_VERDICT)
        return 0;
    for (uint32_t i = 0; i < c->n; i++) {
        uint32_t p = (c->verdict.hint_next + i) % c->n;
        if (p == c->rank || p == to || (slot_for(comm, p, c->sequence)->flags & VERDICT_GOT))
            continue;
        c->verdict.hint_next = p + 1;
        return p + 1;
    }
    return 0;
}

/* A peer said it lacks rank `wanted`'s verdict of call `sequence`: pass on the copy we hold, as it
 * came (one copy; the peer names it again while it lacks it). */
static void relay_wanted(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t sequence, uint32_t wanted)
{
    if (wanted >= c->n || wanted == c->rank || wanted == peer)
        return;
    const struct verdict_slot *slot = &comm->peers[wanted].slot[sequence & 1];
    if (slot->sequence == sequence && (slot->flags & VERDICT_GOT))
        (void)send_verdict(c, comm, peer, sequence, slot->layout_tag, slot->payload, UDT_AGREE_REPLY | UDT_AGREE_RELAYED,
                           wanted, 1);
}

/* A verdict another rank passed on (relay_wanted), taken as its original rank's own while we lack
 * that and have not decided. The relayer is a rank of the session and the payload passed the
 * checks any verdict passes: a forger gains nothing it could not have by forging the original. */
static void take_relayed(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, const uint8_t *payload,
                         uint32_t peer, uint64_t now)
{
    if (h->sequence != c->sequence) {
        /* late, for the call we decided last (we named it while undecided): nothing to do. Any
         * other call's is stale: relays answer our names, and we name only the current call's */
        if (!(comm->have_last_verdict && h->sequence == comm->last_verdict_sequence))
            c->stats->dropped_stale++;
        return;
    }
    udt_hear(c, comm, peer, now);
    uint32_t origin = h->chunk_index;
    struct verdict_slot *slot = slot_for(comm, origin, c->sequence);
    if (c->verdict.decided || (slot->flags & VERDICT_GOT))
        return;
    memcpy(slot->payload, payload, UDT_VERDICT_BYTES);
    slot->layout_tag = h->layout_tag;
    slot->flags |= VERDICT_GOT;
    c->verdict.verdicts_got++;
    c->stats->verdicts_relayed++;
    note_finished(comm, origin, now); /* not heard: second hand, no sign that it is still there */
    heed_cause(c, comm, payload);
}

static int decide_and_acknowledge(struct call *c, struct udt_comm *comm, uint64_t now);

void udt_verdict_receive(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, const uint8_t *payload,
                         uint32_t payload_bytes, uint32_t peer, uint64_t now)
{
    int relayed = h->flags & UDT_AGREE_RELAYED;
    if (payload_bytes != UDT_VERDICT_BYTES || h->payload_bytes != UDT_VERDICT_BYTES || (h->flags & ~UDT_AGREE_FLAGS) ||
        h->reserved ||
        (relayed ? h->flags != (UDT_AGREE_RELAYED | UDT_AGREE_REPLY) || h->chunk_index >= c->n || h->chunk_index == c->rank ||
                       h->chunk_index == peer
                 : h->chunk_index > c->n)) {
        c->stats->dropped_invalid++;
        return;
    }
    struct udt_verdict claimed;
    udt_verdict_decode(payload, &claimed);
    if (CAUSE_SEVERITY(claimed.cause) > CAUSE_TRANSPORT || (claimed.cause != CAUSE_NONE && CAUSE_RANK(claimed.cause) >= c->n) ||
        ((claimed.cause & CAUSE_PORT_CLOSED) && CAUSE_SEVERITY(claimed.cause) != CAUSE_PEER_TIMEOUT)) {
        c->stats->dropped_invalid++; /* a cause no rank can have: it would blame a rank that does not exist */
        return;
    }
    if (h->sequence == c->sequence && h->layout_tag == c->layout_tag && !verdict_plausible(c, payload)) {
        c->stats->dropped_invalid++;
        return;
    }
    if (relayed) {
        take_relayed(c, comm, h, payload, peer, now);
        return;
    }
    int have_ours = h->flags & UDT_AGREE_HAVE_YOURS, is_reply = h->flags & UDT_AGREE_REPLY;
    uint32_t wanted = h->chunk_index ? h->chunk_index - 1 : UINT32_MAX; /* a rank whose verdict the peer lacks */
    if (h->sequence == c->sequence || h->sequence == c->sequence + 1) {
        udt_hear(c, comm, peer, now); /* a repeated request too: the peer is still in the round */
        struct verdict_slot *slot = slot_for(comm, peer, h->sequence);
        int current = h->sequence == c->sequence;
        int news = !(slot->flags & VERDICT_GOT);
        if (news) {
            memcpy(slot->payload, payload, UDT_VERDICT_BYTES);
            slot->layout_tag = h->layout_tag;
            slot->flags |= VERDICT_GOT;
            if (current) {
                c->verdict.verdicts_late += (h->flags & UDT_AGREE_AGAIN) != 0;
                c->verdict.verdicts_got++;
                mark_finished(c, comm, peer, now);
                heed_cause(c, comm, payload);
            }
        } else if (!(current && c->verdict.decided) && slot->layout_tag == h->layout_tag &&
                   (claimed.cause & ~CAUSE_PORT_CLOSED) == CAUSE_WORD(CAUSE_PEER_TIMEOUT, c->rank)) {
            /* a peer that gave up on us sends its verdict on with that cause (decide): take it,
             * so that we fail as it did (the counts are the ones it sent first). Only this cause:
             * a forger gains nothing it could not have by sending its verdict first */
            struct udt_verdict held;
            udt_verdict_decode(slot->payload, &held);
            if (udt_cause_max(claimed.cause, held.cause) != held.cause) {
                held.cause = udt_cause_max(claimed.cause, held.cause);
                udt_verdict_encode(&held, slot->payload);
            }
        }
        if (have_ours && !(slot->flags & VERDICT_ACKED)) {
            slot->flags |= VERDICT_ACKED;
            c->verdict.verdicts_acked += current;
        }
        if (!current) {
            verdict_peer_moved_on(c, comm, peer);
            return;
        }
        if (wanted != UINT32_MAX)
            relay_wanted(c, comm, peer, c->sequence, wanted);
        struct peer_in_call *in = &comm->peers[peer].in_call;
        /* a request sent again that lacks what we sent it an interval before (our verdict; once
         * we decided, our acknowledgement: it does not say HOLDING) tells of loss toward it */
        if ((h->flags & (UDT_AGREE_AGAIN | UDT_AGREE_HOLDING | UDT_AGREE_REPLY)) == UDT_AGREE_AGAIN) {
            uint64_t since = have_ours ? (c->verdict.decided ? c->verdict.decided_ns : 0) : in->ours_sent ? in->ours_first_sent_ns : 0;
            c->verdict.ours_missing |= since && now >= since + udt_verdict_resend_base_ns(c, comm);
        }
        if (c->phase < PHASE_VERDICT)
            return;
        /* the verdict that completes our set: decide now, acknowledging every peer at once, this
         * one too (so it is not answered again below) */
        if (news && !c->verdict.decided && c->verdict.verdicts_got >= c->n - 1) {
            decide_and_acknowledge(c, comm, now);
            return;
        }
        /* Decided, answer every request (the peer lacks our acknowledgement), a verdict that came
         * after we decided, and an acknowledgement that says it lacks ours (no HOLDING) where ours
         * went in one copy (decide: the peer got our verdict through a relay, or every copy of a
         * request was lost). Ours says we hold the peer's where we do. Undecided, answer a
         * request where the peer may lack our verdict (it does not say it holds it, and ours did
         * not go to it a moment ago: the two crossed), and a decided peer's, naming a verdict we
         * lack for it to pass on. The peer gets our acknowledgement when we decide. An answer is
         * not answered. */
        uint64_t crossing = (uint64_t)comm->options.agree_resend_us * 1000ull / ACK_INTERVAL_DIVISOR;
        int crossed = now < comm->peers[peer].in_call.verdict_sent_ns + crossing;
        int holds_ours = h->flags & (UDT_AGREE_HOLDING | UDT_AGREE_HAVE_YOURS);
        uint32_t hint = !is_reply && have_ours ? lacking_hint(c, comm, peer) : 0;
        int lacks_our_ack = have_ours && !(h->flags & UDT_AGREE_HOLDING) && in->acked_once;
        if (c->verdict.decided ? !is_reply || news || lacks_our_ack
                               : !is_reply && ((!holds_ours && !crossed) || hint)) {
            uint8_t flags = UDT_AGREE_REPLY | (c->verdict.decided ? UDT_AGREE_HAVE_YOURS : UDT_AGREE_HOLDING) |
                            (c->verdict.decided && (slot->flags & VERDICT_ACKED) ? UDT_AGREE_HOLDING : 0);
            send_verdict(c, comm, peer, c->sequence, c->layout_tag, c->verdict.my_verdict, flags,
                         hint ? hint : lacking_hint(c, comm, peer), c->verdict.decided ? FINAL(comm) : 1);
            note_ours_sent(in, now);
            if (c->verdict.decided) {
                c->verdict.answered_ns = now;
                in->acked_once = 0; /* FINAL copies went */
            }
        }
        return;
    }
    if (h->sequence == comm->last_verdict_sequence && comm->have_last_verdict) {
        /* a peer still in the previous call lacks our verdict or our acknowledgement */
        if (!is_reply)
            send_verdict(c, comm, peer, comm->last_verdict_sequence, comm->last_layout_tag, comm->last_verdict,
                         UDT_AGREE_HAVE_YOURS | UDT_AGREE_REPLY, 0, FINAL(comm));
        if (wanted != UINT32_MAX)
            relay_wanted(c, comm, peer, comm->last_verdict_sequence, wanted);
        return;
    }
    c->stats->dropped_stale++;
}

static uint32_t tag_of(struct call *c, struct udt_comm *comm, uint32_t rank)
{
    return rank == c->rank ? c->layout_tag : comm->peers[rank].slot[c->sequence & 1].layout_tag;
}

/* Ranks that called with another layout, judged the same way everywhere from
 * the tags all verdicts carry: the tag most ranks hold (ties: the lowest
 * rank's) is right; the lowest rank holding another is blamed. Returns a
 * cause word, CAUSE_NONE when all tags agree. */
static uint32_t layout_cause(struct call *c, struct udt_comm *comm)
{
    int all_equal = 1;
    for (uint32_t p = 0; p < c->n && all_equal; p++)
        if (p != c->rank && (comm->peers[p].slot[c->sequence & 1].flags & VERDICT_GOT))
            all_equal = tag_of(c, comm, p) == c->layout_tag;
    if (all_equal)
        return CAUSE_NONE;
    uint32_t best_tag = 0, best_votes = 0;
    for (uint32_t p = 0; p < c->n; p++) { /* quadratic, but only when a caller erred */
        if (p != c->rank && !(comm->peers[p].slot[c->sequence & 1].flags & VERDICT_GOT))
            continue;
        uint32_t votes = 0;
        for (uint32_t q = 0; q < c->n; q++)
            votes += (q == c->rank || (comm->peers[q].slot[c->sequence & 1].flags & VERDICT_GOT)) && tag_of(c, comm, q) == tag_of(c, comm, p);
        if (votes > best_votes) {
            best_votes = votes;
            best_tag = tag_of(c, comm, p);
        }
    }
    for (uint32_t p = 0; p < c->n; p++)
        if ((p == c->rank || (comm->peers[p].slot[c->sequence & 1].flags & VERDICT_GOT)) && tag_of(c, comm, p) != best_tag)
            return CAUSE_WORD(CAUSE_LAYOUT, p);
    return CAUSE_NONE;
}

static int decide(struct call *c, struct udt_comm *comm, uint64_t now)
{
    struct udt_verdict combined, other;
    udt_verdict_decode(c->verdict.my_verdict, &combined);
    uint64_t fresh_least = combined.fresh_elements;
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->rank)
            continue;
        struct verdict_slot *slot = slot_for(comm, p, c->sequence);
        if (!(slot->flags & VERDICT_GOT)) {
            uint32_t silent = CAUSE_WORD(CAUSE_PEER_TIMEOUT, p) | (comm->peers[p].in_call.port_closed ? CAUSE_PORT_CLOSED : 0);
            combined.cause = udt_cause_max(combined.cause, silent);
            continue;
        }
        udt_verdict_decode(slot->payload, &other);
        combined.cause = udt_cause_max(combined.cause, other.cause);
        combined.agree_value = other.agree_value > combined.agree_value ? other.agree_value : combined.agree_value;
        combined.loss_budget = other.loss_budget < combined.loss_budget ? other.loss_budget : combined.loss_budget;
        combined.reduce_weighted += other.reduce_weighted;
        fresh_least = other.fresh_elements < fresh_least ? other.fresh_elements : fresh_least;
    }
    uint32_t mismatch = layout_cause(c, comm);
    combined.cause = udt_cause_max(combined.cause, mismatch);
    int pieces_disagree = c->args.piece_counts && combined.reduce_weighted != 0 && mismatch == CAUSE_NONE; /* pieces.c */
    if (pieces_disagree && combined.cause == CAUSE_NONE)
        combined.cause = CAUSE_WORD(CAUSE_LAYOUT, 0); /* no one rank to blame: the same word everywhere */
    struct udt_collective_stats *st = c->stats;
    double count = (double)udt_fresh_scale(c);
    int reduces = c->schedule.facts->reduces, gathers = c->schedule.facts->gathers;
    struct udt_verdict mine;
    udt_verdict_decode(c->verdict.my_verdict, &mine);
    if (count > 0) {
        uint32_t own = c->schedule.owned_block;
        double own_length = (double)(c->geometry.block_first[own + 1] - c->geometry.block_first[own]);
        st->reduce_fraction = reduces ? (double)combined.reduce_weighted / ((double)c->n * count) : 1.0;
        st->gather_fraction = gathers ? (double)fresh_least / count : 1.0;
        st->own_reduce_fraction = reduces && own_length > 0 ? (double)mine.reduce_weighted / ((double)c->n * own_length) : 1.0;
        st->own_gather_fraction = gathers ? (double)mine.fresh_elements / count : 1.0;
    }
    st->agreed_value = combined.agree_value;
    uint32_t severity = CAUSE_SEVERITY(combined.cause), blamed = CAUSE_RANK(combined.cause);
    if (severity == CAUSE_PEER_TIMEOUT) {
        st->silent_rank = (int32_t)blamed;
        if (blamed == c->rank)
            udt_error_check(&comm->error, "rank %u (this rank): its peers stopped waiting for it (it came to the call "
                            "after the %.1f s join timeout, or its verdict did not reach them within the %.3f s deadline)",
                            blamed, comm->options.join_timeout_ms * 1e-3, c->args.deadline_s);
        else if (combined.cause & CAUSE_PORT_CLOSED)
            udt_error_check(&comm->error, "rank %u is gone: its port is closed (a datagram of this call to it came back as "
                            "ICMP port unreachable, quoting this session), so its process exited or it closed its "
                            "communicator", blamed);
        else if (blamed < c->n && (slot_for(comm, blamed, c->sequence)->flags & VERDICT_GOT))
            udt_error_check(&comm->error, "rank %u came late to the call or its verdict reached a peer too late: that "
                            "peer stopped waiting for it", blamed);
        else if (blamed < c->n && comm->peers[blamed].in_call.heard)
            udt_error_check(&comm->error, "rank %u went silent in the call: no verdict within the %.3f s deadline",
                     blamed, c->args.deadline_s);
        else
            udt_error_check(&comm->error, "rank %u did not join the call: timed out waiting for it (join timeout %.1f s)", blamed,
                     comm->options.join_timeout_ms * 1e-3);
        c->verdict.status = UDT_ERR_PEER_TIMEOUT;
    } else if (severity == CAUSE_LAYOUT) {
        c->live.mismatched_rank = pieces_disagree ? -1 : (int32_t)blamed;
        if (pieces_disagree)
            udt_error_check(&comm->error, "the ranks' pieces disagree: what some rank sends another is not what that rank takes");
        else
            udt_error_check(&comm->error, "rank %u called another collective, element count, dtype, op or root", blamed);
        c->verdict.status = UDT_ERR_LAYOUT_MISMATCH;
    } else if (severity != CAUSE_NONE) {
        udt_error_check(&comm->error, "rank %u failed with a transport error", blamed);
        c->verdict.status = UDT_ERR_TRANSPORT;
    } else if ((st->budget_missed = udt_budget_missed(st->reduce_fraction, st->gather_fraction, combined.loss_budget)) &&
               !c->args.write_on_budget_miss) {
        udt_error_check(&comm->error,
                 "%.2f%% of contributions missing at their owners and %.2f%% of some rank's result stale; budget %.2f%%",
                 100.0 * (1.0 - st->reduce_fraction), 100.0 * (1.0 - st->gather_fraction), 100.0 * combined.loss_budget);
        c->verdict.status = UDT_ERR_LOSS_BUDGET;
    } else {
        c->verdict.status = UDT_OK;
    }
    c->verdict.decided = 1;
    c->verdict.decided_ns = now;
    /* kept to answer peers that are still in this call when we are in the next */
    comm->last_verdict_sequence = c->sequence;
    comm->have_last_verdict = 1;
    comm->last_layout_tag = c->layout_tag;
    comm->last_steps = c->schedule.steps;
    /* every copy we send from now on (resends to peers yet to acknowledge, answers in the next
     * call) carries the cause we decided on, so that a peer that comes back or comes late fails
     * as we did instead of passing on the counts it finds; the counts stay our own because a
     * peer sums them with everyone's */
    mine.cause = combined.cause;
    udt_verdict_encode(&mine, c->verdict.my_verdict);
    memcpy(comm->last_verdict, c->verdict.my_verdict, UDT_VERDICT_BYTES);
    /* The acknowledgement: every peer whose verdict we hold hears that we decided, as a reply,
     * saying whether we hold its acknowledgement (HOLDING). A peer that may hold our verdict
     * already may decide without this message, and then wait only for it: it gets as many copies
     * as the recent loss calls for (udt_answer_copies). One that cannot (our verdict never went
     * to it) gets one copy: it cannot decide without it, so if the copy is lost our requests (a
     * quarter interval on) bring it, and we are still here because it has not acknowledged.
     * Whenever a peer's acknowledgement says it lacks ours (every copy lost, or our verdict
     * reached it through a relay), we answer it (udt_verdict_receive). A peer
     * we gave up on may only be paused: it gets our verdict without the acknowledgement, so that
     * it fails as we do when it wakes; best effort, we leave either way. */
    c->verdict.ack_copies = udt_answer_copies(c, comm, udt_call_showed_loss(c, comm));
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->rank)
            continue;
        struct verdict_slot *slot = slot_for(comm, p, c->sequence);
        int got = slot->flags & VERDICT_GOT;
        struct peer_in_call *in = &comm->peers[p].in_call;
        int acked = got && (slot->flags & VERDICT_ACKED), may_hold_ours = acked || in->ours_sent;
        int copies = !got ? FINAL(comm) : may_hold_ours ? (int)c->verdict.ack_copies : 1;
        if (got || severity == CAUSE_PEER_TIMEOUT) {
            (void)send_verdict(c, comm, p, c->sequence, c->layout_tag, c->verdict.my_verdict,
                               UDT_AGREE_REPLY | (got ? UDT_AGREE_HAVE_YOURS : 0) | (acked ? UDT_AGREE_HOLDING : 0), 0, copies);
            note_ours_sent(in, now);
            in->acked_once = got && !may_hold_ours;
        }
    }
    c->verdict.answered_ns = now;
    return 1;
}

/* Decide, and from now on ask the peers yet to acknowledge a quarter interval after the
 * acknowledgement just sent, backing off to one interval: under loss a peer whose acknowledgement
 * was lost stays ANSWER_WAIT_INTERVALS after sending it (answer_wait_end), so it must be asked
 * within that. Asking
 * also draws the names of verdicts an undecided peer lacks. */
static int decide_and_acknowledge(struct call *c, struct udt_comm *comm, uint64_t now)
{
    int progressed = decide(c, comm, now);
    uint64_t soon = now + (uint64_t)comm->options.agree_resend_us * 1000ull / ACK_INTERVAL_DIVISOR;
    for (uint32_t p = 0; p < c->n; p++) {
        if (comm->peers[p].in_call.verdict_attempts > 1)
            comm->peers[p].in_call.verdict_attempts = 1;
        comm->peers[p].in_call.verdict_resend_ns = soon;
    }
    c->verdict.verdict_resend_due_ns = soon;
    return progressed;
}

/* Whether every peer that has not acknowledged our verdict has left (its port closed after its
 * verdict came), had its port closed in this call, or has been silent long enough after getting enough copies of it (see
 * ACK_QUIET_INTERVALS). */
static int acks_presumed(struct call *c, struct udt_comm *comm, uint64_t now, uint64_t base)
{
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->rank)
            continue;
        struct peer_state *peer = &comm->peers[p];
        if ((slot_for(comm, p, c->sequence)->flags & VERDICT_ACKED) || left_after_its_verdict(c, comm, p) || peer->in_call.port_closed)
            continue;
        uint64_t quiet_since = peer->in_call.last_heard_ns > c->verdict.decided_ns ? peer->in_call.last_heard_ns : c->verdict.decided_ns;
        if (peer->in_call.acks_asked < ACK_QUIET_SENDS || now < quiet_since + ACK_QUIET_INTERVALS * base)
            return 0;
    }
    return 1;
}

/* Whether every peer has sent its verdict or its port was seen closed in this call (it never
 * will; the cause that names it is in our verdict or in a peer's, so every rank fails alike). */
static int all_but_closed_answered(const struct call *c, const struct udt_comm *comm)
{
    if (!c->live.ports_closed)
        return 0;
    for (uint32_t p = 0; p < c->n; p++)
        if (p != c->rank && !comm->peers[p].in_call.port_closed && !(comm->peers[p].slot[c->sequence & 1].flags & VERDICT_GOT))
            return 0;
    return 1;
}

/* Our verdict to a peer as a request (one copy), carrying our acknowledgement once decided and
 * holding its verdict, HOLDING while undecided and holding it, and `hint` (lacking_hint). Returns
 * the transport's error, or 0. */
static int send_request(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t hint, uint64_t now)
{
    int got = slot_for(comm, peer, c->sequence)->flags & VERDICT_GOT;
    uint8_t flags = got ? (c->verdict.decided ? UDT_AGREE_HAVE_YOURS : UDT_AGREE_HOLDING) : 0;
    int rc = send_verdict(c, comm, peer, c->sequence, c->layout_tag, c->verdict.my_verdict, flags, hint, 1);
    comm->peers[peer].in_call.verdict_sent_ns = now;
    note_ours_sent(&comm->peers[peer].in_call, now);
    return rc;
}

int udt_verdict_progress(struct call *c, struct udt_comm *comm, uint64_t now, uint64_t *wake)
{
    int progressed = 0;
    uint32_t others = c->n - 1;
    uint64_t base = (uint64_t)comm->options.agree_resend_us * 1000ull;
    /* Every verdict we lack is a closed port's. The rank may have died after its verdict reached
     * some peers: ask every open one for them, naming one each time (the names walk round the
     * missing ranks), every quarter interval, and decide on the closed ports only if no relay
     * came within CLOSED_ASK_INTERVALS of them. The peers that hold those verdicts wait for our
     * acknowledgement meanwhile. */
    int closed_only = !c->verdict.decided && all_but_closed_answered(c, comm);
    uint64_t quarter = base / ACK_INTERVAL_DIVISOR;
    if (closed_only && !c->verdict.closed_asked_ns)
        c->verdict.closed_asked_ns = now;
    if (closed_only && now >= c->verdict.closed_next_ask_ns) {
        c->verdict.closed_next_ask_ns = now + quarter;
        for (uint32_t p = 0; p < c->n; p++) {
            if (p == c->rank || comm->peers[p].in_call.port_closed)
                continue;
            int rc = send_request(c, comm, p, lacking_hint(c, comm, p), now);
            if (rc < 0)
                return rc;
        }
    }
    uint64_t closed_wait_end = c->verdict.closed_asked_ns + CLOSED_ASK_INTERVALS * quarter;
    if (!c->verdict.decided && (c->verdict.verdicts_got >= others || now >= c->live.hard_deadline_ns ||
                                (closed_only && now >= closed_wait_end)))
        progressed |= decide_and_acknowledge(c, comm, now);
    if (closed_only && !c->verdict.decided) {
        uint64_t closed_wake = c->verdict.closed_next_ask_ns < closed_wait_end ? c->verdict.closed_next_ask_ns : closed_wait_end;
        if (closed_wake < *wake)
            *wake = closed_wake;
    }
    /* Done once every peer has decided, holding our verdict. If we have just answered a peer
     * (or acknowledged at deciding) and loss may have taken every copy (udt_answers_at_risk:
     * heavy loss, or loss in bursts and this call saw some: a chunk lost, a verdict asked for
     * again before deciding, a message of ours missing; not our asking for an acknowledgement,
     * which says only that a peer is slow to decide), stay ANSWER_WAIT_INTERVALS resend
     * intervals to answer again should it be lost: the peer cannot return before it hears from
     * us, and after we return nobody answers it until our next call. */
    int lossy = c->verdict.answered_ns && udt_answers_at_risk(c, comm, udt_call_showed_loss(c, comm));
    uint64_t answer_wait_end = lossy ? c->verdict.answered_ns + ANSWER_WAIT_INTERVALS * base : 0;
    if (c->verdict.decided && c->verdict.verdicts_acked < others && acks_presumed(c, comm, now, base)) {
        c->stats->verdict_acks_presumed += others - c->verdict.verdicts_acked;
        c->verdict.verdicts_acked = others;
    }
    if (c->verdict.decided && ((c->verdict.verdicts_acked >= others && now >= answer_wait_end) || now >= c->live.hard_deadline_ns)) {
        c->phase = PHASE_DONE;
        c->stats->agree_s = (double)(now - c->verdict.verdict_started_ns) * 1e-9;
        c->stats->answer_waits = answer_wait_end != 0;
        udt_remember_loss(c, comm);
        return 1;
    }
    uint64_t next = c->verdict.verdicts_acked >= others && answer_wait_end < c->live.hard_deadline_ns ? answer_wait_end : c->live.hard_deadline_ns;
    if (now < c->verdict.verdict_resend_due_ns) { /* no resend is due: skip the walk over all peers */
        if (c->verdict.verdict_resend_due_ns < next)
            next = c->verdict.verdict_resend_due_ns;
        if (next < *wake)
            *wake = next;
        return progressed;
    }
    uint64_t due = UINT64_MAX;
    for (uint32_t p = 0; p < c->n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (p == c->rank)
            continue;
        struct verdict_slot *slot = slot_for(comm, p, c->sequence);
        if (((slot->flags & VERDICT_GOT) && (slot->flags & VERDICT_ACKED)) || left_after_its_verdict(c, comm, p))
            continue;
        if (now >= peer->in_call.verdict_resend_ns) {
            /* decided and holding its verdict, we only want its acknowledgement: ours goes with it.
             * Undecided, a repeated message names a verdict we lack, for the peer to pass on. */
            int acknowledging = c->verdict.decided && (slot->flags & VERDICT_GOT);
            int rc = send_request(c, comm, p, peer->in_call.verdict_attempts > 0 ? lacking_hint(c, comm, p) : 0, now);
            if (rc < 0)
                return rc;
            c->verdict.verdict_resends += peer->in_call.verdict_attempts > 0 && !c->verdict.decided;
            peer->in_call.acks_asked += c->verdict.decided;
            peer->in_call.verdict_resend_ns = now + resend_interval(c, comm, peer->in_call.verdict_attempts++, acknowledging);
            progressed = 1;
        }
        if (peer->in_call.verdict_resend_ns < due)
            due = peer->in_call.verdict_resend_ns;
    }
    c->verdict.verdict_resend_due_ns = due;
    if (due < next)
        next = due;
    if (next < *wake)
        *wake = next;
    return progressed;
}

int udt_verdict_status(struct call *c, struct udt_comm *comm)
{
    (void)comm;
    return c->verdict.status;
}
