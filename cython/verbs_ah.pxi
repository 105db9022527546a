# Address handle: how a UD send reaches one peer. Always with a GRH (RoCE needs it).

@cython.no_gc_clear
cdef class AddressHandle(VerbsObject):
    cdef ibv_ah *ah
    cdef readonly ProtectionDomain pd
    cdef readonly int port, gid_index

    def __init__(self, ProtectionDomain pd not None, int port, int gid_index, bytes dgid not None, int dlid=0,
                 int hop_limit=64, int sl=0, int traffic_class=0):
        cdef ibv_ah_attr attr
        pd._check_open()
        if len(dgid) != 16:
            raise ValueError(f"a GID is 16 bytes, got {len(dgid)}")
        self.pd = pd
        self.port = port
        self.gid_index = gid_index
        memset(&attr, 0, sizeof(attr))
        attr.is_global = 1
        attr.dlid = dlid
        attr.sl = sl
        attr.port_num = port
        attr.grh.sgid_index = gid_index
        attr.grh.hop_limit = hop_limit
        attr.grh.traffic_class = traffic_class
        memcpy(attr.grh.dgid.raw, <const char *>dgid, 16)
        if not (0 <= gid_index <= 255 and 1 <= port <= 255):
            raise verbs_error("ibv_create_ah", _errno.EINVAL, f"dev={pd.context.name} port={port} gid_index={gid_index}",
                              "port or GID index out of range")
        self.ah = ibv_create_ah(pd.pd, &attr)
        if self.ah is NULL:
            raise verbs_error("ibv_create_ah", _verbs_errno(-1), f"dev={pd.context.name} port={port} gid_index={gid_index}")
        pd._adopt(self)

    cdef bint _is_open(self):
        return self.ah is not NULL

    def close(self):
        if self.ah is NULL:
            return
        rc = ibv_destroy_ah(self.ah)
        self.ah = NULL
        if rc:
            raise verbs_error("ibv_destroy_ah", _verbs_errno(rc), f"dev={self.pd.context.name}")

    def __dealloc__(self):
        if self.ah is not NULL and self.pd is not None and self.pd.pd is not NULL:
            ibv_destroy_ah(self.ah)
        self.ah = NULL
