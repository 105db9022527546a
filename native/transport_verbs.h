/* The verbs UD transport (transport_verbs.c), built only into the optional
 * extension ud_transport._verbs, which links libibverbs. */
#ifndef UDT_TRANSPORT_VERBS_H
#define UDT_TRANSPORT_VERBS_H

#include "transport.h"

/* RDMA verbs, Unreliable Datagram: one UD QP on a given device, port and GID
 * index (ud_transport's Python layer chooses them; see transports.py). Its
 * address is GID(16) + QPN(4) + LID(2) + Q_Key(4), integers little-endian.
 * max_datagram_bytes is the port's active MTU (or less if capped): a UD send
 * larger than the path MTU completes successfully and sends nothing. */
#define UDT_VERBS_ADDRESS_BYTES 26u
struct udt_verbs_config {
    const char *device;          /* e.g. "rxe0", "mlx5_0" */
    uint8_t port;                /* 1-based */
    int gid_index;               /* source GID (RoCE: the RoCEv2 entry of the interface) */
    uint32_t qkey;               /* below 0x80000000 (not privileged); the same on every rank */
    uint32_t max_datagram_bytes; /* 0 = the port's active MTU; less caps it, more is refused */
    uint32_t send_depth;         /* registered send ring slots (0 = 512) */
    uint32_t recv_depth;         /* posted receives (0 = 1024); must cover the engine's window */
    uint32_t signal_every;       /* one signalled send per this many (0 = 32) */
    uint32_t spin_us;            /* wait() polls this long before sleeping on the completion channel */
};
struct udt_transport *udt_verbs_open(const struct udt_verbs_config *config, struct udt_error *error);

#endif
