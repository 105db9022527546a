/* Loss injection: a wrapper that drops received datagrams by a seeded model, for tests and
 * the simulator. */
#ifndef UDT_TRANSPORT_LOSSY_H
#define UDT_TRANSPORT_LOSSY_H

#include <stdint.h>

#include "transport.h"

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

#endif
