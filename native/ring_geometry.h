/* Pure arithmetic of the ring: which segment each rank sends and receives at
 * each step, and how segments split into chunks. No state, no I/O. */
#ifndef UDT_RING_GEOMETRY_H
#define UDT_RING_GEOMETRY_H

#include <stdint.h>

/* Elements [start, start+length) of segment `segment` when `count` elements
 * are split as evenly as possible over `world_size` segments. */
static inline uint64_t udt_segment_start(uint64_t count, uint32_t world_size, uint32_t segment)
{
    return (uint64_t)(((unsigned __int128)count * segment) / world_size);
}

static inline uint64_t udt_segment_length(uint64_t count, uint32_t world_size, uint32_t segment)
{
    return udt_segment_start(count, world_size, segment + 1) - udt_segment_start(count, world_size, segment);
}

static inline uint64_t udt_chunks_for(uint64_t elements, uint64_t chunk_elements)
{
    return (elements + chunk_elements - 1) / chunk_elements;
}

/* A call has 2*(N-1) global steps: reduce-scatter steps 0..N-2, then
 * all-gather steps N-1..2N-3. Segments here are "virtual": the engine
 * rotates them by the call's sequence number so that, over calls, every rank
 * owns every part of the tensor equally often (this is what makes the
 * rescaled estimate unbiased for fixed inputs, see README). */
static inline uint32_t udt_steps_total(uint32_t world_size) { return world_size > 1 ? 2 * (world_size - 1) : 0; }

static inline uint32_t udt_mod(int64_t value, uint32_t world_size)
{
    int64_t m = value % (int64_t)world_size;
    return (uint32_t)(m < 0 ? m + world_size : m);
}

/* Reduce-scatter step s: send segment r-s, receive r-s-1 and add to it.
 * All-gather step t: send segment r+1-t, receive segment r-t (overwrite).
 * After reduce-scatter rank r owns segment r+1. */
static inline uint32_t udt_send_segment(uint32_t rank, uint32_t world_size, uint32_t global_step)
{
    if (global_step < world_size - 1)
        return udt_mod((int64_t)rank - global_step, world_size);
    return udt_mod((int64_t)rank + 1 - (global_step - (world_size - 1)), world_size);
}

static inline uint32_t udt_recv_segment(uint32_t rank, uint32_t world_size, uint32_t global_step)
{
    if (global_step < world_size - 1)
        return udt_mod((int64_t)rank - global_step - 1, world_size);
    return udt_mod((int64_t)rank - (global_step - (world_size - 1)), world_size);
}

static inline uint32_t udt_owned_segment(uint32_t rank, uint32_t world_size) { return udt_mod((int64_t)rank + 1, world_size); }

#endif
