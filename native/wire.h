/* Wire format of every ud_transport datagram: one fixed header, then payload.
 * All fields are little-endian on the wire; encode/decode convert explicitly so
 * the format does not depend on the host. */
#ifndef UDT_WIRE_H
#define UDT_WIRE_H

#include <stdint.h>
#include <string.h>

#define UDT_WIRE_MAGIC 0x31544455u /* "UDT1" read as little-endian */
#define UDT_WIRE_VERSION 6u
#define UDT_WIRE_HEADER_BYTES 44u
#define UDT_NO_RANK 0xFFFFu

enum udt_kind {
    UDT_KIND_DATA = 1,   /* a chunk of a segment */
    UDT_KIND_END = 2,    /* sender finished a step: missing chunks of it are lost */
    UDT_KIND_CREDIT = 3, /* receiver -> a sender: you may send positions < credit */
    UDT_KIND_AGREE = 4,  /* the verdict round: this rank's outcome (payload: struct udt_verdict) */
    UDT_KIND_JOIN = 5,  /* "I am in call `sequence`": asked of a peer not heard from, answered at once;
                         * credit: steps of ours to the receiver that it gets nothing more of */
};

/* flags of an AGREE datagram (every other kind has flags 0) */
#define UDT_AGREE_HAVE_YOURS 1u /* the acknowledgement: the sender has decided this call (holding the receiver's
                                 * verdict, or deciding without it at its deadline) */
#define UDT_AGREE_REPLY 2u      /* an answer: not answered, unless it brings what the receiver must act on (verdict.c) */
#define UDT_AGREE_RELAYED 4u    /* the payload is another rank's verdict (that rank in chunk_index), passed on to a
                                 * rank that said it lacks it; always with REPLY */
#define UDT_AGREE_HOLDING 8u    /* the sender holds what it needs of the receiver: its verdict (undecided), or with
                                 * HAVE_YOURS its acknowledgement too (a decided receiver still answers a
                                 * request: the sender lacks its acknowledgement) */
#define UDT_AGREE_AGAIN 16u     /* the sender's verdict went to the receiver before in this call: a verdict that first
                                 * comes with it lost its first copy (recent_loss.c), and a request with it that lacks
                                 * what the receiver sent an interval before tells the receiver of loss (verdict.c) */
#define UDT_AGREE_FLAGS (UDT_AGREE_HAVE_YOURS | UDT_AGREE_REPLY | UDT_AGREE_RELAYED | UDT_AGREE_HOLDING | UDT_AGREE_AGAIN)
/* flags of a JOIN datagram: 0 asks "are you in this call?", REPLY answers it */
#define UDT_JOIN_REPLY 2u
#define UDT_VERDICT_BYTES 32u

struct udt_wire_header {
    uint32_t magic;
    uint8_t version;
    uint8_t kind;
    uint8_t phase;          /* enum udt_phase (schedule.h): the half of the schedule a DATA/END step is in */
    uint8_t flags;          /* AGREE and JOIN only; 0 otherwise */
    uint64_t session_id;    /* random, agreed at rendezvous */
    uint32_t sequence;      /* collective call number on this communicator */
    uint16_t step;          /* step of the schedule (the receiver's step has the same index) */
    uint16_t source_rank;
    uint32_t chunk_index;   /* chunk within the segment; AGREE: the rank whose verdict the sender lacks + 1
                             * (0: none), or a relay's original rank */
    uint16_t contributions; /* how many ranks' inputs the payload sums */
    uint16_t reserved;      /* must be 0 */
    uint32_t payload_bytes;
    uint32_t layout_tag;    /* hash of collective, algorithm, element count, dtype, op, root, chunk size */
    uint32_t credit;        /* CREDIT: first position the sender may not send;
                             * DATA: how many chunks the sender sends in this step;
                             * JOIN: the sender's steps to the receiver below this are all sent */
};

static inline void udt_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void udt_put32(uint8_t *p, uint32_t v) { udt_put16(p, (uint16_t)v); udt_put16(p + 2, (uint16_t)(v >> 16)); }
static inline void udt_put64(uint8_t *p, uint64_t v) { udt_put32(p, (uint32_t)v); udt_put32(p + 4, (uint32_t)(v >> 32)); }
static inline uint16_t udt_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t udt_get32(const uint8_t *p) { return udt_get16(p) | ((uint32_t)udt_get16(p + 2) << 16); }
static inline uint64_t udt_get64(const uint8_t *p) { return udt_get32(p) | ((uint64_t)udt_get32(p + 4) << 32); }

static inline void udt_wire_encode(const struct udt_wire_header *h, uint8_t out[UDT_WIRE_HEADER_BYTES])
{
    udt_put32(out + 0, h->magic);
    out[4] = h->version;
    out[5] = h->kind;
    out[6] = h->phase;
    out[7] = h->flags;
    udt_put64(out + 8, h->session_id);
    udt_put32(out + 16, h->sequence);
    udt_put16(out + 20, h->step);
    udt_put16(out + 22, h->source_rank);
    udt_put32(out + 24, h->chunk_index);
    udt_put16(out + 28, h->contributions);
    udt_put16(out + 30, h->reserved);
    udt_put32(out + 32, h->payload_bytes);
    udt_put32(out + 36, h->layout_tag);
    udt_put32(out + 40, h->credit);
}

/* Returns 0 when the bytes are long enough to hold a header, -1 otherwise.
 * Field validation is the engine's job: it knows what is in range. */
static inline int udt_wire_decode(const uint8_t *in, uint32_t len, struct udt_wire_header *h)
{
    if (len < UDT_WIRE_HEADER_BYTES)
        return -1;
    h->magic = udt_get32(in + 0);
    h->version = in[4];
    h->kind = in[5];
    h->phase = in[6];
    h->flags = in[7];
    h->session_id = udt_get64(in + 8);
    h->sequence = udt_get32(in + 16);
    h->step = udt_get16(in + 20);
    h->source_rank = udt_get16(in + 22);
    h->chunk_index = udt_get32(in + 24);
    h->contributions = udt_get16(in + 28);
    h->reserved = udt_get16(in + 30);
    h->payload_bytes = udt_get32(in + 32);
    h->layout_tag = udt_get32(in + 36);
    h->credit = udt_get32(in + 40);
    return 0;
}

/* Payload of an AGREE datagram: what one rank saw of a call. */
struct udt_verdict {
    uint32_t cause;            /* 0, or (severity << 16) | rank blamed; see verdict.c */
    uint32_t agree_value;      /* the caller's value for agree() */
    uint64_t reduce_weighted;  /* sum over the rank's own shard of contributions x elements */
    uint64_t fresh_elements;   /* elements of the rank's output that are fresh */
    double loss_budget;
};

static inline void udt_verdict_encode(const struct udt_verdict *v, uint8_t out[UDT_VERDICT_BYTES])
{
    uint64_t budget_bits;
    memcpy(&budget_bits, &v->loss_budget, 8);
    udt_put32(out, v->cause);
    udt_put32(out + 4, v->agree_value);
    udt_put64(out + 8, v->reduce_weighted);
    udt_put64(out + 16, v->fresh_elements);
    udt_put64(out + 24, budget_bits);
}

static inline void udt_verdict_decode(const uint8_t in[UDT_VERDICT_BYTES], struct udt_verdict *v)
{
    uint64_t budget_bits = udt_get64(in + 24);
    v->cause = udt_get32(in);
    v->agree_value = udt_get32(in + 4);
    v->reduce_weighted = udt_get64(in + 8);
    v->fresh_elements = udt_get64(in + 16);
    memcpy(&v->loss_budget, &budget_bits, 8);
}
#endif
