/* Finding 8 of issue 10: the element-wise kernels read the wire payload and
 * write the caller's tensor at any byte offset. Built with
 * -fsanitize=undefined -fno-sanitize-recover=all, a misaligned typed load
 * aborts; the kernels must use memcpy loads. Checks values too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "elementwise.h"

#define COUNT 37

static int check(int dtype, size_t offset)
{
    size_t wire = udt_wire_elem_bytes(dtype), accum_bytes = udt_accum_elem_bytes(dtype);
    /* malloc'd then offset: the element starts at `offset` bytes past an aligned address */
    unsigned char *input = malloc(COUNT * wire + 16), *payload = malloc(COUNT * wire + 16), *output = malloc(COUNT * wire + 16);
    double *accum = malloc(COUNT * sizeof(double)); /* ours: aligned, like the engine's scratch */
    float *source = malloc(COUNT * sizeof(float));
    if (!input || !payload || !output || !accum || !source)
        return 1;
    for (size_t i = 0; i < COUNT; i++)
        source[i] = (float)((int)(i % 7) - 3);
    udt_pack(dtype, input + offset, source, 0); /* count 0: nothing */
    /* wire values: pack from a float (or double) accumulator */
    if (accum_bytes == 8) {
        for (size_t i = 0; i < COUNT; i++) accum[i] = source[i];
    } else if (dtype == UDT_INT32) {
        for (size_t i = 0; i < COUNT; i++) ((int *)accum)[i] = (int)source[i];
    } else {
        memcpy(accum, source, COUNT * sizeof(float));
    }
    udt_pack(dtype, input + offset, accum, COUNT);
    udt_pack(dtype, payload + offset, accum, COUNT);
    udt_load(dtype, accum, input + offset, COUNT);             /* accum = x */
    udt_add(dtype, accum, payload + offset, COUNT);            /* accum = 2x */
    udt_add_into(dtype, accum, input + offset, payload + offset, COUNT); /* accum = 2x */
    udt_unpack(dtype, accum, payload + offset, COUNT);         /* accum = x */
    udt_add(dtype, accum, payload + offset, COUNT);            /* accum = 2x */
    udt_store(dtype, output + offset, accum, COUNT, 1.5);      /* out = 3x */
    udt_rescale_wire(dtype, output + offset, COUNT, 2.0);      /* out = 6x */
    udt_store(dtype, input + offset, accum, COUNT, 1.0);       /* in = 2x */
    udt_load(dtype, accum, output + offset, COUNT);
    int bad = 0;
    for (size_t i = 0; i < COUNT; i++) {
        double got = accum_bytes == 8 ? accum[i] : dtype == UDT_INT32 ? ((int *)accum)[i] : ((float *)accum)[i];
        if (got != 6.0 * source[i]) {
            fprintf(stderr, "dtype %d offset %zu element %zu: %g, want %g\n", dtype, offset, i, got, 6.0 * source[i]);
            bad = 1;
            break;
        }
    }
    free(input);
    free(payload);
    free(output);
    free(accum);
    free(source);
    return bad;
}

int main(void)
{
    int bad = 0;
    for (int dtype = 0; dtype < UDT_DTYPE_COUNT; dtype++)
        for (size_t offset = 0; offset < 8; offset++)
            bad |= check(dtype, offset);
    if (!bad)
        printf("all kernels correct at every byte offset\n");
    return bad;
}
