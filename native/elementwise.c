#include "elementwise.h"

#include <math.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

size_t udt_wire_elem_bytes(int dtype)
{
    switch (dtype) {
    case UDT_FLOAT64: return 8;
    case UDT_FLOAT16:
    case UDT_BFLOAT16: return 2;
    default: return 4;
    }
}

size_t udt_accum_elem_bytes(int dtype) { return dtype == UDT_FLOAT64 ? 8 : 4; }

static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* IEEE binary16, round to nearest even, with subnormals, infinities and NaN. */
uint16_t udt_float_to_half(float value)
{
    uint32_t x = float_bits(value);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or nan */
        return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0);
    if (abs >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return sign | 0x7c00u;
    if (abs < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (abs < 0x33000000u)
            return sign;
        uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - (abs >> 23); /* 14..24: value * 2^24 */
        uint32_t half = mantissa >> shift;
        uint32_t rest = mantissa & ((1u << shift) - 1);
        uint32_t midpoint = 1u << (shift - 1);
        if (rest > midpoint || (rest == midpoint && (half & 1)))
            half++;
        return sign | (uint16_t)half;
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u); /* round to nearest even at bit 13 */
    return sign | (uint16_t)((rounded - 0x38000000u) >> 13);
}

float udt_half_to_float(uint16_t bits)
{
    uint32_t sign = (uint32_t)(bits & 0x8000u) << 16;
    uint32_t exponent = (bits >> 10) & 0x1fu;
    uint32_t mantissa = bits & 0x3ffu;
    if (exponent == 0x1f)
        return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        float magnitude = (float)mantissa * (1.0f / 16777216.0f); /* 2^-24 */
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t udt_float_to_bfloat16(float value)
{
    uint32_t x = float_bits(value);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* keep NaN a NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float udt_bfloat16_to_float(uint16_t bits) { return bits_float((uint32_t)bits << 16); }

/* The caller's tensor and the wire payload may sit at any byte offset (a
 * datagram's payload follows a 44-byte header; numpy views can start
 * anywhere), so every access to them goes through memcpy: defined for any
 * alignment, and a plain load or store once compiled. The accumulator is
 * ours (malloc'd, element-aligned). */
static inline uint16_t get_u16(const void *p, size_t i) { uint16_t v; memcpy(&v, (const uint8_t *)p + 2 * i, 2); return v; }
static inline uint32_t get_u32(const void *p, size_t i) { uint32_t v; memcpy(&v, (const uint8_t *)p + 4 * i, 4); return v; }
static inline float get_f32(const void *p, size_t i) { float v; memcpy(&v, (const uint8_t *)p + 4 * i, 4); return v; }
static inline double get_f64(const void *p, size_t i) { double v; memcpy(&v, (const uint8_t *)p + 8 * i, 8); return v; }
static inline int32_t get_i32(const void *p, size_t i) { int32_t v; memcpy(&v, (const uint8_t *)p + 4 * i, 4); return v; }
static inline void put_u16(void *p, size_t i, uint16_t v) { memcpy((uint8_t *)p + 2 * i, &v, 2); }
static inline void put_f32(void *p, size_t i, float v) { memcpy((uint8_t *)p + 4 * i, &v, 4); }
static inline void put_f64(void *p, size_t i, double v) { memcpy((uint8_t *)p + 8 * i, &v, 8); }
static inline void put_i32(void *p, size_t i, int32_t v) { memcpy((uint8_t *)p + 4 * i, &v, 4); }

void udt_load(int dtype, void *accum, const void *src, size_t count)
{
    float *acc = accum;
    switch (dtype) {
    case UDT_FLOAT16:
        for (size_t i = 0; i < count; i++) acc[i] = udt_half_to_float(get_u16(src, i));
        break;
    case UDT_BFLOAT16:
        for (size_t i = 0; i < count; i++) acc[i] = udt_bfloat16_to_float(get_u16(src, i));
        break;
    default:
        memcpy(accum, src, count * udt_wire_elem_bytes(dtype));
    }
}

void udt_pack(int dtype, void *wire, const void *accum, size_t count)
{
    const float *acc = accum;
    switch (dtype) {
    case UDT_FLOAT16:
        for (size_t i = 0; i < count; i++) put_u16(wire, i, udt_float_to_half(acc[i]));
        break;
    case UDT_BFLOAT16:
        for (size_t i = 0; i < count; i++) put_u16(wire, i, udt_float_to_bfloat16(acc[i]));
        break;
    default:
        memcpy(wire, accum, count * udt_wire_elem_bytes(dtype));
    }
}

void udt_unpack(int dtype, void *accum, const void *wire, size_t count) { udt_load(dtype, accum, wire, count); }

void udt_add(int dtype, void *accum, const void *wire, size_t count)
{
    switch (dtype) {
    case UDT_FLOAT32: {
        float *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] += get_f32(wire, i);
        break;
    }
    case UDT_FLOAT64: {
        double *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] += get_f64(wire, i);
        break;
    }
    case UDT_FLOAT16: {
        float *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] += udt_half_to_float(get_u16(wire, i));
        break;
    }
    case UDT_BFLOAT16: {
        float *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] += udt_bfloat16_to_float(get_u16(wire, i));
        break;
    }
    case UDT_INT32: {
        /* unsigned arithmetic: wraps like numpy and torch, without undefined behaviour */
        uint32_t *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] += get_u32(wire, i);
        break;
    }
    }
}

void udt_add_into(int dtype, void *accum, const void *input, const void *wire, size_t count)
{
    switch (dtype) {
    case UDT_FLOAT32: {
        float *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] = get_f32(input, i) + get_f32(wire, i);
        break;
    }
    case UDT_FLOAT64: {
        double *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] = get_f64(input, i) + get_f64(wire, i);
        break;
    }
    case UDT_FLOAT16: {
        float *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] = udt_half_to_float(get_u16(input, i)) + udt_half_to_float(get_u16(wire, i));
        break;
    }
    case UDT_BFLOAT16: {
        float *restrict acc = accum;
        for (size_t i = 0; i < count; i++)
            acc[i] = udt_bfloat16_to_float(get_u16(input, i)) + udt_bfloat16_to_float(get_u16(wire, i));
        break;
    }
    case UDT_INT32: {
        uint32_t *restrict acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] = get_u32(input, i) + get_u32(wire, i);
        break;
    }
    }
}

static inline int32_t round_to_int32(double value)
{
    double r = nearbyint(value);
    if (r >= 2147483647.0) return INT32_MAX;
    if (r <= -2147483648.0) return INT32_MIN;
    if (r != r) return 0;
    return (int32_t)r;
}

void udt_scale(int dtype, void *accum, size_t count, double factor)
{
    if (factor == 1.0)
        return;
    if (dtype == UDT_FLOAT64) {
        double *acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] *= factor;
    } else if (dtype == UDT_INT32) {
        int32_t *acc = accum;
        for (size_t i = 0; i < count; i++) acc[i] = round_to_int32(acc[i] * factor);
    } else {
        float *acc = accum;
        float f = (float)factor;
        for (size_t i = 0; i < count; i++) acc[i] *= f;
    }
}

/* data is the caller's tensor here: any alignment */
void udt_rescale_wire(int dtype, void *data, size_t count, double factor)
{
    if (factor == 1.0)
        return;
    if (factor == 0.0) {
        memset(data, 0, count * udt_wire_elem_bytes(dtype));
        return;
    }
    float f = (float)factor;
    switch (dtype) {
    case UDT_FLOAT16:
        for (size_t i = 0; i < count; i++) put_u16(data, i, udt_float_to_half(udt_half_to_float(get_u16(data, i)) * f));
        break;
    case UDT_BFLOAT16:
        for (size_t i = 0; i < count; i++) put_u16(data, i, udt_float_to_bfloat16(udt_bfloat16_to_float(get_u16(data, i)) * f));
        break;
    case UDT_FLOAT64:
        for (size_t i = 0; i < count; i++) put_f64(data, i, get_f64(data, i) * factor);
        break;
    case UDT_INT32:
        for (size_t i = 0; i < count; i++) put_i32(data, i, round_to_int32(get_i32(data, i) * factor));
        break;
    default:
        for (size_t i = 0; i < count; i++) put_f32(data, i, get_f32(data, i) * f);
    }
}

void udt_store(int dtype, void *dst, const void *accum, size_t count, double factor)
{
    if (factor == 0.0) {
        memset(dst, 0, count * udt_wire_elem_bytes(dtype));
        return;
    }
    switch (dtype) {
    case UDT_FLOAT32: {
        const float *acc = accum;
        float f = (float)factor;
        if (factor == 1.0) memcpy(dst, acc, count * 4);
        else for (size_t i = 0; i < count; i++) put_f32(dst, i, acc[i] * f);
        break;
    }
    case UDT_FLOAT64: {
        const double *acc = accum;
        if (factor == 1.0) memcpy(dst, acc, count * 8);
        else for (size_t i = 0; i < count; i++) put_f64(dst, i, acc[i] * factor);
        break;
    }
    case UDT_FLOAT16: {
        const float *acc = accum;
        float f = (float)factor;
        for (size_t i = 0; i < count; i++) put_u16(dst, i, udt_float_to_half(acc[i] * f));
        break;
    }
    case UDT_BFLOAT16: {
        const float *acc = accum;
        float f = (float)factor;
        for (size_t i = 0; i < count; i++) put_u16(dst, i, udt_float_to_bfloat16(acc[i] * f));
        break;
    }
    case UDT_INT32: {
        const int32_t *acc = accum;
        if (factor == 1.0) memcpy(dst, acc, count * 4);
        else for (size_t i = 0; i < count; i++) put_i32(dst, i, round_to_int32(acc[i] * factor));
        break;
    }
    }
}

void udt_copy_uncached(void *dst, const void *src, size_t bytes)
{
#if defined(__SSE2__)
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* streaming stores need 16-byte aligned targets */
    if (head > bytes)
        head = bytes;
    memcpy(d, s, head);
    d += head, s += head, bytes -= head;
    for (; bytes >= 64; bytes -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 32)), f = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), e);
        _mm_stream_si128((__m128i *)(d + 48), f);
    }
    memcpy(d, s, bytes);
#else
    memcpy(dst, src, bytes);
#endif
}

void udt_uncached_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}
