# The simulator: many real engines in one process on a virtual clock (native/simulate.c).
cdef extern from "simulate.h" nogil:
    struct udt_simulation:
        uint32_t world_size
        int collective
        int algorithm
        int estimator
        uint64_t count
        uint32_t chunk_bytes
        uint32_t calls
        double loss_budget
        uint32_t write_on_budget_miss
        double deadline_s
        double noise
        uint64_t seed
        udt_loss_model loss
        uint64_t send_ns_per_datagram
        uint32_t late_rank
        double late_start_s
        uint64_t delay_ns

    struct udt_simulated_call:
        int32_t status
        udt_collective_stats stats
        double error_sum
        double error_squares

    int udt_simulate(const udt_simulation *sim, udt_simulated_call *out, char *error, int error_bytes)


def simulate(uint32_t world_size, int collective, int algorithm, uint64_t count, uint32_t chunk_bytes, uint32_t calls, *,
             int estimator=0, double loss_budget=0.1, uint32_t write_on_budget_miss=0, double deadline_s=10.0, double noise=1.0, uint64_t seed=1,
             int loss_kind=0, double loss=0.0, double good_to_bad=0.0, double bad_to_good=0.0, double loss_in_good=0.0,
             double loss_in_bad=0.0, uint64_t send_ns_per_datagram=0, uint32_t late_rank=0, double late_start_s=0.0,
             uint64_t delay_ns=0):
    """Run `calls` calls of a collective on `world_size` engines in this
    process. `send_ns_per_datagram` paces every sender (virtual time per data
    datagram); rank `late_rank` starts each call `late_start_s` after the
    others; every datagram arrives `delay_ns` of virtual time after it was
    sent. Returns a list (one per call) of lists (one per rank) of
    (status, stats dict, error_sum, error_squares)."""
    cdef udt_simulation sim
    cdef char error[320]
    cdef int rc
    if world_size == 0 or calls == 0:
        raise ValueError("world_size and calls must be positive")
    memset(&sim, 0, sizeof(sim))
    sim.world_size = world_size
    sim.collective = collective
    sim.algorithm = algorithm
    sim.estimator = estimator
    sim.count = count
    sim.chunk_bytes = chunk_bytes
    sim.calls = calls
    sim.loss_budget = loss_budget
    sim.write_on_budget_miss = write_on_budget_miss
    sim.deadline_s = deadline_s
    sim.noise = noise
    sim.seed = seed
    sim.loss.kind = loss_kind
    sim.loss.loss = loss
    sim.loss.good_to_bad = good_to_bad
    sim.loss.bad_to_good = bad_to_good
    sim.loss.loss_in_good = loss_in_good
    sim.loss.loss_in_bad = loss_in_bad
    if late_rank >= world_size or late_start_s < 0:
        raise ValueError(f"late_rank must be a rank (0..{world_size - 1}) and late_start_s not negative")
    sim.send_ns_per_datagram = send_ns_per_datagram
    sim.late_rank = late_rank
    sim.late_start_s = late_start_s
    sim.delay_ns = delay_ns
    cdef udt_simulated_call *out = <udt_simulated_call *>malloc(<size_t>calls * world_size * sizeof(udt_simulated_call))
    if out is NULL:
        raise MemoryError()
    try:
        memset(error, 0, sizeof(error))
        with nogil:
            rc = udt_simulate(&sim, out, error, sizeof(error))
        if rc != 0:
            raise RuntimeError(error.decode(errors="replace"))
        return [[(out[c * world_size + r].status, out[c * world_size + r].stats, out[c * world_size + r].error_sum,
                  out[c * world_size + r].error_squares) for r in range(world_size)] for c in range(calls)]
    finally:
        free(out)
