# The datagram transport interface (native/transport.h) and the wire header (native/wire.h):
# header-only, so both extensions cimport it without linking each other's C code.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t

cdef extern from "error.h" nogil:
    struct udt_error:
        char call[40]
        int errno_value
        char object[160]
        char detail[160]
        char message[400]

cdef extern from "transport.h" nogil:
    struct udt_transport:
        uint32_t max_datagram_bytes
        uint32_t address_bytes
        uint8_t address[64]
        uint64_t counter_injected_drops
        udt_error error

    struct udt_send_item:
        uint32_t peer
        const void *header
        uint32_t header_bytes
        const void *payload
        uint32_t payload_bytes
        uint32_t flags

    struct udt_recv_item:
        const uint8_t *data
        uint32_t bytes
        int32_t peer

    # static inline calls through the transport's vtable
    int udt_transport_set_peers(udt_transport *t, const uint8_t *a, uint32_t b, uint32_t n)
    int udt_transport_send(udt_transport *t, const udt_send_item *i, int n)
    int udt_transport_recv(udt_transport *t, udt_recv_item *i, int n)
    int udt_transport_wait(udt_transport *t, int us)
    void udt_transport_destroy(udt_transport *t)

    const char *UDT_TRANSPORT_CAPSULE
    const char *UDT_TRANSPORT_CAPSULE_ADOPTED

cdef extern from "wire.h" nogil:
    enum:
        UDT_WIRE_HEADER_BYTES
        UDT_WIRE_MAGIC
        UDT_WIRE_VERSION

    enum:
        UDT_KIND_DATA
        UDT_KIND_END
        UDT_KIND_CREDIT
        UDT_KIND_AGREE
        UDT_KIND_JOIN

    struct udt_wire_header:
        uint32_t magic
        uint8_t version
        uint8_t kind
        uint8_t phase
        uint8_t flags
        uint64_t session_id
        uint32_t sequence
        uint16_t step
        uint16_t source_rank
        uint32_t chunk_index
        uint16_t contributions
        uint16_t reserved
        uint32_t payload_bytes
        uint32_t layout_tag
        uint32_t credit

    void udt_wire_encode(const udt_wire_header *h, uint8_t *out)
    int udt_wire_decode(const uint8_t *data, uint32_t length, udt_wire_header *h)
