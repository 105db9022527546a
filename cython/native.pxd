# Declarations of the C engine (native/), C names unchanged: what ud_transport._native links.
# The transport interface both extensions share is in transport_io.pxd, the verbs transport
# (ud_transport._verbs only) in verbs_native.pxd.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t

from transport_io cimport udt_error, udt_transport

cdef extern from "transport_lossy.h" nogil:
    enum:
        UDT_LOSS_NONE
        UDT_LOSS_BERNOULLI
        UDT_LOSS_GILBERT_ELLIOTT

    struct udt_loss_model:
        int kind
        double loss
        double good_to_bad
        double bad_to_good
        double loss_in_good
        double loss_in_bad
        uint64_t seed

    udt_transport *udt_lossy_wrap(udt_transport *inner, const udt_loss_model *model)

cdef extern from "transport_udp.h" nogil:
    udt_transport *udt_udp_open(const char *bind_ipv4, uint16_t port, uint32_t socket_buffer_bytes, udt_error *error)

    enum:
        UDT_UDP_GSO
        UDT_UDP_GRO
        UDT_UDP_RCVBUF_FORCED
        UDT_UDP_GSO_REFUSED
        UDT_UDP_DROPS_COUNTED
        UDT_UDP_PORTS_WATCHED
        UDT_UDP_PATH_MTU_IGNORED

    # the C struct shares its tag with the function below; Cython needs another name for it
    ctypedef struct udt_udp_counters_struct "struct udt_udp_counters":
        uint64_t send_calls
        uint64_t send_messages
        uint64_t send_gso_messages
        uint64_t send_gso_datagrams
        uint64_t recv_calls
        uint64_t recv_messages
        uint64_t recv_gro_messages
        uint64_t recv_gro_datagrams
        uint64_t icmp_errors
        uint64_t icmp_unverified
        uint64_t send_refused
        uint64_t icmp_too_big

    uint32_t udt_udp_features(const udt_transport *t)
    int udt_udp_disable(udt_transport *t, uint32_t features)
    uint32_t udt_udp_receive_buffer_bytes(const udt_transport *t)
    uint32_t udt_udp_send_buffer_bytes(const udt_transport *t)
    int udt_udp_describe(const udt_transport *t, char *text, int text_bytes)
    int udt_udp_counters(const udt_transport *t, udt_udp_counters_struct *out)

cdef extern from "schedule.h" nogil:
    enum:
        UDT_ALLREDUCE
        UDT_REDUCE_SCATTER
        UDT_ALL_GATHER
        UDT_BROADCAST
        UDT_AGREE
        UDT_ALL_TO_ALL
        UDT_SCATTER
        UDT_GATHER
        UDT_ALGORITHM_RING
        UDT_ALGORITHM_DIRECT
        UDT_RECV_REDUCE
        UDT_RECV_OVERWRITE
        UDT_NO_PEER
        UDT_NO_STEP

    struct udt_step:
        int32_t send_peer
        uint32_t send_block
        int32_t send_after
        int32_t recv_peer
        uint32_t recv_block
        uint8_t recv_mode
        uint8_t phase
        uint32_t recv_needs_sent
        uint8_t recv_whole
        uint16_t recv_contributions

    enum:
        UDT_COLLECTIVE_COUNT

    # the C struct shares its tag with the function below; Cython needs another name for it
    ctypedef struct udt_collective_facts_struct "struct udt_collective_facts":
        const char *name
        uint8_t moves_data
        uint8_t reduces
        uint8_t gathers
        uint8_t input_is_shard
        uint8_t output_is_shard
        uint8_t sends_input
        uint8_t holds_own_block
        uint8_t root_holds_all
        uint8_t rotates
        uint8_t may_sum_in_place
        uint8_t equal_blocks
        uint8_t mask_by_sender
        uint8_t wants
        uint8_t output

    const udt_collective_facts_struct *udt_collective_facts(int collective)

    struct udt_schedule:
        uint32_t steps
        uint32_t world_size
        uint32_t owned_block
        int32_t finalize_after
        uint32_t reduce_steps
        int32_t critical_path

    uint32_t udt_schedule_steps(int collective, int algorithm, uint32_t world_size)
    int udt_schedule_build(int collective, int algorithm, uint32_t rank, uint32_t world_size, uint32_t root, uint32_t rotation,
                           udt_schedule *schedule, udt_step *out, uint32_t *block_scratch)

cdef extern from "elementwise.h" nogil:
    enum:
        UDT_FLOAT32
        UDT_FLOAT64
        UDT_FLOAT16
        UDT_BFLOAT16
        UDT_INT32
        UDT_DTYPE_COUNT

cdef extern from "engine.h" nogil:
    enum:
        UDT_MAX_WORLD
        UDT_MAX_END_REPEATS
        UDT_MAX_COPIES
        UDT_MAX_STRIPES
        UDT_OK
        UDT_ERR_LOSS_BUDGET
        UDT_ERR_PEER_TIMEOUT
        UDT_ERR_INVALID_ARGUMENT
        UDT_ERR_TRANSPORT
        UDT_ERR_NO_MEMORY
        UDT_ERR_LAYOUT_MISMATCH
        UDT_ERR_INTERRUPTED

    enum:
        UDT_OP_SUM
        UDT_OP_MEAN
        UDT_ESTIMATOR_UNBIASED
        UDT_ESTIMATOR_ZERO_FILL

    struct udt_engine_options:
        uint32_t chunk_bytes
        uint32_t window_bytes
        uint32_t end_repeats
        uint32_t credit_refresh_us
        uint32_t reorder_grace_us
        uint32_t busy_poll_us
        uint32_t idle_close_us
        uint32_t agree_resend_us
        uint32_t join_timeout_ms
        uint64_t in_place_min_bytes

    struct udt_collective_stats:
        double delivered_fraction
        double reduce_fraction
        double gather_fraction
        double own_reduce_fraction
        double own_gather_fraction
        uint64_t chunks_total
        uint64_t chunks_lost
        uint64_t chunks_stale
        uint64_t datagrams_sent
        uint64_t payload_bytes_sent
        uint64_t datagrams_received
        uint64_t dropped_stale
        uint64_t dropped_duplicate
        uint64_t redundant_copies
        uint64_t dropped_foreign
        uint64_t dropped_invalid
        uint64_t dropped_early
        uint64_t injected_drops
        uint64_t agree_messages_sent
        uint64_t join_messages_sent
        uint64_t credits_sent
        uint64_t ends_sent
        uint64_t receive_overflow_drops
        uint64_t send_calls
        uint64_t receive_calls
        uint64_t verdict_acks_presumed
        uint64_t verdicts_relayed
        uint64_t answer_waits
        double elapsed_s
        double deadline_s
        double agree_s
        double join_wait_s
        double output_s
        uint32_t sequence
        uint32_t steps
        uint32_t critical_path
        uint32_t steps_ended
        uint32_t steps_superseded
        uint32_t steps_answered
        uint32_t steps_timed_out
        uint32_t idle_waits
        uint32_t credit_stalls
        uint32_t agreed_value
        int32_t silent_rank
        int32_t mismatched_rank
        int32_t deadline_expired
        int32_t budget_missed
        int32_t in_place
        uint32_t stripes
        uint32_t stripes_vetoed

    struct udt_collective_args:
        int collective
        int algorithm
        const void *input
        void *output
        uint64_t count
        int dtype
        int op
        int estimator
        uint32_t root
        uint32_t agree_value
        double loss_budget
        double deadline_s
        uint8_t *chunk_mask
        uint64_t chunk_mask_bytes
        uint32_t copies
        uint32_t direct_output
        uint32_t layout_salt
        uint32_t write_on_budget_miss
        uint32_t reduce_in_rank_order
        const uint64_t *piece_counts

    int udt_budget_missed(double reduce_fraction, double gather_fraction, double loss_budget)

    struct udt_comm:
        pass

    udt_comm *udt_comm_create(udt_transport *transport, uint32_t rank, uint32_t world_size, uint64_t session_id,
                              const udt_engine_options *options, udt_error *error)
    void udt_comm_destroy(udt_comm *comm)
    int udt_comm_set_peers(udt_comm *comm, const uint8_t *addresses, size_t length, uint32_t address_bytes)
    int udt_collective(udt_comm *comm, const udt_collective_args *args, udt_collective_stats *stats)
    int udt_collective_striped(udt_comm *const *comms, const udt_collective_args *args, udt_collective_stats *stats,
                               const double *weights, uint32_t count, udt_collective_stats *merged,
                               uint32_t *failed_stripe)
    uint64_t udt_chunk_mask_bytes(int collective, int algorithm, uint64_t count, int dtype, uint32_t rank,
                                  uint32_t world_size, uint32_t chunk_bytes)
    int udt_call_start(udt_comm *comm, const udt_collective_args *args, udt_collective_stats *stats, uint64_t now_ns)
    int udt_call_progress(udt_comm *comm, uint64_t now_ns, uint64_t *wake_ns)
    int udt_call_finish(udt_comm *comm, uint64_t now_ns)
    const udt_error *udt_comm_error(const udt_comm *comm)
    void udt_comm_interrupt(udt_comm *comm)
    ctypedef int (*udt_wait_hook)(void *arg) noexcept nogil
    void udt_comm_set_wait_hook(udt_comm *comm, udt_wait_hook hook, void *arg)
    int udt_comm_set_sequence(udt_comm *comm, uint32_t sequence)
    uint32_t udt_comm_sequence(const udt_comm *comm)

cdef extern from "blocks.h" nogil:
    uint64_t udt_block_start(uint64_t count, uint32_t world_size, uint32_t block)

cdef extern from "elementwise.h" nogil:
    uint16_t udt_float_to_half(float value)
    float udt_half_to_float(uint16_t bits)
    uint16_t udt_float_to_bfloat16(float value)
    float udt_bfloat16_to_float(uint16_t bits)
    size_t udt_wire_elem_bytes(int dtype)
    void udt_copy_uncached(void *dst, const void *src, size_t bytes)
    void udt_uncached_fence()
