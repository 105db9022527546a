#include "verbs_probe.h"

#include <infiniband/verbs.h>

int udt_verbs_active_device_count(void)
{
    int count = 0, active = 0;
    struct ibv_device **devices = ibv_get_device_list(&count);
    if (!devices)
        return 0; /* ENOSYS without kernel support: simply no devices */
    for (int i = 0; i < count; i++) {
        struct ibv_context *context = ibv_open_device(devices[i]);
        if (!context)
            continue;
        struct ibv_device_attr device_attr;
        if (ibv_query_device(context, &device_attr) == 0) {
            for (int port = 1; port <= device_attr.phys_port_cnt; port++) {
                struct ibv_port_attr port_attr;
                if (ibv_query_port(context, (uint8_t)port, &port_attr) == 0 && port_attr.state == IBV_PORT_ACTIVE) {
                    active++;
                    break;
                }
            }
        }
        ibv_close_device(context);
    }
    ibv_free_device_list(devices);
    return active;
}
