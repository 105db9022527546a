/* State shared by the engine's rooms. Not part of the public interface. Each room owns one
 * concern, and depends only on the rooms listed before it here (no circle):
 *   pieces.c    an all_to_all whose pieces each have their own size: geometry, share, checksum
 *   recent_loss.c  what the network lost lately toward this rank, and how long rounds waited
 *   control.c   the headers and the one sender of control datagrams
 *   output.c    the caller's buffers: originals saved and put back, rescaling, write-out
 *   liveness.c  who is in the call, deadlines, JOIN, closing receive steps, closed ports
 *   data.c      credits (as many copies as recent loss asks), sending, admitting data
 *   verdict.c   the verdict round: one outcome on every rank
 *   call.c      a call's life: refusal, preparing, the progress loop, finishing
 *   comm.c      the communicator
 * The schedule (schedule.c) says what the collective is (struct udt_collective_facts). */
#ifndef UDT_ENGINE_INTERNAL_H
#define UDT_ENGINE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "wire.h"

#ifndef SEND_BATCH /* -DSEND_BATCH=N to measure other batch sizes */
#define SEND_BATCH 32
#endif
#define RECV_BATCH 16
#define SAVE_AHEAD_BYTES 65536u /* in place: originals saved in one copy at most this long (save_original) */
#define UNCACHED_MIN_BYTES 4096u /* shorter copies store through the cache (a partial line streamed costs more) */
#define LATE_DRAIN_BATCHES 1024
/* credits (data.c; the data phase wakes for them, liveness.c) are handed out at most this many receive steps ahead (the window
 * usually runs out first) */
#define CREDIT_LOOKAHEAD_STEPS 64 /* past the hard deadline: batches read before deciding (udt_call_progress) */

/* per-chunk flags */
#define SCRATCH_VALID 1u /* the accumulator holds this chunk's current value; else the caller's input does */
#define ORIGINAL_SAVED 2u /* in place: the chunk's original input is saved in the scratch */

enum call_phase { PHASE_IDLE = 0, PHASE_DATA = 1, PHASE_VERDICT = 2, PHASE_DONE = 3 };

/* verdict causes, by severity (the worst one on any rank wins) */
enum { CAUSE_NONE = 0, CAUSE_PEER_TIMEOUT = 1, CAUSE_LAYOUT = 2, CAUSE_TRANSPORT = 3 };
#define CAUSE_WORD(severity, rank) (((uint32_t)(severity) << 16) | (uint32_t)(rank))
/* Beside a PEER_TIMEOUT's rank: the rank's port was seen closed (a datagram to it came back as
 * an ICMP port unreachable quoting this session), so peers need not wait for its verdict. It
 * never decides which cause wins (udt_cause_max): world sizes stay below this bit. */
#define CAUSE_PORT_CLOSED 0x8000u
#define CAUSE_SEVERITY(word) ((word) >> 16)
#define CAUSE_RANK(word) ((word) & 0x7FFFu)
static inline uint32_t udt_cause_max(uint32_t a, uint32_t b)
{
    uint32_t a_key = a & ~CAUSE_PORT_CLOSED, b_key = b & ~CAUSE_PORT_CLOSED;
    return a_key > b_key ? a : b_key > a_key ? b : a | b;
}

/* what a peer told us in the verdict round, kept per call parity so a
 * peer one call ahead does not overwrite the current call's message */
#define VERDICT_GOT 1u
#define VERDICT_ACKED 2u
struct verdict_slot {
    uint32_t sequence;
    uint8_t flags;
    uint32_t layout_tag;
    uint8_t payload[UDT_VERDICT_BYTES];
};

/* A peer as this rank sees it during one call: reset whole when a call starts. */
struct peer_in_call {
    /* credits (data.c) */
    uint32_t credit_limit;   /* we may send it positions below this */
    uint32_t credit_ceiling; /* end of our last send step to it: no valid credit is higher */
    uint32_t chunks_queued;  /* chunks handed to the transport for it */
    uint32_t credit_base;    /* chunks_queued when its last credit came: a credit covers at most a window more */
    uint32_t granted;        /* the last credit we sent it */
    uint32_t arrived_since_grant; /* its data that came since that credit (see udt_regrant) */
    uint64_t granted_at_ns;
    /* how far the steps between us have come (liveness.c) */
    uint32_t highest_step_seen; /* +1, of data or END it sent us */
    uint32_t sent_steps;        /* ours to it: it gets nothing more of our steps below this (JOIN carries it) */
    uint32_t reported_sent;     /* its to us, as its last JOIN said: nothing more comes of steps below this */
    uint64_t reported_at_ns;    /* when that report last moved */
    /* whether it is in the call and alive (liveness.c) */
    uint8_t heard;              /* anything valid from it during this call: it is in the call */
    uint8_t port_closed;        /* its port was seen closed, by us or by a peer whose verdict says so */
    uint64_t last_heard_ns;
    uint64_t join_request_ns;   /* when to ask it again whether it is in the call */
    uint32_t join_requests;     /* asked so far (the interval doubles) */
    /* the verdict round (verdict.c) */
    uint8_t finished;           /* its verdict came: it sends us nothing more */
    uint64_t finished_at_ns;
    uint32_t verdict_attempts;
    uint32_t acks_asked;        /* copies of our verdict sent to it since we decided, its acknowledgement missing */
    uint64_t verdict_resend_ns;
    uint64_t verdict_sent_ns;   /* when our verdict last went to it (a request; answers are not counted) */
    uint8_t ours_sent;          /* our verdict went to it in some message of this call */
    uint64_t ours_first_sent_ns; /* when it first did */
    uint8_t acked_once;         /* our acknowledgement went to it only in single copies so far (see decide) */
};

struct peer_state {
    struct peer_in_call in_call;
    /* scratch of udt_grant_credits and udt_send_some, stamped with the communicator's epochs */
    uint32_t wanted;
    uint32_t taken;             /* of the walk's window, what this sender's steps took */
    uint8_t wanted_ends_step;   /* `wanted` is the end of a step: nothing more of it to credit */
    uint32_t wanted_epoch;
    uint32_t send_blocked_epoch;
    /* kept between calls */
    uint64_t alive_ns;          /* the last datagram of this session from it, of any call */
    uint64_t bounced_ns;        /* the last ICMP port unreachable quoting our datagram to it */
    uint32_t bounces_seen;      /* the transport's count for it when we last looked */
    uint32_t early_credit_sequence, early_credit, early_credit_layout;
    uint8_t early_credit_valid; /* sequence numbers wrap: 0 is a call like any other, not "none" */
    uint32_t early_join_sequence; /* it said it is in this (our next) call */
    uint8_t early_join_valid;
    struct verdict_slot slot[2];
};

struct step_state {
    uint32_t expected;   /* chunks of the block it receives (0: receives nothing) */
    uint32_t received;
    uint32_t announced;  /* chunks the sender said it sends; 0 = not yet known */
    uint32_t seen_end;   /* one past the highest chunk index received */
    uint32_t receives_after; /* receiving steps after this one */
    uint8_t closed;
    uint8_t relayed;     /* a later step sends the block this one receives (a ring's gather) */
    /* sending side of the step */
    uint8_t send_done, send_counted;
    uint32_t sent_chunk;     /* next chunk to hand out */
    uint32_t send_announced; /* chunks we send in it */
    uint64_t end_seen_ns;
    uint64_t last_arrival_ns;
};

/* The data phase's state in a call (data.c). */
struct call_data {
    uint32_t recv_step;          /* lowest receive step not yet closed */
    uint32_t send_step;          /* lowest step whose sending is not done */
    uint32_t window_chunks;
    uint32_t copies;             /* of each data datagram we send (args.copies, at least 1) */
    int regrant_due;             /* a peer's arrivals used a quarter window without a credit back: credit it again */
    int credits_dirty;           /* something changed that may move a credit */
    uint64_t credits_walked_ns;
    /* chunks a sender skipped in a step (lost, or rarely reordered), as runs: recent_loss.c */
    uint32_t skipped_runs, skipped_chunks;
};

/* Who is in the call and how long to wait (liveness.c). */
struct call_liveness {
    uint64_t deadline_ns, hard_deadline_ns; /* the data phase's; the verdict round's, a bounded slack later */
    uint64_t step_deadline_ns;
    uint64_t step_opened_ns;     /* when recv_step became the step we wait on (or everyone was heard) */
    uint32_t heard_count;        /* peers known to be in this call */
    uint64_t all_heard_ns;       /* when the last of them was: the data deadline counts from here (0: not yet) */
    uint64_t join_request_due_ns; /* the earliest JOIN request due to any peer */
    uint32_t ports_closed;       /* peers with port_closed set this call: the data phase is over */
    uint8_t doomed;              /* a peer's verdict carries a cause: the call fails whatever else arrives */
    int32_t mismatched_rank;     /* a peer that called with another layout (-1: none) */
};

/* The verdict round (verdict.c). */
struct call_verdict {
    uint8_t my_verdict[UDT_VERDICT_BYTES];
    uint32_t verdicts_got, verdicts_acked;
    uint64_t verdict_started_ns, decided_ns;
    uint64_t answered_ns;        /* when we last answered a peer's verdict message or acknowledged at deciding */
    uint32_t verdict_resends;    /* verdict messages sent again before deciding, for want of a peer's */
    uint32_t verdicts_late;      /* verdicts that came first in a copy marked AGAIN: the first copy was lost */
    uint32_t ack_copies;         /* copies of our acknowledgement at deciding (udt_answer_copies) */
    uint8_t ours_missing;        /* a copy of ours found the socket full, or a peer asked again for what we sent it an
                                  * interval before: it was lost */
    uint64_t verdict_resend_due_ns; /* the earliest resend due to any peer */
    uint32_t hint_next;          /* where the next search for a verdict we lack starts (lacking_hint) */
    uint64_t closed_asked_ns;    /* when we first asked the open peers for the verdicts of closed ports (0: not yet) */
    uint64_t closed_next_ask_ns; /* when to ask them again */
    int decided;
    uint32_t status;             /* decided status */
};

/* Where each element and chunk of the call lives (set once in call.c's prepare, read by every room). */
struct call_geometry {
    size_t wire_bytes, accum_bytes;
    uint64_t chunk_elements;
    uint32_t max_chunks;         /* at least any block's chunks, the same on every rank: positions are step * max_chunks + chunk */
    uint64_t *chunk_base;        /* n + 1: first chunk id of each block */
    uint64_t *block_first;       /* n + 1: first element of each block (and the end) */
    uint64_t *send_first;        /* n + 1: of the input's blocks, which a sized all_to_all cuts apart (else block_first) */
    size_t bitmap_bytes;         /* per step */
};

/* What is known of each chunk: counted by data.c as it arrives, read by the verdict and output. */
struct call_chunks {
    uint8_t *arrival_bits;       /* per step, one bit per chunk */
    uint16_t *rs_count;          /* contributions summed in a chunk (reduce half) */
    uint16_t *final_count;       /* contributions in the fresh value of a chunk, 0 = not fresh */
    uint8_t *chunk_flags;
};

/* Where the result is built and how it reaches the caller's tensor (output.c). */
struct call_output {
    uint8_t *accum;              /* the scratch, or in place the caller's tensor itself */
    uint8_t direct_output;       /* a gather that writes into the output as chunks arrive (args.direct_output) */
    uint8_t in_place;            /* an allreduce whose input is its output: the tensor accumulates, each
                                  * chunk's original saved in the scratch before its first write */
    uint8_t *saved;              /* in place: the originals (the scratch) */
    uint8_t final_uncached;      /* the output is the caller's and too large for the cache: final values
                                  * no later step sends go there with stores that bypass it */
    uint8_t *rank_rows;          /* reduce_in_rank_order: a row of our block per peer (udt_rank_row) */
};

/* One call; call.c's start zeroes it whole, so every room's state begins at zero. */
struct call {
    int phase;
    struct udt_collective_args args;
    struct udt_collective_stats *stats;
    struct udt_schedule schedule;
    struct udt_step *step;       /* schedule.steps entries */
    struct step_state *state;    /* one per step */
    uint32_t rank, n, sequence, layout_tag;
    uint64_t start_ns;
    uint64_t verdict_ns;         /* when the verdict was in (udt_collective_settle counts the output from there) */
    struct call_geometry geometry;
    struct call_chunks chunks;
    struct call_output output;   /* output.c */
    struct call_data data;       /* data.c */
    struct call_liveness live;   /* liveness.c */
    struct call_verdict verdict; /* verdict.c */
    /* the transport's counters when the call started (they run across calls) */
    uint64_t drops_before;
    uint64_t overflows_before;   /* receive-overflow drops */
    uint64_t send_calls_before, receive_calls_before; /* system calls */
};

struct udt_comm {
    struct udt_transport *transport;
    uint32_t rank, world_size;
    uint64_t session_id;
    uint32_t sequence; /* of the last call started */
    int interrupted;   /* udt_comm_interrupt: set from another thread, read atomically */
    udt_wait_hook wait_hook; /* udt_comm_set_wait_hook: set between calls */
    void *wait_hook_arg;
    uint32_t send_epoch, credit_epoch;
    struct udt_engine_options options;
    struct peer_state *peers;
    uint32_t bounces_seen;       /* the transport's bounce_count when we last looked */
    /* our own verdict of the previous call, to answer peers still in it */
    uint32_t last_verdict_sequence;
    uint8_t have_last_verdict;
    uint32_t last_layout_tag;
    uint32_t last_steps;         /* of that call: a JOIN answered for it says all of them are sent */
    uint8_t last_verdict[UDT_VERDICT_BYTES];
    /* recent calls' data chunks and verdicts expected and lost, and the lost chunks in runs (recent_loss.c) */
    double recent_chunks_seen, recent_chunks_lost, recent_skipped_runs, recent_skipped_chunks;
    /* how long clean verdict rounds waited for their last verdict, smoothed, and its spread (recent_loss.c) */
    double round_wait_ns, round_wait_spread_ns;
    uint32_t round_samples;
    /* buffers kept between calls so a steady workload allocates nothing */
    uint8_t *scratch;
    size_t scratch_bytes;
    uint8_t *chunk_state;
    size_t chunk_state_bytes;
    uint8_t *step_memory;
    size_t step_memory_bytes;
    uint64_t *geometry;      /* chunk_base, block_first and send_first */
    uint32_t *block_scratch; /* for the schedule builder */
    uint8_t *rank_rows;      /* the contributions a reduction in rank order keeps apart */
    size_t rank_rows_bytes;
    uint8_t *staging;
    uint8_t headers[SEND_BATCH + 8][UDT_WIRE_HEADER_BYTES];
    struct call call;
    struct udt_error error;
};

/* ---- geometry of the call, read by every room ---- */

static inline uint64_t udt_us(uint32_t microseconds) { return (uint64_t)microseconds * 1000ull; }

static inline struct udt_comm *udt_comm_of(struct call *c)
{
    return (struct udt_comm *)((uint8_t *)c - offsetof(struct udt_comm, call));
}

static inline uint32_t chunks_in_block(const struct call *c, uint32_t block)
{
    return (uint32_t)(c->geometry.chunk_base[block + 1] - c->geometry.chunk_base[block]);
}

/* Whether `block` is part of this rank's result (enum udt_wants): every block, but only its own
 * in a scatter and in a gather off its root. */
static inline int wants_block(const struct call *c, uint32_t block)
{
    switch (c->schedule.facts->wants) {
    case UDT_WANTS_OWN_BLOCK:
        return block == c->schedule.owned_block;
    case UDT_WANTS_ALL_AT_ROOT:
        return c->rank == c->args.root || block == c->schedule.owned_block;
    default:
        return 1;
    }
}

static inline uint64_t chunk_first_element(const struct call *c, uint32_t block, uint32_t chunk)
{
    return c->geometry.block_first[block] + (uint64_t)chunk * c->geometry.chunk_elements;
}

static inline uint64_t chunk_length(const struct call *c, uint32_t block, uint32_t chunk)
{
    uint64_t first = chunk_first_element(c, block, chunk), end = c->geometry.block_first[block + 1];
    return end - first < c->geometry.chunk_elements ? end - first : c->geometry.chunk_elements;
}

/* The same of what this rank sends from `block` (a sized all_to_all's piece for that rank). */
static inline uint32_t send_chunks(const struct call *c, uint32_t block)
{
    uint64_t length = c->geometry.send_first[block + 1] - c->geometry.send_first[block];
    return (uint32_t)((length + c->geometry.chunk_elements - 1) / c->geometry.chunk_elements);
}

static inline uint64_t send_first_element(const struct call *c, uint32_t block, uint32_t chunk)
{
    return c->geometry.send_first[block] + (uint64_t)chunk * c->geometry.chunk_elements;
}

static inline uint64_t send_chunk_length(const struct call *c, uint32_t block, uint32_t chunk)
{
    uint64_t first = send_first_element(c, block, chunk), end = c->geometry.send_first[block + 1];
    return end - first < c->geometry.chunk_elements ? end - first : c->geometry.chunk_elements;
}

/* reduce_in_rank_order: where peer p's contribution to element `offset` of our block is kept
 * (rows of the largest block, one per peer: ours is the input itself). */
static inline uint8_t *udt_rank_row(const struct call *c, uint32_t p, uint64_t offset)
{
    uint64_t row = p < c->rank ? p : p - 1, row_elements = (c->args.count + c->n - 1) / c->n;
    return c->output.rank_rows + (row * row_elements + offset) * c->geometry.wire_bytes;
}

/* The caller's input for an element: when the input is a shard (all_gather), only ours. */
static inline const uint8_t *input_at(const struct call *c, uint64_t element)
{
    uint64_t offset = c->schedule.facts->input_is_shard ? element - c->geometry.block_first[c->rank] : element;
    return (const uint8_t *)c->args.input + offset * c->geometry.wire_bytes;
}

/* What the verdict's fresh_elements count in: elements of the tensor, or where ranks' outputs
 * differ in size (a sized all_to_all) a share of UDT_PIECES_SHARE_ONE. */
#define UDT_PIECES_SHARE_ONE (1ull << 62)
static inline uint64_t udt_fresh_scale(const struct call *c)
{
    return c->args.piece_counts ? UDT_PIECES_SHARE_ONE : c->args.count;
}

/* What becomes of a datagram that arrives (data.c, liveness.c) */
enum admission {
    ADMIT = 0,
    DROP_INVALID,
    DROP_STALE,
    DROP_CLOSED, /* a well-formed chunk of this call for a step we closed */
    DROP_DUPLICATE,
    DROP_EARLY,
    DROP_MISMATCH,
    DROP_QUIET, /* not counted: an old credit, an extra END copy */
};

/* pieces.c */
const char *udt_pieces_refusal(const struct udt_comm *comm, const struct udt_collective_args *a);
uint64_t udt_pieces_input_count(const struct udt_collective_args *a, uint32_t world_size);
uint32_t udt_pieces_stride(uint32_t steps);
uint64_t udt_pieces_geometry(struct call *c);
uint64_t udt_pieces_checksum(const struct call *c);

/* recent_loss.c */
int udt_call_showed_loss(const struct call *c, const struct udt_comm *comm);
int udt_answers_at_risk(const struct call *c, const struct udt_comm *comm, int call_lossy);
uint32_t udt_answer_copies(const struct call *c, const struct udt_comm *comm, int call_lossy);
uint32_t udt_credit_copies(const struct call *c, const struct udt_comm *comm, uint32_t most);
uint32_t udt_end_copies(const struct call *c, const struct udt_comm *comm, uint32_t step);
void udt_remember_loss(const struct call *c, struct udt_comm *comm);
uint64_t udt_verdict_resend_base_ns(const struct call *c, const struct udt_comm *comm);

/* control.c */
/* A control datagram: a header of its kind and, for a verdict, its payload. */
struct udt_control {
    uint8_t kind;             /* UDT_KIND_END, _CREDIT, _JOIN or _AGREE */
    uint8_t flags;            /* JOIN: UDT_JOIN_REPLY; verdict: UDT_AGREE_* */
    uint32_t step;            /* END: the step it ends */
    uint32_t credit;          /* CREDIT: the position granted; JOIN: steps sent to the peer */
    uint32_t sequence;        /* the call it is about: a JOIN or verdict may answer the previous one */
    uint32_t layout_tag;
    uint32_t chunk_index;     /* verdict: the rank whose verdict we lack + 1, or a relay's original rank */
    const uint8_t *payload;   /* a verdict's UDT_VERDICT_BYTES, or NULL */
    int copies;               /* 1 to UDT_MAX_END_REPEATS */
};
/* A control datagram about the current call, one copy. */
static inline struct udt_control udt_control_of(const struct call *c, uint8_t kind)
{
    return (struct udt_control){.kind = kind, .sequence = c->sequence, .layout_tag = c->layout_tag, .copies = 1};
}
void udt_fill_header(struct call *c, struct udt_wire_header *h, uint8_t kind, uint32_t step);
int udt_send_control(struct call *c, uint32_t peer, const struct udt_control *m);

/* output.c */
void udt_save_original(struct call *c, uint32_t block, uint32_t chunk);
void udt_restore_originals(struct call *c);
void udt_finalize_owned_block(struct call *c);
uint64_t udt_fresh_elements(const struct call *c);
uint64_t udt_reduce_weighted(const struct call *c);
double udt_delivered_fraction(const struct call *c);
int udt_write_output(struct call *c);

/* liveness.c */
void udt_set_deadlines(struct call *c, uint64_t from, double seconds);
void udt_set_step_deadline(struct call *c, uint64_t now);
void udt_hear(struct call *c, struct udt_comm *comm, uint32_t peer, uint64_t now);
void udt_note_peer_step(struct call *c, struct udt_comm *comm, uint32_t peer, uint32_t step, uint64_t now);
uint64_t udt_join_request_interval(const struct udt_comm *comm, uint32_t attempts);
int udt_on_join(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer, uint64_t now);
int udt_request_joins(struct call *c, struct udt_comm *comm, uint64_t now);
int udt_ask_waited_sender(struct call *c, struct udt_comm *comm, uint64_t now);
int udt_close_ready_steps(struct call *c, uint64_t now);
void udt_close_all_steps(struct call *c);
uint64_t udt_data_wake(const struct call *c, const struct udt_comm *comm, uint64_t now);
void udt_mark_quotes(struct udt_comm *comm);
void udt_note_port_closed(struct call *c, struct udt_comm *comm, uint32_t peer);
void udt_notice_bounces(struct call *c, struct udt_comm *comm, uint64_t now);

/* data.c */
int udt_grant_credits(struct call *c, uint64_t now, int force);
int udt_regrant(struct call *c, uint64_t now);
int udt_send_some(struct call *c);
void udt_on_credit(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, uint32_t bytes, uint32_t peer,
                   uint64_t now);
void udt_on_data(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, const uint8_t *payload,
                 uint32_t bytes, uint32_t peer, uint64_t now);

/* verdict.c */
void udt_verdict_begin_peers(struct call *c, struct udt_comm *comm, uint64_t now);
void udt_verdict_begin(struct call *c, struct udt_comm *comm, uint64_t now);
int udt_verdict_progress(struct call *c, struct udt_comm *comm, uint64_t now, uint64_t *wake);
void udt_verdict_receive(struct call *c, struct udt_comm *comm, const struct udt_wire_header *h, const uint8_t *payload,
                         uint32_t payload_bytes, uint32_t peer, uint64_t now);
int udt_verdict_status(struct call *c, struct udt_comm *comm);

#endif
