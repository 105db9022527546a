/* Is there an RDMA device with an active port? Used by transport="auto". */
#ifndef UDT_VERBS_PROBE_H
#define UDT_VERBS_PROBE_H

/* Returns the number of devices with at least one ACTIVE port (0 when the
 * kernel has no RDMA, as on most CI machines). */
int udt_verbs_active_device_count(void);

#endif
