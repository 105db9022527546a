# Declarations of the verbs UD transport and the device probe (native/transport_verbs.c,
# native/verbs_probe.c): compiled into ud_transport._verbs only, which links libibverbs.
from libc.stdint cimport uint8_t, uint32_t

from transport_io cimport udt_error, udt_transport

cdef extern from "verbs_probe.h" nogil:
    int udt_verbs_active_device_count()

cdef extern from "transport_verbs.h" nogil:
    enum:
        UDT_VERBS_ADDRESS_BYTES

    struct udt_verbs_config:
        const char *device
        uint8_t port
        int gid_index
        uint32_t qkey
        uint32_t max_datagram_bytes
        uint32_t send_depth
        uint32_t recv_depth
        uint32_t signal_every
        uint32_t spin_us

    udt_transport *udt_verbs_open(const udt_verbs_config *config, udt_error *error)
