/* The ring allreduce engine over any udt_transport: reduce-scatter then
 * all-gather, chunk by chunk, never retransmitting. Called with the GIL
 * released; touches only C memory. */
#ifndef UDT_RING_ALLREDUCE_H
#define UDT_RING_ALLREDUCE_H

#include <stdint.h>

#include "transport.h"

#define UDT_MAX_WORLD 64

enum udt_status {
    UDT_OK = 0,
    UDT_ERR_LOSS_BUDGET = 1,    /* more missing than the budget allows; tensor untouched */
    UDT_ERR_PEER_TIMEOUT = 2,   /* a rank said nothing within the deadline; tensor untouched */
    UDT_ERR_INVALID_ARGUMENT = 3,
    UDT_ERR_TRANSPORT = 4,
    UDT_ERR_NO_MEMORY = 5,
    UDT_ERR_LAYOUT_MISMATCH = 6, /* the upstream rank called with another size, dtype or op */
};

enum udt_op { UDT_OP_SUM = 0, UDT_OP_MEAN = 1 };

/* How a missing contribution is treated. UNBIASED is the product; ZERO_FILL
 * (no rescaling, zeros in holes, as OptiReduce does) exists as a baseline
 * and as the negative control of the unbiasedness test. */
enum udt_estimator { UDT_ESTIMATOR_UNBIASED = 0, UDT_ESTIMATOR_ZERO_FILL = 1 };

struct udt_engine_options {
    uint32_t chunk_bytes;       /* payload bytes per datagram, at most transport max - header */
    uint32_t window_bytes;      /* data an upstream may have in flight to us */
    uint32_t end_repeats;       /* copies of each END marker (they can be lost too) */
    uint32_t credit_refresh_us; /* resend our credit this often while waiting */
    uint32_t reorder_grace_us;  /* after an END, wait this long for stragglers */
    uint32_t busy_poll_us;      /* spin this long for the next datagram before sleeping */
    uint32_t idle_close_us;     /* a step that lost chunks closes after this long without arrivals (0 = never) */
};

struct udt_allreduce_stats {
    double delivered_fraction; /* share of all ranks' contributions present in this rank's result */
    uint64_t chunks_total;     /* chunks this rank expected to receive */
    uint64_t chunks_lost;      /* of those, never arrived in time */
    uint64_t datagrams_sent;
    uint64_t datagrams_received; /* valid data datagrams used */
    uint64_t dropped_stale;      /* for an earlier call or a step already closed */
    uint64_t dropped_duplicate;
    uint64_t dropped_foreign;    /* wrong magic, version, session or source */
    uint64_t dropped_invalid;    /* truncated, out of range, inconsistent lengths */
    uint64_t dropped_early;      /* would have overwritten data not yet forwarded */
    uint64_t injected_drops;     /* by the loss-injection model, this call */
    double elapsed_s;
    double deadline_s;
    uint32_t sequence;
    /* how receive steps that missed chunks were closed */
    uint32_t steps_ended;        /* by the sender's END marker */
    uint32_t steps_superseded;   /* by data of a later step */
    uint32_t steps_idle_closed;  /* quiet after a gap */
    uint32_t steps_timed_out;    /* by their share of the deadline */
    uint32_t idle_waits;        /* times the engine slept waiting for the network */
    uint32_t credit_stalls;     /* times sending stopped at the receiver's credit limit */
    int32_t silent_rank;         /* -1 when every peer was heard */
    int32_t mismatched_rank;     /* -1 unless a peer called with another layout */
    int32_t deadline_expired;
};

struct udt_allreduce_args {
    void *data;
    uint64_t count;
    int dtype;
    int op;
    int estimator;
    double loss_budget;
    double deadline_s;
};

struct udt_comm;

/* Takes ownership of the transport. Returns NULL and fills error on failure. */
struct udt_comm *udt_comm_create(struct udt_transport *transport, uint32_t rank, uint32_t world_size, uint64_t session_id,
                                 const struct udt_engine_options *options, char *error, int error_bytes);
void udt_comm_destroy(struct udt_comm *comm);
int udt_comm_set_peers(struct udt_comm *comm, const uint8_t *addresses, uint32_t address_bytes);
int udt_allreduce(struct udt_comm *comm, const struct udt_allreduce_args *args, struct udt_allreduce_stats *stats);
const char *udt_comm_error(const struct udt_comm *comm);
uint32_t udt_comm_chunk_bytes(const struct udt_comm *comm);

#endif
