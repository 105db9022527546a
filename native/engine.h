/* The collective engine: executes a schedule (schedule.h) over any
 * udt_transport, chunk by chunk, never retransmitting data, then runs a
 * verdict round so every rank returns the same outcome. Called with the GIL
 * released; touches only C memory.
 *
 * Two ways to drive a call: udt_collective() runs it to the end (sleeping on
 * the transport when idle); udt_call_start / udt_call_progress /
 * udt_call_finish let one thread step many engines on a virtual clock (the
 * simulator does this). */
#ifndef UDT_ENGINE_H
#define UDT_ENGINE_H

#include <stdint.h>

#include "schedule.h"
#include "transport.h"

#define UDT_MAX_WORLD 4096
#define UDT_MAX_END_REPEATS 8 /* copies of an END marker one send batch holds */
#define UDT_MAX_COPIES 4      /* copies of each data datagram a call may send */

enum udt_status {
    UDT_OK = 0,
    UDT_ERR_LOSS_BUDGET = 1,    /* more missing than the budget allows; output untouched */
    UDT_ERR_PEER_TIMEOUT = 2,   /* a rank did not join the call in time, or went silent in it; output untouched */
    UDT_ERR_INVALID_ARGUMENT = 3,
    UDT_ERR_TRANSPORT = 4,
    UDT_ERR_NO_MEMORY = 5,
    UDT_ERR_LAYOUT_MISMATCH = 6, /* a rank called with another collective, size, dtype, op or root */
    UDT_ERR_CANCELLED = 7,       /* inside udt_collective_striped only: another stripe ended the call */
    UDT_ERR_INTERRUPTED = 8,     /* udt_comm_interrupt was called: the call ended where it was; output untouched */
};

enum udt_op { UDT_OP_SUM = 0, UDT_OP_MEAN = 1 };

/* How a missing contribution is treated. UNBIASED is the product; ZERO_FILL
 * (no rescaling, zeros in holes, as OptiReduce does) exists as a baseline
 * and as the negative control of the unbiasedness test. */
enum udt_estimator { UDT_ESTIMATOR_UNBIASED = 0, UDT_ESTIMATOR_ZERO_FILL = 1 };

struct udt_engine_options {
    uint32_t chunk_bytes;       /* payload bytes per datagram, at most transport max - header */
    uint32_t window_bytes;      /* data all peers together may have in flight to us */
    uint32_t end_repeats;       /* copies of each END marker (they can be lost too) */
    uint32_t credit_refresh_us; /* resend our credit this often while waiting */
    uint32_t reorder_grace_us;  /* after an END, wait this long for stragglers */
    uint32_t busy_poll_us;      /* spin this long for the next datagram before sleeping */
    uint32_t idle_close_us;     /* an incomplete step asks its sender after this long without arrivals (0 = only at its share) */
    uint32_t agree_resend_us;   /* first resend interval of verdict messages (doubles, up to 16x) */
    uint32_t join_timeout_ms;  /* how long a call waits for every rank to join it before blaming the absent */
    uint64_t in_place_min_bytes; /* an allreduce this large or larger sums in the caller's tensor (0: every one) */
};

struct udt_collective_args {
    int collective;  /* enum udt_collective */
    int algorithm;   /* enum udt_algorithm */
    const void *input;  /* allreduce, broadcast: the tensor; reduce_scatter: the full tensor; all_gather: this rank's shard;
                         * all_to_all: world_size equal blocks, block q for rank q (only read) */
    void *output;       /* allreduce, broadcast: the tensor; reduce_scatter: this rank's shard; all_gather: the full tensor;
                         * all_to_all: block p from rank p (may be the input, unless direct_output) */
    uint64_t count;     /* elements of the full tensor (all_to_all: a multiple of world_size) */
    int dtype;
    int op;
    int estimator;
    uint32_t root;         /* broadcast */
    uint32_t agree_value;  /* combined by max over ranks; the result is in stats.agreed_value */
    double loss_budget;
    double deadline_s;
    /* Optional (NULL: none), written on success only, one byte per entry:
     *  reduce_scatter: world_size rows of this rank's shard's chunks; row p, chunk k is 1
     *    when rank p's contribution to chunk k is in the result (direct schedule, or two
     *    ranks: where each contribution travels alone and its arrival names its sender);
     *  all_gather, broadcast, allreduce, all_to_all: every chunk of the tensor (the output), 1 when fresh.
     * chunk_mask_bytes must be exactly that size (udt_chunk_mask_bytes gives it). */
    uint8_t *chunk_mask;
    uint64_t chunk_mask_bytes;
    /* Each data datagram goes out this many times (0 or 1: once), the copies after the
     * whole step, so a chunk is lost only if every copy is: forward redundancy at
     * `copies` times the bytes, never a retransmission. Receivers keep the first copy. */
    uint32_t copies;
    /* all_gather, broadcast, all_to_all: nonzero writes what arrives straight into the output instead of
     * the scratch and a copy at the end, so a call that fails may leave the output partly
     * written: only for a caller that keeps its own copy to put back (ud_transport.exact). */
    uint32_t direct_output;
    /* Folded into the layout every rank must share (0: nothing folded): ud_transport.exact moves
     * any dtype as 32-bit words and passes the byte count here, so that two sizes padded to the
     * same words are a layout mismatch instead of a copy that cuts or pads. */
    uint32_t layout_salt;
    /* Nonzero: a call that misses its loss budget (udt_budget_missed) still writes its estimate
     * and returns UDT_OK with stats.budget_missed set, for callers that apply their own policy to
     * a miss (the torch layer's on_budget_miss). Part of the layout every rank must share. */
    uint32_t write_on_budget_miss;
    /* Nonzero (allreduce or reduce_scatter, direct algorithm, float32 or float64, sum or mean, loss
     * budget 0, not with write_on_budget_miss): the owner keeps each rank's contribution to its
     * block apart and reduces them in rank order in double precision, dividing a mean before it
     * rounds once to the caller's type. These are the bits ud_transport.exact's own forms give, so
     * one such call can go first and they can follow where it fails. Part of the layout every
     * rank must share. */
    uint32_t reduce_in_rank_order;
    /* all_to_all only (NULL: world_size equal blocks): 2 * world_size element counts, what this
     * rank sends each rank ([0, n): the input's pieces, back to back) and what it takes from each
     * ([n, 2n): the output's, count their sum; its own piece is copied from the input, and one
     * of two sizes is a disagreement). Each rank knows only its own; the verdict carries
     * a checksum of every rank's (pieces.c), so that where what one rank sends another is not
     * what that rank expects, every rank fails with UDT_ERR_LAYOUT_MISMATCH. */
    const uint64_t *piece_counts;
};

/* The loss budget's rule, its one home: a call misses `loss_budget` when more than that share
 * of contributions is missing at their owners or of some rank's result is stale (the agreed
 * fractions of struct udt_collective_stats). The verdict, the simulator and the Python layer
 * (_native.budget_missed) all ask this. */
static inline int udt_budget_missed(double reduce_fraction, double gather_fraction, double loss_budget)
{
    /* a budget of 0 has no tolerance: with 1e12 contributions, 1e-12 would let one go missing from
     * a call that claims to be exact (the fractions are quotients of integers below 2^53, so below
     * 1.0 exactly when something lacks) */
    if (loss_budget <= 0)
        return reduce_fraction < 1.0 || gather_fraction < 1.0;
    return 1.0 - reduce_fraction > loss_budget + 1e-12 || 1.0 - gather_fraction > loss_budget + 1e-12;
}

struct udt_collective_stats {
    double delivered_fraction; /* share of all ranks' contributions present in this rank's result */
    double reduce_fraction;    /* agreed: share of all contributions that reached their shard's owner (1 without a reduce half) */
    double gather_fraction;    /* agreed: the least share of fresh elements in any rank's output (1 without a gather half) */
    double own_reduce_fraction; /* this rank's shard only */
    double own_gather_fraction; /* this rank's output only */
    uint64_t chunks_total;     /* chunks this rank expected to receive */
    uint64_t chunks_lost;      /* of those, never arrived in time */
    uint64_t chunks_stale;     /* chunks of this rank's output that kept their old value (or were filled) */
    uint64_t datagrams_sent;
    uint64_t payload_bytes_sent; /* data payloads the transport took (every copy), headers not counted */
    uint64_t datagrams_received; /* valid data datagrams used */
    uint64_t dropped_stale;      /* for an earlier call or a step already closed */
    uint64_t dropped_duplicate;
    uint64_t redundant_copies;   /* copies > 1: later copies of chunks already received (kept out of the drop counts) */
    uint64_t dropped_foreign;    /* wrong magic, version, session or source */
    uint64_t dropped_invalid;    /* truncated, out of range, inconsistent lengths */
    uint64_t dropped_early;      /* would have overwritten data not yet sent */
    uint64_t injected_drops;     /* by the loss-injection model, this call */
    uint64_t agree_messages_sent;
    uint64_t join_messages_sent;  /* JOIN requests and replies (who is in the call, is a quiet sender alive) */
    uint64_t credits_sent;        /* CREDIT datagrams, every copy (flow control: data.c) */
    uint64_t ends_sent;           /* END markers, every copy (a step's last word: data.c) */
    uint64_t receive_overflow_drops; /* datagrams the kernel dropped at this rank's full socket during the call */
    uint64_t send_calls;         /* send system calls made during the call, refused ones too (UDP: sendmmsg; 0 on verbs) */
    uint64_t receive_calls;      /* system calls that returned datagrams during the call (UDP: recvmmsg) */
    uint64_t verdict_acks_presumed; /* peers whose acknowledgement we stopped waiting for: silent long after our verdict went to them */
    uint64_t verdicts_relayed;   /* peers' verdicts this rank took from another rank that passed them on */
    uint64_t answer_waits;       /* 1 when this rank was to stay after its last answer in case every copy was lost (verdict.c) */
    double elapsed_s;
    double deadline_s;
    double agree_s;              /* time spent in the verdict round */
    double join_wait_s;         /* from the call's start until every rank was known to be in it */
    double output_s;            /* after the verdict: writing the result into the tensor, or putting it back (0 in the simulator) */
    uint32_t sequence;
    uint32_t steps;
    uint32_t critical_path;      /* hops on the schedule's longest dependency chain */
    /* how receive steps that missed chunks were closed */
    uint32_t steps_ended;        /* by the sender's END marker, its verdict message, or all it announced having come */
    uint32_t steps_superseded;   /* by data of a later step from the same peer */
    uint32_t steps_answered;     /* by the sender's answer to a JOIN: it sends nothing more of the step */
    uint32_t steps_timed_out;    /* by the call's deadline */
    uint32_t idle_waits;         /* times the engine slept waiting for the network */
    uint32_t credit_stalls;      /* times sending stopped at a receiver's credit limit */
    uint32_t agreed_value;       /* max over ranks of args.agree_value */
    int32_t silent_rank;         /* -1 when every peer was heard */
    int32_t mismatched_rank;     /* -1 unless a peer called with another layout */
    int32_t deadline_expired;
    int32_t in_place;            /* the allreduce summed in the caller's tensor (Options.in_place_min_bytes) */
    int32_t budget_missed;       /* agreed: the call missed its loss budget (udt_budget_missed) */
    uint32_t stripes;            /* calls it ran as at once, each on its own transport (udt_collective_striped); 1 */
    uint32_t stripes_vetoed;     /* of those, calls whose own verdict was OK that failed with a sibling stripe */
};

struct udt_comm;

/* Takes ownership of the transport. Returns NULL and fills error on failure. */
struct udt_comm *udt_comm_create(struct udt_transport *transport, uint32_t rank, uint32_t world_size, uint64_t session_id,
                                 const struct udt_engine_options *options, struct udt_error *error);
void udt_comm_destroy(struct udt_comm *comm);
/* addresses holds world_size addresses of address_bytes each; length is its size in
 * bytes, checked so that a short buffer is refused instead of read past its end. */
int udt_comm_set_peers(struct udt_comm *comm, const uint8_t *addresses, size_t length, uint32_t address_bytes);
const struct udt_error *udt_comm_error(const struct udt_comm *comm);
/* From any thread, during a call or not: the call in progress ends within one wait of the
 * transport (at most 100 ms) as UDT_ERR_INTERRUPTED, its output as it was, and so does every
 * later call, at once. For closing a communicator whose call waits on a peer that may never
 * come (a receive whose sender is gone) without waiting out the join timeout. */
void udt_comm_interrupt(struct udt_comm *comm);
/* Called by a call that has waited UDT_WAIT_HOOK_INTERVAL_MS or more since it started or since
 * the last call of the hook (never by a call that ends sooner), on the thread running the call.
 * A nonzero return ends that call as UDT_ERR_INTERRUPTED, its output as it was; later calls are
 * not affected. NULL: none. The Python layer runs the process's signal handlers there (Ctrl-C
 * while a call holds the main thread). */
typedef int (*udt_wait_hook)(void *arg);
#define UDT_WAIT_HOOK_INTERVAL_MS 100
void udt_comm_set_wait_hook(struct udt_comm *comm, udt_wait_hook hook, void *arg);
/* Tests only: the sequence number of the last call started (the next call
 * uses sequence + 1, modulo 2^32). Every rank must set the same value between
 * calls. Returns -1 during a call. */
int udt_comm_set_sequence(struct udt_comm *comm, uint32_t sequence);
uint32_t udt_comm_chunk_bytes(const struct udt_comm *comm);
/* The sequence number of the last call started (udt_comm_set_sequence sets it). */
uint32_t udt_comm_sequence(const struct udt_comm *comm);

/* Run one collective to the end. On UDT_OK the output holds the result; on any other status it
 * holds what it held before. An allreduce in place (input == output, a type summed as sent:
 * float32, float64, int32) accumulates in the tensor itself during the call, each chunk's
 * original saved in the scratch before its first write and put back if the call fails; other
 * calls accumulate in the scratch and write the output only on UDT_OK. */
int udt_collective(struct udt_comm *comm, const struct udt_collective_args *args, struct udt_collective_stats *stats);
/* udt_collective in two halves, for a caller that decides one outcome for several calls
 * (striped.c). to_verdict starts the call and steps it until its verdict is in: UDT_OK leaves
 * the call awaiting settle; any other status means the call is over, the output as it was.
 * `cancel` (NULL: none) is read between steps: once another thread sets it, the call is
 * abandoned, its output put back, and UDT_ERR_CANCELLED returned.
 * verdict is that call's agreed status. settle ends it: the output is written when the verdict
 * is UDT_OK and `veto` is UDT_OK, else put back, and the status (the veto, for a vetoed OK) is
 * returned. */
int udt_collective_to_verdict(struct udt_comm *comm, const struct udt_collective_args *args, struct udt_collective_stats *stats,
                              const int *cancel);
int udt_collective_verdict(struct udt_comm *comm);
int udt_collective_settle(struct udt_comm *comm, int veto);

#define UDT_MAX_STRIPES 16
/* One collective split into `count` stripes run at once, one thread each: stripe k is args[k]
 * on comms[k] (each its own transport; every rank splits the same way). The outcome is one for
 * all: UDT_OK only when every stripe's verdict is; otherwise every stripe's output holds what
 * it held before, and the status is the gravest of the stripes' (agreed ones agree across
 * ranks). stats[k] are the stripes' own; `merged` sums them up (fractions weighted by
 * weights[k], the stripes' shares of the tensor). *failed_stripe names the stripe whose status
 * was returned (its comm holds the error message), 0 when all were OK. */
int udt_collective_striped(struct udt_comm *const *comms, const struct udt_collective_args *args,
                           struct udt_collective_stats *stats, const double *weights, uint32_t count,
                           struct udt_collective_stats *merged, uint32_t *failed_stripe);

/* The size args->chunk_mask must have for this collective and tensor (0: no mask offered). */
uint64_t udt_chunk_mask_bytes(int collective, int algorithm, uint64_t count, int dtype, uint32_t rank, uint32_t world_size,
                              uint32_t chunk_bytes);

/* Stepping interface. start returns UDT_OK or an error (then no call is
 * active). progress returns 0 when nothing happened (sleep until *wake_ns
 * at the latest), 1 when something did, 2 when the call is over, <0 on a
 * transport error. finish writes the output (on success), or puts an in-place
 * allreduce's tensor back (on failure), and returns the status: a call started
 * must be finished. `now_ns` is any monotonic clock, the same for one call. */
int udt_call_start(struct udt_comm *comm, const struct udt_collective_args *args, struct udt_collective_stats *stats, uint64_t now_ns);
int udt_call_progress(struct udt_comm *comm, uint64_t now_ns, uint64_t *wake_ns);
int udt_call_finish(struct udt_comm *comm, uint64_t now_ns);

#endif
