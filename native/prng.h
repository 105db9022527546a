/* The one pseudo-random generator of the C layer (SplitMix64): seeded loss injection and the
 * simulator draw from it, so a seed means the same sequence everywhere. Not for secrets. */
#ifndef UDT_PRNG_H
#define UDT_PRNG_H

#include <stdint.h>

static inline uint64_t udt_prng_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1), 53 bits. */
static inline double udt_prng_uniform(uint64_t *state) { return (double)(udt_prng_next(state) >> 11) * 0x1.0p-53; }

#endif
