/* Who is in the call and how long to wait: hearing a peer, the call's and each step's
 * deadlines, JOIN requests and replies, closing receive steps (on arrival, END, a sender's
 * report, silence at the step's share of the deadline), and the evidence of a closed port. */
#include "engine_internal.h"

#include <string.h>

#include "blocks.h"
#include "elementwise.h"

/* The verdict round may run past the data deadline by a bounded slack. */
void udt_set_deadlines(struct call *c, uint64_t from, double seconds)
{
    double slack_s = c->args.deadline_s / 4 < 0.05 ? 0.05 : c->args.deadline_s / 4 > 1.0 ? 1.0 : c->args.deadline_s / 4;
    c->live.deadline_ns = from + (uint64_t)(seconds * 1e9);
    c->live.hard_deadline_ns = c->live.deadline_ns + (uint64_t)(slack_s * 1e9);
}

/* A peer showed it is in this call (any valid datagram of it). When it is
 * the last one we waited for, the data deadline starts. */
void udt_hear(struct call *c, struct udt_comm *comm, uint32_t peer, uint64_t now)
{
    struct peer_state *p = &comm->peers[peer];
    p->in_call.last_heard_ns = now;
    if (p->in_call.heard || peer == c->rank)
        return;
    p->in_call.heard = 1;
    p->in_call.join_requests = 0; /* from now on requests are liveness probes, starting again at the first interval */
    p->in_call.join_request_ns = 0;
    if (++c->live.heard_count == c->n - 1 && !c->live.all_heard_ns) {
        c->live.all_heard_ns = now;
        c->stats->join_wait_s = (double)(now - c->start_ns) * 1e-9;
        udt_set_deadlines(c, now, c->args.deadline_s);
        if (c->phase == PHASE_DATA)
            udt_set_step_deadline(c, now);
    }
}

/* Intervals between requests to one peer: the first after agree_resend_us,
 * doubling up to 128x while it is silent, so a rank waiting minutes for a late one sends it a
 * few thousand 44-byte datagrams, not millions. */
#define LIVE_SENDER_ASK_DOUBLINGS 4

uint64_t udt_join_request_interval(const struct udt_comm *comm, uint32_t attempts)
{
    return udt_us(comm->options.agree_resend_us) << (attempts < 7 ? attempts : 7);
}

/* A JOIN also tells the peer how far our sending to it has come (`sent_steps`: it gets
 * nothing more of our steps below this), so a receiver whose END markers were all lost,
 * or that wonders whether a sender busy with other peers has reached its step, can ask. */
static int send_join(struct call *c, uint32_t peer, uint32_t sequence, uint32_t layout_tag, uint8_t flags, uint32_t sent_steps)
{
    struct udt_control join = {.kind = UDT_KIND_JOIN, .flags = flags, .credit = sent_steps, .sequence = sequence,
                               .layout_tag = layout_tag, .copies = 1};
    return udt_send_control(c, peer, &join);
}

static enum admission admit_join(const struct udt_wire_header *h, uint32_t bytes)
{
    if (bytes != UDT_WIRE_HEADER_BYTES || h->payload_bytes != 0 || (h->flags & ~UDT_JOIN_REPLY) || h->reserved != 0 ||
        h->phase != 0 || h->step != 0 || h->chunk_index != 0 || h->contributions != 0)
        return DROP_INVALID;
    return ADMIT;
}

/* A request is answered at once, for this call or, to a peer still in our
 * previous one, for that; a reply is never answered. The layout is not
 * checked here: a peer in the call with another layout is in the call, and
 * the verdict round names it. */
int udt_on_join(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer, uint64_t now)
{
    if (admit_join(h, bytes) != ADMIT) {
        c->stats->dropped_invalid++;
        return 0;
    }
    int request = !(h->flags & UDT_JOIN_REPLY);
    struct peer_state *p = &comm->peers[peer];
    if (h->sequence == c->sequence) {
        if (h->credit > c->schedule.steps) { /* past its last step: no sender says that */
            c->stats->dropped_invalid++;
            return 0;
        }
        udt_hear(c, comm, peer, now);
        if (h->layout_tag != c->layout_tag && c->live.mismatched_rank < 0)
            c->live.mismatched_rank = (int32_t)peer; /* it called something else: the data phase ends (see udt_call_progress) */
        if (h->credit > p->in_call.reported_sent) {
            p->in_call.reported_sent = h->credit;
            p->in_call.reported_at_ns = now;
        }
        if (!request) { /* it answers, so it is alive: while we wait on it, ask every 16 intervals at most */
            if (p->in_call.join_requests > LIVE_SENDER_ASK_DOUBLINGS)
                p->in_call.join_requests = LIVE_SENDER_ASK_DOUBLINGS;
            p->in_call.join_request_ns = now + udt_join_request_interval(comm, p->in_call.join_requests);
            return 0;
        }
        return send_join(c, peer, c->sequence, c->layout_tag, UDT_JOIN_REPLY, p->in_call.sent_steps);
    }
    if (h->sequence == c->sequence + 1) { /* it is in our next call (not taken as an acknowledgement: see on_credit) */
        p->early_join_sequence = h->sequence;
        p->early_join_valid = 1;
        udt_hear(c, comm, peer, now);
        return 0; /* we are not in that call yet: it asks again */
    }
    if (request && comm->have_last_verdict && h->sequence == comm->last_verdict_sequence)
        return send_join(c, peer, comm->last_verdict_sequence, comm->last_layout_tag, UDT_JOIN_REPLY, comm->last_steps);
    return 0;
}

static int request_join(struct call *c, struct udt_comm *comm, uint32_t peer, uint64_t now)
{
    struct peer_state *p = &comm->peers[peer];
    if (!p->in_call.join_request_ns) /* a probe: give the sender a moment to show itself first */
        p->in_call.join_request_ns = now + udt_join_request_interval(comm, 0);
    if (now < p->in_call.join_request_ns)
        return 0;
    int rc = send_join(c, peer, c->sequence, c->layout_tag, 0, p->in_call.sent_steps);
    if (rc < 0)
        return rc;
    p->in_call.join_request_ns = now + udt_join_request_interval(comm, p->in_call.join_requests++);
    return 1;
}

/* Ask every peer not yet heard from in this call whether it is in it. */
int udt_request_joins(struct call *c, struct udt_comm *comm, uint64_t now)
{
    if (c->live.all_heard_ns || now < c->live.join_request_due_ns)
        return 0;
    uint64_t due = UINT64_MAX;
    int progressed = 0;
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->rank || comm->peers[p].in_call.heard)
            continue;
        int rc = request_join(c, comm, p, now);
        if (rc < 0)
            return rc;
        progressed |= rc;
        if (comm->peers[p].in_call.join_request_ns < due)
            due = comm->peers[p].in_call.join_request_ns;
    }
    c->live.join_request_due_ns = due;
    return progressed;
}

void udt_note_peer_step(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t step, uint64_t now)
{
    struct peer_state *p = &comm->peers[peer];
    udt_hear(c, comm, peer, now);
    if (step + 1 > p->in_call.highest_step_seen)
        p->in_call.highest_step_seen = step + 1; /* a sender goes through its steps in order */
}

void udt_set_step_deadline(struct call *c, uint64_t now)
{
    uint32_t remaining = c->data.recv_step < c->schedule.steps ? c->state[c->data.recv_step].receives_after + 1 : 1;
    uint64_t left = c->live.deadline_ns > now ? c->live.deadline_ns - now : 0;
    c->live.step_deadline_ns = now + left / remaining;
    c->live.step_opened_ns = now;
}

static void close_step(struct call *c, uint32_t g)
{
    struct step_state *s = &c->state[g];
    c->stats->chunks_total += s->expected;
    c->stats->chunks_lost += s->expected - s->received;
    if (s->seen_end < s->expected) { /* the step's last chunks never came: a run of lost ones too (recent_loss.c) */
        c->data.skipped_runs++;
        c->data.skipped_chunks += s->expected - s->seen_end;
    }
    s->closed = 1;
    c->data.credits_dirty = 1;
    if ((int32_t)g == c->schedule.finalize_after)
        udt_finalize_owned_block(c);
}

void udt_close_all_steps(struct call *c)
{
    while (c->data.recv_step < c->schedule.steps) {
        struct step_state *s = &c->state[c->data.recv_step];
        if (s->expected && s->received < s->expected)
            s->announced && s->received >= s->announced ? c->stats->steps_ended++ : c->stats->steps_timed_out++;
        close_step(c, c->data.recv_step++);
    }
}

/* Since when the lowest open step g has had nothing: its last arrival, or when
 * it became the step we wait on (0: it is complete, or idle_close_us is 0). */
static uint64_t step_quiet_since(const struct call *c, uint32_t g)
{
    const struct step_state *s = &c->state[g];
    if (udt_comm_of((struct call *)c)->options.idle_close_us == 0 || s->received >= s->expected)
        return 0;
    return s->last_arrival_ns > c->live.step_opened_ns ? s->last_arrival_ns : c->live.step_opened_ns;
}

/* When a step received every chunk its sender announced (0: not yet). */
static uint64_t announced_end_ns(const struct step_state *s)
{
    return s->announced && s->received >= s->announced ? s->last_arrival_ns : 0;
}

/* The lowest open step has waited long enough to ask its sender whether it is
 * done with it: past its share of the deadline, or idle_close_us without an
 * arrival (a burst may have taken the step's last chunks and every copy of its
 * END marker: asking at the share alone left such a step waiting D / steps, a
 * second and more). Neither closes the step. Silence is no evidence that a sender is done:
 * its END markers may all be lost, but it may as well be busy with other peers
 * (direct: it serves them in turn; a late rank's senders have others' data
 * queued first), descheduled on a loaded machine, or stopped in a debugger. Its
 * answer (a JOIN reply saying how far its sending to us has come) closes the
 * step once it is done; one still sending is asked again (1 to 16 ms apart
 * while it answers); a silent one is waited for until the call's deadline.
 * Closing on silence read a busy sender as a lost step and dropped the rest of
 * its block as stale when it came: at its share, 8 ranks on a bridge with no
 * loss injected lost whole blocks in 15 of 30 calls; after a quiet gap, a sender
 * paused mid-step lost the rest of its block (4 ranks on a bridge, with a credit
 * policy that made senders pause more: 22 datagrams dropped on the wire became
 * 6,812 chunks lost; tests/test_busy_sender.py stops a sender for 0.5 s). */
static uint64_t ask_due_ns(const struct call *c, const struct udt_comm *comm)
{
    if (c->data.recv_step >= c->schedule.steps)
        return UINT64_MAX;
    uint32_t g = c->data.recv_step;
    int32_t p = c->step[g].recv_peer;
    if (p == UDT_NO_PEER || c->state[g].expected == 0 || comm->peers[p].in_call.reported_sent > g || comm->peers[p].in_call.finished)
        return UINT64_MAX;
    uint64_t due = c->live.all_heard_ns ? c->live.step_deadline_ns : UINT64_MAX;
    uint64_t quiet_since = step_quiet_since(c, g);
    if (quiet_since && quiet_since + udt_us(comm->options.idle_close_us) < due)
        due = quiet_since + udt_us(comm->options.idle_close_us);
    return due;
}

static int sender_to_ask(const struct call *c, const struct udt_comm *comm, uint64_t now) { return now >= ask_due_ns(c, comm); }

int udt_ask_waited_sender(struct call *c, struct udt_comm *comm, uint64_t now)
{
    return sender_to_ask(c, comm, now) ? request_join(c, comm, (uint32_t)c->step[c->data.recv_step].recv_peer, now) : 0;
}

/* When the sender of step g said, in a JOIN, that it sends nothing more of it (0: it did not). */
static uint64_t reported_end_ns(const struct call *c, const struct peer_state *peer, uint32_t g)
{
    return peer->in_call.reported_sent > g ? peer->in_call.reported_at_ns : 0;
}

/* Close the lowest open receive steps that are complete, ended (END marker,
 * verdict or announced count), answered (the sender's reply to a JOIN says it
 * sends nothing more of the step) or superseded. The call's deadline closes
 * the rest (udt_close_all_steps). */
int udt_close_ready_steps(struct call *c, uint64_t now)
{
    struct udt_comm *comm = udt_comm_of(c);
    const struct udt_engine_options *o = &comm->options;
    int closed = 0;
    while (c->data.recv_step < c->schedule.steps) {
        uint32_t g = c->data.recv_step;
        struct step_state *s = &c->state[g];
        int32_t p = c->step[g].recv_peer;
        int empty = p == UDT_NO_PEER || s->expected == 0;
        int complete = s->received >= s->expected;
        struct peer_state *peer = empty ? NULL : &comm->peers[p];
        /* a relay that announced fewer chunks than the block has ends like an END marker:
         * after the reorder grace, in which a larger announcement (the real one) may come */
        uint64_t announced_at = announced_end_ns(s), reported_at = empty ? 0 : reported_end_ns(c, peer, g);
        int ended = !empty && ((s->end_seen_ns && now - s->end_seen_ns >= udt_us(o->reorder_grace_us)) ||
                               (announced_at && now - announced_at >= udt_us(o->reorder_grace_us)) ||
                               (peer->in_call.finished && now - peer->in_call.finished_at_ns >= udt_us(o->reorder_grace_us)));
        int answered = reported_at && now - reported_at >= udt_us(o->reorder_grace_us);
        /* the sender already sends us a later step: all of this one that will come, came */
        int superseded = !empty && peer->in_call.highest_step_seen > g + 1;
        if (!empty && !complete && !ended && !answered && !superseded)
            break;
        if (!empty && !complete)
            ended ? c->stats->steps_ended++ : answered ? c->stats->steps_answered++ : c->stats->steps_superseded++;
        close_step(c, g);
        c->data.recv_step++;
        udt_set_step_deadline(c, now);
        closed = 1;
    }
    return closed;
}

/* Earliest time something is due in the data phase. */
uint64_t udt_data_wake(const struct call *c, const struct udt_comm *comm, uint64_t now)
{
    uint64_t wake = c->live.deadline_ns;
    if (!c->live.all_heard_ns && c->live.join_request_due_ns < wake)
        wake = c->live.join_request_due_ns;
    if (c->data.recv_step >= c->schedule.steps)
        return wake;
    const struct step_state *s = &c->state[c->data.recv_step];
    int32_t p = c->step[c->data.recv_step].recv_peer;
    /* one rule, one place: the sleep and the asking use the same due time */
    uint64_t ask_due = ask_due_ns(c, comm);
    uint64_t due = now >= ask_due ? comm->peers[p].in_call.join_request_ns : ask_due;
    if (due < wake)
        wake = due;
    /* A credit goes out no sooner than the next walk (grant_credits waits a refresh interval
     * between walks unless an arrival moved something, which wakes us anyway). A sender the
     * last walk left without credit (the window went to earlier steps) has an old or no grant
     * time: counting from that alone put the wake in the past, and the loop spun until the
     * earlier step closed (a 16-chunk window, 4 ranks, direct: 100,000+ empty passes a call). */
    for (uint32_t g = c->data.recv_step; g < c->schedule.steps && g < c->data.recv_step + CREDIT_LOOKAHEAD_STEPS; g++) {
        int32_t q = c->step[g].recv_peer;
        if (q == UDT_NO_PEER || c->state[g].closed)
            continue;
        uint64_t since = comm->peers[q].in_call.granted_at_ns > c->data.credits_walked_ns ? comm->peers[q].in_call.granted_at_ns : c->data.credits_walked_ns;
        uint64_t refresh = since + udt_us(comm->options.credit_refresh_us);
        if (refresh < wake)
            wake = refresh;
    }
    uint64_t grace = udt_us(comm->options.reorder_grace_us);
    if (s->end_seen_ns && s->end_seen_ns + grace < wake)
        wake = s->end_seen_ns + grace;
    if (announced_end_ns(s) && announced_end_ns(s) + grace < wake)
        wake = announced_end_ns(s) + grace;
    if (p != UDT_NO_PEER && comm->peers[p].in_call.finished && comm->peers[p].in_call.finished_at_ns + grace < wake)
        wake = comm->peers[p].in_call.finished_at_ns + grace;
    uint64_t reported_at = p != UDT_NO_PEER ? reported_end_ns(c, &comm->peers[p], c->data.recv_step) : 0;
    if (reported_at && reported_at + grace < wake)
        wake = reported_at + grace;
    return wake;
}

/* Tell the transport what our datagrams carry (the session id, which no stranger knows), so
 * that an ICMP message quoting a datagram without it is dropped, not counted (transport.h). */
void udt_mark_quotes(struct udt_comm *comm)
{
    struct udt_peer_ports *ports = comm->transport->ports;
    if (!ports || ports->quote_bytes)
        return;
    ports->quote_offset = 8; /* udt_wire_encode: the session id */
    udt_put64(ports->quote, comm->session_id);
    ports->quote_bytes = 8;
}

void udt_note_port_closed(struct call *c, struct udt_comm *comm, uint32_t peer)
{
    if (peer >= c->n || peer == c->rank || comm->peers[peer].in_call.port_closed)
        return;
    comm->peers[peer].in_call.port_closed = 1;
    c->live.ports_closed++;
}

/* An ICMP port unreachable quoting one of our datagrams to a peer says its socket was closed
 * when the datagram got there. Evidence, not a verdict, and for this call only: a port briefly
 * closed (a NAT or firewall reset), or a bounce of the call before, is forgotten when the peer
 * speaks again, and a peer whose verdict we hold has only left. Otherwise what it owed us will
 * not come: the data phase ends and our verdict names it (CAUSE_PORT_CLOSED), so every rank
 * fails the call with the same cause, and peers holding that verdict stop waiting for the
 * closed port's own (udt_verdict_progress). The forged ICMP of issue 38 no longer reaches
 * here: it cannot quote our session id. */
void udt_notice_bounces(struct call *c, struct udt_comm *comm, uint64_t now)
{
    const struct udt_peer_ports *ports = comm->transport->ports;
    if (!ports || ports->bounce_count == comm->bounces_seen)
        return;
    comm->bounces_seen = ports->bounce_count;
    uint32_t n = ports->peer_count < comm->world_size ? ports->peer_count : comm->world_size;
    for (uint32_t p = 0; p < n; p++) {
        struct peer_state *peer = &comm->peers[p];
        if (ports->bounces[p] == peer->bounces_seen || p == comm->rank)
            continue;
        peer->bounces_seen = ports->bounces[p];
        peer->bounced_ns = now;
        if (peer->alive_ns < now && !(peer->slot[c->sequence & 1].sequence == c->sequence &&
                                      (peer->slot[c->sequence & 1].flags & VERDICT_GOT)))
            udt_note_port_closed(c, comm, p);
    }
}
