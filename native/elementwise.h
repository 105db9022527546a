/* Element types and the few element-wise kernels the engine needs. The
 * engine keeps partial sums in an "accumulator" type (float32 for 16-bit
 * floats) and sends the caller's own type on the wire. */
#ifndef UDT_ELEMENTWISE_H
#define UDT_ELEMENTWISE_H

#include <stddef.h>
#include <stdint.h>

enum udt_dtype {
    UDT_FLOAT32 = 0,
    UDT_FLOAT64 = 1,
    UDT_FLOAT16 = 2,
    UDT_BFLOAT16 = 3,
    UDT_INT32 = 4,
    UDT_DTYPE_COUNT = 5,
};

size_t udt_wire_elem_bytes(int dtype);  /* bytes per element in the caller's tensor and on the wire */
size_t udt_accum_elem_bytes(int dtype); /* bytes per element in the scratch accumulator */

/* accumulator <- caller's type */
void udt_load(int dtype, void *accum, const void *src, size_t count);
/* wire <- accumulator (identity copy where the types match) */
void udt_pack(int dtype, void *wire, const void *accum, size_t count);
/* accumulator += wire */
void udt_add(int dtype, void *accum, const void *wire, size_t count);
/* accumulator <- input + wire (both in the caller's type) */
void udt_add_into(int dtype, void *accum, const void *input, const void *wire, size_t count);
/* data (caller's type) *= factor, in place; factor 0 writes zeros */
void udt_rescale_wire(int dtype, void *data, size_t count, double factor);
/* accumulator <- wire */
void udt_unpack(int dtype, void *accum, const void *wire, size_t count);
/* accumulator *= factor (integers round to nearest) */
void udt_scale(int dtype, void *accum, size_t count, double factor);
/* dst (caller's type) <- accumulator * factor; factor 0 writes zeros */
void udt_store(int dtype, void *dst, const void *accum, size_t count, double factor);
/* memcpy whose stores bypass the cache: for a copy nobody reads soon (the originals an
 * in-place call saves in case it fails, final values of a tensor larger than the cache),
 * so the destination costs no read from memory and evicts nothing the call is about to
 * use. Its stores are weakly ordered: udt_uncached_fence() before another thread reads. */
void udt_copy_uncached(void *dst, const void *src, size_t bytes);
void udt_uncached_fence(void);

uint16_t udt_float_to_half(float value);
float udt_half_to_float(uint16_t bits);
uint16_t udt_float_to_bfloat16(float value);
float udt_bfloat16_to_float(uint16_t bits);

#endif
