/* Algorithms as schedules: who sends which block to whom, and what is
 * expected from whom, step by step. Pure functions of (collective, algorithm,
 * rank, world size, root, rotation): no state, no I/O. The engine executes
 * any schedule; the simulator runs the same builders.
 *
 * Step i of a rank's schedule pairs with step i of every other rank's: what
 * rank p sends to rank q in its step i is what q expects from p in its step
 * i. A step may only send, only receive, or do neither. */
#ifndef UDT_SCHEDULE_H
#define UDT_SCHEDULE_H

#include <stdint.h>

enum udt_collective {
    UDT_ALLREDUCE = 0,
    UDT_REDUCE_SCATTER = 1,
    UDT_ALL_GATHER = 2,
    UDT_BROADCAST = 3,
    UDT_AGREE = 4, /* no data: only the verdict round */
    UDT_ALL_TO_ALL = 5, /* block q of rank r's input becomes block r of rank q's output */
    UDT_SCATTER = 6,    /* block q of the root's tensor becomes block q of rank q's */
    UDT_GATHER = 7,     /* rank q's shard becomes block q of the root's output */
    UDT_COLLECTIVE_COUNT = 8,
};

/* Which blocks make up a rank's result (struct udt_collective_facts.wants): what its fresh
 * fraction, its chunk mask and the verdict measure. */
enum udt_wants {
    UDT_WANTS_ALL = 0,          /* every block */
    UDT_WANTS_OWN_BLOCK = 1,    /* scatter: each rank its own block, no more */
    UDT_WANTS_ALL_AT_ROOT = 2,  /* gather: the root every block; the others their own, which they hold */
};

/* What the caller's buffers hold, per collective (struct udt_collective_facts.output). */
enum udt_output_kind {
    UDT_OUTPUT_NONE = 0,          /* agree: no data */
    UDT_OUTPUT_REDUCED = 1,       /* allreduce: every block, summed and rescaled */
    UDT_OUTPUT_REDUCED_SHARD = 2, /* reduce_scatter: this rank's block, summed */
    UDT_OUTPUT_GATHERED = 3,      /* all_gather, broadcast, all_to_all: final values, fresh or stale */
};

/* What a collective is, as the engine, the verdict and the Python layer need it. One table, in
 * schedule.c; nothing else tests which collective a call is. */
struct udt_collective_facts {
    const char *name;         /* as the Python API spells it */
    uint8_t moves_data;       /* 0: agree, only the verdict round */
    uint8_t reduces;          /* has a reduce half: contributions are summed at owners */
    uint8_t gathers;          /* has a gather half: final values reach every rank (fresh or stale) */
    uint8_t input_is_shard;   /* the input is this rank's block only (all_gather) */
    uint8_t output_is_shard;  /* the output is this rank's block only (reduce_scatter) */
    uint8_t sends_input;      /* every chunk goes out as the input has it, never what arrived (all_to_all) */
    uint8_t holds_own_block;  /* the input fills this rank's own output block before anything arrives */
    uint8_t root_holds_all;   /* the root holds every block from the start (broadcast) */
    uint8_t rotates;          /* block ownership rotates with the call's sequence, spreading the owner's work */
    uint8_t may_sum_in_place; /* input and output may be one tensor that accumulates (allreduce) */
    uint8_t equal_blocks;     /* the count must divide by the world size (all_to_all's pieces) */
    uint8_t mask_by_sender;   /* the chunk mask says whose contribution reached the shard, per sender */
    uint8_t wants;            /* enum udt_wants: which blocks a rank's result is */
    uint8_t output;           /* enum udt_output_kind */
};

/* The facts of `collective`, or NULL for an unknown one. */
const struct udt_collective_facts *udt_collective_facts(int collective);

enum udt_algorithm {
    UDT_ALGORITHM_RING = 0,   /* neighbours only; partial sums travel N-1 hops */
    UDT_ALGORITHM_DIRECT = 1, /* transpose: every rank talks to every rank, one hop per half */
    UDT_ALGORITHM_COUNT = 2,
};

enum udt_recv_mode {
    UDT_RECV_REDUCE = 0,    /* add into the block; the payload carries a contribution count */
    UDT_RECV_OVERWRITE = 1, /* replace the block's chunk with a final value (fresh) */
};

/* Which half of a schedule a step belongs to; data and END datagrams carry it as is (wire.h) */
enum udt_phase {
    UDT_PHASE_REDUCE = 0, /* first half (reduce-scatter, or a broadcast's scatter) */
    UDT_PHASE_GATHER = 1, /* second half (all-gather) */
};

#define UDT_NO_PEER (-1)
#define UDT_NO_STEP (-1)

struct udt_step {
    int32_t send_peer;   /* UDT_NO_PEER: nothing to send */
    uint32_t send_block;
    int32_t send_after;  /* receive step that must be closed before sending (UDT_NO_STEP: none) */
    int32_t recv_peer;   /* UDT_NO_PEER: nothing expected */
    uint32_t recv_block;
    uint8_t recv_mode;   /* enum udt_recv_mode */
    uint8_t phase;       /* enum udt_phase: which half the step belongs to */
    /* A receive into recv_block may be admitted only once this many send
     * steps are done: the last earlier send that reads the same block must
     * have left, or the receive would change what it sends. */
    uint32_t recv_needs_sent;
    /* The sender holds every chunk of recv_block, so it sends (and announces)
     * all of them; otherwise it relays what reached it. */
    uint8_t recv_whole;
    /* The most contributions one chunk received in this step can carry: a ring's
     * partial sum at reduce step g holds at most g + 1 ranks' inputs, a direct
     * sender's piece exactly one; final values (gather) up to every rank's. */
    uint16_t recv_contributions;
};

struct udt_schedule {
    const struct udt_collective_facts *facts; /* what the collective is */
    uint32_t steps;
    uint32_t world_size;
    uint32_t owned_block;     /* the block this rank finalises (reduce) or relays (broadcast) */
    int32_t finalize_after;   /* receive step after whose close owned_block is final (UDT_NO_STEP: none) */
    uint32_t reduce_steps;    /* steps [0, reduce_steps) are the first half */
    int32_t critical_path;    /* hops on the longest dependency chain (the latency in rounds) */
};

/* Number of steps a schedule has (the same on every rank). */
uint32_t udt_schedule_steps(int collective, int algorithm, uint32_t world_size);

/* Fill `out` (udt_schedule_steps entries) and `schedule`. Blocks are numbered
 * after rotation: block b is tensor segment (b + rotation) mod N, so over calls
 * every rank owns every part of the tensor equally often. `block_scratch`
 * has world_size entries of working space. Returns 0, or -1 for an unknown
 * collective/algorithm or a root outside the world. */
int udt_schedule_build(int collective, int algorithm, uint32_t rank, uint32_t world_size, uint32_t root, uint32_t rotation,
                       struct udt_schedule *schedule, struct udt_step *out, uint32_t *block_scratch);

#endif
