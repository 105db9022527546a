/* Pure arithmetic of blocks: how a tensor splits into one block per rank,
 * and blocks into chunks. No state, no I/O. */
#ifndef UDT_BLOCKS_H
#define UDT_BLOCKS_H

#include <stdint.h>

/* Elements [start, start+length) of block `block` when `count` elements
 * are split as evenly as possible over `world_size` blocks. */
static inline uint64_t udt_block_start(uint64_t count, uint32_t world_size, uint32_t block)
{
    return (uint64_t)(((unsigned __int128)count * block) / world_size);
}

static inline uint64_t udt_block_length(uint64_t count, uint32_t world_size, uint32_t block)
{
    return udt_block_start(count, world_size, block + 1) - udt_block_start(count, world_size, block);
}

static inline uint64_t udt_chunks_for(uint64_t elements, uint64_t chunk_elements)
{
    return (elements + chunk_elements - 1) / chunk_elements;
}

#endif
