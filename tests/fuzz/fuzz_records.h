/* The records both fuzz harnesses read from their input, one datagram each:
 * [flags][selector][length lo][length hi][bytes]. */
#ifndef FUZZ_RECORDS_H
#define FUZZ_RECORDS_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

struct fuzz_record {
    uint8_t flags, selector;
    uint32_t length; /* cut to what the input has left and to the harness's largest datagram */
    const uint8_t *bytes;
};

/* The record at *at, which moves past it; 0 when no record is left. */
static inline int fuzz_next_record(const uint8_t *data, size_t size, size_t *at, uint32_t max_length,
                                   struct fuzz_record *record)
{
    if (*at + 4 > size)
        return 0;
    record->flags = data[*at];
    record->selector = data[*at + 1];
    uint32_t length = (uint32_t)data[*at + 2] | (uint32_t)data[*at + 3] << 8;
    *at += 4;
    if (length > size - *at)
        length = (uint32_t)(size - *at);
    if (length > max_length)
        length = max_length;
    record->length = length;
    record->bytes = data + *at;
    *at += length;
    return 1;
}

/* A record's datagram read as a header of this session's wire format, the rest as the fuzzer
 * wrote it: the harness then fixes up what it chooses to. */
static inline void fuzz_header_of(const uint8_t *datagram, uint32_t length, uint64_t session,
                                  struct udt_wire_header *h)
{
    udt_wire_decode(datagram, length, h);
    h->magic = UDT_WIRE_MAGIC;
    h->version = UDT_WIRE_VERSION;
    h->session_id = session;
}

#endif
