/* The one interface every datagram transport implements (UDP, verbs UD, the
 * loss-injection wrapper). The ring engine knows nothing else about them.
 *
 * Contract:
 *  - send_batch is done with the header and payload memory when it returns
 *    (it copies or completes), and never blocks: it returns how many it
 *    queued, possibly 0, or -errno.
 *  - recv_batch never blocks; the items it returns stay valid until the next
 *    recv_batch call on the same transport.
 *  - wait blocks up to timeout_us until a receive is likely to succeed.
 *  - A datagram's sender is identified by the transport (peer index), not
 *    trusted from the payload; -1 means "not one of our peers". */
#ifndef UDT_TRANSPORT_H
#define UDT_TRANSPORT_H

#include <stdint.h>

#define UDT_ADDRESS_MAX 64

struct udt_send_item {
    uint32_t peer;
    const void *header;
    uint32_t header_bytes;
    const void *payload;
    uint32_t payload_bytes;
};

struct udt_recv_item {
    const uint8_t *data;
    uint32_t bytes;
    int32_t peer;
};

struct udt_transport;

struct udt_transport_ops {
    const char *name;
    int (*set_peers)(struct udt_transport *t, const uint8_t *addresses, uint32_t address_bytes, uint32_t count);
    int (*send_batch)(struct udt_transport *t, const struct udt_send_item *items, int count);
    int (*recv_batch)(struct udt_transport *t, struct udt_recv_item *items, int max_items);
    int (*wait)(struct udt_transport *t, int timeout_us);
    void (*destroy)(struct udt_transport *t);
};

struct udt_transport {
    const struct udt_transport_ops *ops;
    uint32_t max_datagram_bytes; /* header + payload that one datagram can carry */
    uint32_t address_bytes;
    uint8_t address[UDT_ADDRESS_MAX]; /* what peers need to reach us */
    uint64_t counter_injected_drops; /* filled by the loss-injection wrapper */
    char error[256];
};

static inline int udt_transport_set_peers(struct udt_transport *t, const uint8_t *a, uint32_t b, uint32_t n) { return t->ops->set_peers(t, a, b, n); }
static inline int udt_transport_send(struct udt_transport *t, const struct udt_send_item *i, int n) { return t->ops->send_batch(t, i, n); }
static inline int udt_transport_recv(struct udt_transport *t, struct udt_recv_item *i, int n) { return t->ops->recv_batch(t, i, n); }
static inline int udt_transport_wait(struct udt_transport *t, int us) { return t->ops->wait(t, us); }
static inline void udt_transport_destroy(struct udt_transport *t) { if (t) t->ops->destroy(t); }

/* UDP: one non-blocking socket bound to bind_ipv4:port (port 0 picks one). */
struct udt_transport *udt_udp_open(const char *bind_ipv4, uint16_t port, uint32_t socket_buffer_bytes, char *error, int error_bytes);

/* Seeded loss injection in front of another transport's receive path. */
enum udt_loss_kind { UDT_LOSS_NONE = 0, UDT_LOSS_BERNOULLI = 1, UDT_LOSS_GILBERT_ELLIOTT = 2 };
struct udt_loss_model {
    int kind;
    double loss;            /* Bernoulli: drop probability */
    double good_to_bad;     /* Gilbert-Elliott: per-datagram transition probabilities */
    double bad_to_good;
    double loss_in_good;
    double loss_in_bad;
    uint64_t seed;
};
struct udt_transport *udt_lossy_wrap(struct udt_transport *inner, const struct udt_loss_model *model);

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
struct udt_transport *udt_verbs_open(const struct udt_verbs_config *config, char *error, int error_bytes);

#endif
