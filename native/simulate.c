/* The simulator's driver: start a call on every engine, sweep them until all
 * are over, and jump the virtual clock to the earliest timer whenever a
 * sweep moved nothing. */
#include "simulate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "elementwise.h"
#include "prng.h"
#include "wire.h"

#define SWEEP_LIMIT 50000000ull
#define SEND_CREDIT_DATAGRAMS 64 /* a paced sender saves up at most this many sends while idle */

static double normal(uint64_t *state)
{
    double u = ((double)(udt_prng_next(state) >> 11) + 0.5) * 0x1.0p-53, v = udt_prng_uniform(state);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

struct sim_rank {
    struct udt_comm *comm;
    double *input, *output;
    struct udt_collective_stats stats;
    int over, started;
    uint64_t start_ns;
    uint64_t send_clock_ns; /* paced: virtual time up to which its sends are spent */
};

/* Hand a paced rank the sends its time allows since it last sent (see send_ns_per_datagram). */
static void give_send_allowance(struct udt_memory_network *net, struct sim_rank *rank, uint32_t r, uint64_t cost, uint64_t now)
{
    if (!cost)
        return;
    uint64_t saved_from = now > SEND_CREDIT_DATAGRAMS * cost ? now - SEND_CREDIT_DATAGRAMS * cost : 0;
    if (rank->send_clock_ns < saved_from)
        rank->send_clock_ns = saved_from;
    udt_memory_set_send_allowance(net, r, now > rank->send_clock_ns ? (int64_t)((now - rank->send_clock_ns) / cost) : 0);
}

/* Charge what it sent; returns when its next send is possible if it was held back, else UINT64_MAX. */
static uint64_t charge_sends(struct udt_memory_network *net, struct sim_rank *rank, uint32_t r, uint64_t cost, uint64_t now,
                             int64_t given)
{
    if (!cost)
        return UINT64_MAX;
    int64_t left = udt_memory_send_allowance(net, r);
    rank->send_clock_ns += (uint64_t)(given - left) * cost;
    return left == 0 ? (rank->send_clock_ns > now ? rank->send_clock_ns : now) + cost : UINT64_MAX;
}

static void release(struct sim_rank *ranks, uint32_t n, struct udt_memory_network *net, double *signal)
{
    if (ranks)
        for (uint32_t r = 0; r < n; r++) {
            udt_comm_destroy(ranks[r].comm);
            free(ranks[r].input);
            free(ranks[r].output);
        }
    free(ranks);
    free(signal);
    udt_memory_network_destroy(net);
}

int udt_simulate(const struct udt_simulation *sim, struct udt_simulated_call *out, char *error, int error_bytes)
{
    uint32_t n = sim->world_size;
    uint64_t count = sim->count;
    struct udt_memory_network *net = udt_memory_network_create(n, sim->chunk_bytes + UDT_WIRE_HEADER_BYTES);
    if (net)
        udt_memory_set_delay(net, sim->delay_ns);
    struct sim_rank *ranks = calloc(n, sizeof *ranks);
    double *signal = malloc((count ? count : 1) * sizeof *signal);
    if (!net || !ranks || !signal) {
        release(ranks, n, net, signal);
        snprintf(error, (size_t)error_bytes, "out of memory");
        return -1;
    }
    struct udt_engine_options options = {.chunk_bytes = sim->chunk_bytes, .window_bytes = 16u << 20, .end_repeats = 3,
                                         .credit_refresh_us = 2000, .reorder_grace_us = 200, .busy_poll_us = 0,
                                         .idle_close_us = 20000, .agree_resend_us = 1000,
                                         .join_timeout_ms = 300000};
    for (uint32_t r = 0; r < n; r++) {
        struct udt_transport *t = udt_memory_open(net, r);
        if (t && sim->loss.kind != UDT_LOSS_NONE) {
            struct udt_loss_model model = sim->loss;
            model.seed = sim->seed * 1000003ull + r;
            struct udt_transport *wrapped = udt_lossy_wrap(t, &model);
            if (!wrapped)
                udt_transport_destroy(t);
            t = wrapped;
        }
        ranks[r].input = malloc((count ? count : 1) * sizeof(double));
        ranks[r].output = malloc((count ? count : 1) * sizeof(double));
        struct udt_error create_error = {0};
        ranks[r].comm = t ? udt_comm_create(t, r, n, 0x5151u, &options, &create_error) : NULL;
        if (!ranks[r].comm || !ranks[r].input || !ranks[r].output) {
            if (t && !ranks[r].comm) {
                udt_transport_destroy(t);
                snprintf(error, (size_t)error_bytes, "%s", create_error.message);
            }
            release(ranks, n, net, signal);
            if (!t)
                snprintf(error, (size_t)error_bytes, "out of memory");
            return -1;
        }
    }
    uint64_t rng = sim->seed ^ 0xabcdefull;
    uint64_t now = 1000000000ull;
    for (uint32_t call = 0; call < sim->calls; call++) {
        for (uint64_t i = 0; i < count; i++)
            signal[i] = normal(&rng);
        double exact_squares = 0;
        for (uint32_t r = 0; r < n; r++)
            for (uint64_t i = 0; i < count; i++) {
                ranks[r].input[i] = signal[i] + sim->noise * normal(&rng);
                ranks[r].output[i] = ranks[r].input[i];
            }
        /* the exact sum, kept in `signal` */
        for (uint64_t i = 0; i < count; i++) {
            double total = 0;
            for (uint32_t r = 0; r < n; r++)
                total += ranks[r].input[i];
            signal[i] = total;
            exact_squares += total * total;
        }
        double exact_rms = count ? sqrt(exact_squares / (double)count) : 1.0;
        struct udt_collective_args args = {.collective = sim->collective, .algorithm = sim->algorithm, .count = count,
                                           .dtype = UDT_FLOAT64, .op = UDT_OP_SUM, .estimator = sim->estimator,
                                           .loss_budget = sim->loss_budget, .deadline_s = sim->deadline_s,
                                           .write_on_budget_miss = sim->write_on_budget_miss};
        for (uint32_t r = 0; r < n; r++) {
            ranks[r].over = ranks[r].started = 0;
            ranks[r].start_ns = now + (r == sim->late_rank ? (uint64_t)(sim->late_start_s * 1e9) : 0);
        }
        uint32_t remaining = n;
        uint64_t sweeps = 0;
        while (remaining > 0) {
            int progressed = 0;
            uint64_t earliest = UINT64_MAX;
            for (uint32_t r = 0; r < n; r++) {
                if (ranks[r].over)
                    continue;
                if (!ranks[r].started) {
                    if (now < ranks[r].start_ns) {
                        earliest = ranks[r].start_ns < earliest ? ranks[r].start_ns : earliest;
                        continue;
                    }
                    args.input = ranks[r].input;
                    args.output = ranks[r].output;
                    if (udt_call_start(ranks[r].comm, &args, &ranks[r].stats, now) != UDT_OK) {
                        snprintf(error, (size_t)error_bytes, "rank %u: %s", r, udt_comm_error(ranks[r].comm)->message);
                        release(ranks, n, net, signal);
                        return -1;
                    }
                    ranks[r].started = 1;
                    progressed = 1;
                }
                uint64_t wake = UINT64_MAX, cost = sim->send_ns_per_datagram;
                udt_memory_set_clock(net, now);
                give_send_allowance(net, &ranks[r], r, cost, now);
                int64_t given = udt_memory_send_allowance(net, r);
                int rc = udt_call_progress(ranks[r].comm, now, &wake);
                uint64_t next_send = charge_sends(net, &ranks[r], r, cost, now, given);
                if (next_send < wake)
                    wake = next_send;
                uint64_t arrival = sim->delay_ns ? udt_memory_next_arrival(net, r) : UINT64_MAX; /* a datagram on the way */
                if (arrival < wake)
                    wake = arrival;
                if (rc < 0) {
                    snprintf(error, (size_t)error_bytes, "rank %u: transport error %d", r, rc);
                    release(ranks, n, net, signal);
                    return -1;
                }
                if (rc == 2) {
                    ranks[r].over = 1;
                    remaining--;
                    out[(size_t)call * n + r].status = udt_call_finish(ranks[r].comm, now);
                    progressed = 1;
                    continue;
                }
                progressed |= rc;
                if (wake < earliest)
                    earliest = wake;
            }
            if (!progressed)
                now = earliest != UINT64_MAX && earliest > now ? earliest : now + 1000;
            if (++sweeps > SWEEP_LIMIT) {
                snprintf(error, (size_t)error_bytes, "call %u did not end after %llu sweeps", call, (unsigned long long)sweeps);
                release(ranks, n, net, signal);
                return -1;
            }
        }
        for (uint32_t r = 0; r < n; r++) {
            struct udt_simulated_call *row = &out[(size_t)call * n + r];
            row->stats = ranks[r].stats;
            row->error_sum = row->error_squares = 0;
            if (row->status == UDT_OK && udt_collective_facts(sim->collective)->output == UDT_OUTPUT_REDUCED) /* the whole sum */
                for (uint64_t i = 0; i < count; i++) {
                    double e = (ranks[r].output[i] - signal[i]) / exact_rms;
                    row->error_sum += e * signal[i] / exact_rms; /* projected on the exact value: a shrink shows as < 0 */
                    row->error_squares += e * e;
                }
        }
        now += 1000000; /* the next call starts a millisecond later */
    }
    release(ranks, n, net, signal);
    return 0;
}
