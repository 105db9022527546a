# Devices and their Context: discovery, ports, GID tables, and the choice of
# device, port and GID index that ud_transport makes when none is given.
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy
import ipaddress as _ipaddress

from libibverbs cimport *

MTU_BYTES = {IBV_MTU_256: 256, IBV_MTU_512: 512, IBV_MTU_1024: 1024, IBV_MTU_2048: 2048, IBV_MTU_4096: 4096}
PORT_STATES = {IBV_PORT_NOP: "NOP", IBV_PORT_DOWN: "DOWN", IBV_PORT_INIT: "INIT", IBV_PORT_ARMED: "ARMED",
               IBV_PORT_ACTIVE: "ACTIVE", IBV_PORT_ACTIVE_DEFER: "ACTIVE_DEFER"}
LINK_LAYERS = {IBV_LINK_LAYER_UNSPECIFIED: "unspecified", IBV_LINK_LAYER_INFINIBAND: "InfiniBand",
               IBV_LINK_LAYER_ETHERNET: "Ethernet"}
GID_TYPES = {IBV_GID_TYPE_IB: "IB", IBV_GID_TYPE_ROCE_V1: "RoCEv1", IBV_GID_TYPE_ROCE_V2: "RoCEv2"}
PORT_ACTIVE = IBV_PORT_ACTIVE


def format_gid(bytes gid):
    """A GID as text: IPv4-mapped ones as ::ffff:a.b.c.d, others as IPv6."""
    address = _ipaddress.IPv6Address(gid)
    return f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped is not None else str(address)


def gid_ipv4(bytes gid):
    """The IPv4 address inside an IPv4-mapped GID, or None."""
    mapped = _ipaddress.IPv6Address(gid).ipv4_mapped
    return str(mapped) if mapped is not None else None


def device_names():
    """Names of the RDMA devices libibverbs sees ([] when the kernel has no RDMA)."""
    cdef int count = 0
    cdef ibv_device **devices
    with nogil:
        devices = ibv_get_device_list(&count)
    if devices is NULL:
        return []
    try:
        return [ibv_get_device_name(devices[i]).decode() for i in range(count)]
    finally:
        ibv_free_device_list(devices)


cdef class Context:
    """An open RDMA device (ibv_context) for queries. Context() opens the first device;
    close() is idempotent, `with` closes, and a closed Context refuses queries."""
    cdef ibv_context *context
    cdef readonly str name

    def __init__(self, name=None):
        cdef int count = 0
        cdef ibv_device **devices
        with nogil:
            devices = ibv_get_device_list(&count)
        if devices is NULL:
            err = _verbs_errno(-1)
            detail = "this kernel has no RDMA support (no ib_uverbs)" if err == _errno.ENOSYS else None
            raise verbs_error("ibv_get_device_list", err, f"dev={name or 'any'}", detail)
        try:
            names = [ibv_get_device_name(devices[i]).decode() for i in range(count)]
            if name is None and names:
                name = names[0]
            if name not in names:
                raise verbs_error("ibv_open_device", _errno.ENODEV, f"dev={name or 'any'}",
                                  f"no such device; devices here: {', '.join(names) or 'none'}")
            index = names.index(name)
            self.context = ibv_open_device(devices[index])
            if self.context is NULL:
                raise verbs_error("ibv_open_device", _verbs_errno(-1), f"dev={name}")
            self.name = name
        finally:
            ibv_free_device_list(devices)

    @property
    def closed(self):
        return self.context is NULL

    def _check_open(self):
        if self.context is NULL:
            raise ValueError("Context is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the device."""
        if self.context is NULL:
            return
        rc = ibv_close_device(self.context)
        self.context = NULL
        if rc:
            raise verbs_error("ibv_close_device", _verbs_errno(rc), f"dev={self.name}")

    def __dealloc__(self):
        if self.context is not NULL:
            ibv_close_device(self.context)
            self.context = NULL

    def query_device(self):
        cdef ibv_device_attr attr
        self._check_open()
        rc = ibv_query_device(self.context, &attr)
        if rc:
            raise verbs_error("ibv_query_device", _verbs_errno(rc), f"dev={self.name}")
        return {"fw_ver": attr.fw_ver.decode(errors="replace"), "vendor_id": attr.vendor_id,
                "vendor_part_id": attr.vendor_part_id, "phys_port_cnt": attr.phys_port_cnt,
                "max_qp": attr.max_qp, "max_qp_wr": attr.max_qp_wr, "max_cq": attr.max_cq, "max_cqe": attr.max_cqe,
                "max_mr": attr.max_mr, "max_pd": attr.max_pd, "max_ah": attr.max_ah, "max_sge": attr.max_sge}

    def query_port(self, int port):
        cdef ibv_port_attr attr
        self._check_open()
        if not 1 <= port <= 255:
            raise verbs_error("ibv_query_port", _errno.EINVAL, f"dev={self.name} port={port}", "ports are numbered from 1")
        memset(&attr, 0, sizeof(attr))
        rc = ibv_query_port(self.context, <uint8_t>port, &attr)
        if rc:
            ports = self.query_device()["phys_port_cnt"]
            raise verbs_error("ibv_query_port", _verbs_errno(rc), f"dev={self.name} port={port}",
                              f"the device has {ports} port{'s' if ports != 1 else ''}")
        return {"state": attr.state, "state_name": PORT_STATES.get(attr.state, str(attr.state)),
                "active_mtu": MTU_BYTES.get(attr.active_mtu, 0), "max_mtu": MTU_BYTES.get(attr.max_mtu, 0),
                "gid_tbl_len": attr.gid_tbl_len, "lid": attr.lid, "max_msg_sz": attr.max_msg_sz,
                "link_layer": LINK_LAYERS.get(attr.link_layer, str(attr.link_layer))}

    def query_gid(self, int port, int index):
        """(GID bytes, type name) of one GID table entry."""
        cdef ibv_gid_entry entry
        self._check_open()
        if index < 0:
            raise verbs_error("ibv_query_gid_ex", _errno.EINVAL, f"dev={self.name} port={port} gid_index={index}")
        rc = ibv_query_gid_ex(self.context, port, index, &entry, 0)
        if rc:
            raise verbs_error("ibv_query_gid_ex", _verbs_errno(rc), f"dev={self.name} port={port} gid_index={index}",
                              "no such GID table entry")
        return bytes(entry.gid.raw[:16]), GID_TYPES.get(entry.gid_type, str(entry.gid_type))

    def gid_table(self):
        """Every valid GID entry of every port: [{port, index, gid, type}]."""
        cdef ibv_gid_entry *entries
        cdef ssize_t count
        self._check_open()
        ports = self.query_device()["phys_port_cnt"]
        size = sum(max(self.query_port(p)["gid_tbl_len"], 0) for p in range(1, ports + 1))
        if size == 0:
            return []
        entries = <ibv_gid_entry *>malloc(size * sizeof(ibv_gid_entry))
        if entries is NULL:
            raise MemoryError()
        try:
            count = ibv_query_gid_table(self.context, entries, size, 0)
            if count < 0:
                raise verbs_error("ibv_query_gid_table", <int>-count, f"dev={self.name}")
            table = []
            for i in range(count):
                table.append({"port": entries[i].port_num, "index": entries[i].gid_index,
                              "gid": bytes(entries[i].gid.raw[:16]),
                              "type": GID_TYPES.get(entries[i].gid_type, str(entries[i].gid_type))})
            return sorted(table, key=lambda e: (e["port"], e["index"]))
        finally:
            free(entries)


# ---- the choice ud_transport makes ----------------------------------------------------

def gid_preference(entry, link_layer, prefer_ipv4=None):
    """How much ud_transport likes a GID entry for UD (higher is better, 0 = unusable).
    RoCE: RoCEv2 IPv4-mapped (on the interface that reaches the peers if known), then
    other RoCEv2, then RoCEv1. InfiniBand: the port GID (index 0)."""
    gid = entry["gid"]
    if gid == bytes(16):
        return 0
    if link_layer == "InfiniBand":
        return 10 if entry["index"] == 0 else 1
    ipv4 = gid_ipv4(gid)
    link_local = gid[:2] == b"\xfe\x80"
    if entry["type"] == "RoCEv2":
        if ipv4 is not None:
            return 50 if prefer_ipv4 and ipv4 == prefer_ipv4 else 40
        return 20 if link_local else 30
    if entry["type"] == "RoCEv1":
        return 5
    return 1


def choose_endpoint(device=None, port=0, gid_index=-1, prefer_ipv4=None):
    """The device, port and GID index ud_transport uses: those given, the rest chosen
    (first active port; best GID by gid_preference, lowest index on ties). Returns a dict
    with device, port, gid_index, gid, gid_type, active_mtu, link_layer, lid, max_queue_depth."""
    names = [device] if device else device_names()
    if not names:
        raise verbs_error("ibv_get_device_list", _errno.ENODEV, "dev=any", "no RDMA device here")
    best, reasons = None, []
    for name in names:
        with Context(name) as context:
            limits = context.query_device()
            ports = [port] if port else range(1, limits["phys_port_cnt"] + 1)
            for number in ports:
                attr = context.query_port(number)
                if attr["state"] != IBV_PORT_ACTIVE:
                    reasons.append(f"{name} port {number} is {attr['state_name']}")
                    if port:
                        raise VerbsError("ibv_query_port", _errno.ENETDOWN, f"dev={name} port={number}",
                                         f"port is not active (state {attr['state_name']})")
                    continue
                if gid_index >= 0:
                    gid, kind = context.query_gid(number, gid_index)
                    candidates = [(100, {"port": number, "index": gid_index, "gid": gid, "type": kind})]
                else:
                    candidates = [(gid_preference(e, attr["link_layer"], prefer_ipv4), e)
                                  for e in context.gid_table() if e["port"] == number]
                    candidates = [c for c in candidates if c[0] > 0]
                    if not candidates:
                        reasons.append(f"{name} port {number} has no usable GID")
                        continue
                score, entry = max(candidates, key=lambda c: (c[0], -c[1]["index"]))
                if best is None or score > best[0]:
                    best = (score, {"device": name, "port": number, "gid_index": entry["index"], "gid": entry["gid"],
                                    "gid_type": entry["type"], "active_mtu": attr["active_mtu"],
                                    "link_layer": attr["link_layer"], "lid": attr["lid"],
                                    "max_queue_depth": min(limits["max_qp_wr"], limits["max_cqe"])})
    if best is None:
        raise verbs_error("ibv_query_port", _errno.ENETDOWN, f"dev={device or 'any'} port={port or 'any'}",
                          "no active port with a usable GID (" + "; ".join(reasons) + ")")
    return best[1]
