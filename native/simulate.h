/* The simulator: N real engines in one process over the in-memory network,
 * stepped on a virtual clock, with loss injected below each engine exactly
 * as in real runs. The schedules, the accounting and the verdict are the
 * engine's own, so its figures cannot drift from it. */
#ifndef UDT_SIMULATE_H
#define UDT_SIMULATE_H

#include <stdint.h>

#include "engine.h"
#include "transport_lossy.h"
#include "transport_memory.h"

struct udt_simulation {
    uint32_t world_size;
    int collective, algorithm, estimator;
    uint64_t count;          /* float64 elements of the full tensor */
    uint32_t chunk_bytes;
    uint32_t calls;
    double loss_budget;
    uint32_t write_on_budget_miss; /* struct udt_collective_args */
    double deadline_s;       /* virtual seconds */
    double noise;            /* inputs: a signal shared by all ranks plus this much noise of each rank's own */
    uint64_t seed;
    struct udt_loss_model loss; /* per rank, seeded with seed + rank */
    /* A sender's cost: each data datagram takes this much virtual time of its
     * sender (0: free), so a rank serving several peers reaches the last late. */
    uint64_t send_ns_per_datagram;
    /* One rank starts every call this much later than the others (0: none). */
    uint32_t late_rank;
    double late_start_s;
    /* Every datagram arrives this long after it was sent (0: at once): a long
     * path, or ranks waiting for a core. */
    uint64_t delay_ns;
};

/* What one rank saw in one call. */
struct udt_simulated_call {
    int32_t status;
    struct udt_collective_stats stats;
    double error_sum;          /* allreduce: sum over elements of (result - exact) * exact / exact RMS^2: the bias
                                * as a share of the exact value (zero fill shows the missing share, negative) */
    double error_squares;      /* allreduce: sum over elements of ((result - exact) / exact RMS)^2 */
};

/* Runs `calls` calls on every rank; `out` has calls * world_size entries
 * (call-major). Returns 0, or -1 with `error` filled. */
int udt_simulate(const struct udt_simulation *sim, struct udt_simulated_call *out, char *error, int error_bytes);

#endif
