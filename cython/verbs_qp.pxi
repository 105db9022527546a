# Unreliable Datagram queue pair: RESET -> INIT -> RTR -> RTS, post sends and receives.

QP_STATES = {IBV_QPS_RESET: "RESET", IBV_QPS_INIT: "INIT", IBV_QPS_RTR: "RTR", IBV_QPS_RTS: "RTS",
             IBV_QPS_SQD: "SQD", IBV_QPS_SQE: "SQE", IBV_QPS_ERR: "ERR", IBV_QPS_UNKNOWN: "UNKNOWN"}
GRH_BYTES = 40


@cython.no_gc_clear
cdef class UDQueuePair(VerbsObject):
    cdef ibv_qp *qp
    cdef readonly ProtectionDomain pd
    cdef readonly CompletionQueue send_cq, recv_cq
    cdef readonly uint32_t qpn
    cdef readonly int max_send_wr, max_recv_wr

    def __init__(self, ProtectionDomain pd not None, CompletionQueue send_cq not None, CompletionQueue recv_cq=None,
                 int max_send_wr=64, int max_recv_wr=64):
        cdef ibv_qp_init_attr attr
        pd._check_open()
        send_cq._check_open()
        recv_cq = recv_cq if recv_cq is not None else send_cq
        recv_cq._check_open()
        self.pd, self.send_cq, self.recv_cq = pd, send_cq, recv_cq
        memset(&attr, 0, sizeof(attr))
        attr.send_cq = send_cq.cq
        attr.recv_cq = recv_cq.cq
        attr.cap.max_send_wr = max_send_wr
        attr.cap.max_recv_wr = max_recv_wr
        attr.cap.max_send_sge = 1
        attr.cap.max_recv_sge = 1
        attr.qp_type = IBV_QPT_UD
        self.qp = ibv_create_qp(pd.pd, &attr)
        if self.qp is NULL:
            raise verbs_error("ibv_create_qp", _verbs_errno(-1),
                              f"dev={pd.context.name} type=UD send_wr={max_send_wr} recv_wr={max_recv_wr}")
        self.qpn = self.qp.qp_num
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        pd._adopt(self)
        send_cq._adopt(self)
        recv_cq._adopt(self)

    cdef bint _is_open(self):
        return self.qp is not NULL

    cdef str _describe(self):
        return f"dev={self.pd.context.name} qpn=0x{self.qpn:x}"

    def close(self):
        if self.qp is NULL:
            return
        rc = ibv_destroy_qp(self.qp)
        self.qp = NULL
        if rc:
            raise verbs_error("ibv_destroy_qp", _verbs_errno(rc), self._describe())

    def __dealloc__(self):
        if self.qp is not NULL and self.pd is not None and self.pd.pd is not NULL:
            ibv_destroy_qp(self.qp)
        self.qp = NULL

    @property
    def state(self):
        """The QP state's name (RESET, INIT, RTR, RTS, ERR, ...), from ibv_query_qp."""
        cdef ibv_qp_attr attr
        cdef ibv_qp_init_attr init
        self._check_open()
        rc = ibv_query_qp(self.qp, &attr, IBV_QP_STATE, &init)
        if rc:
            raise verbs_error("ibv_query_qp", _verbs_errno(rc), self._describe())
        return QP_STATES.get(attr.qp_state, str(attr.qp_state))

    def to_rts(self, int port, uint32_t qkey, int pkey_index=0):
        """RESET -> INIT (port, P_Key index, Q_Key) -> RTR -> RTS."""
        cdef ibv_qp_attr attr
        self._check_open()
        if qkey & 0x80000000:
            raise ValueError(f"Q_Key 0x{qkey:x} has the high bit set (privileged); use one below 0x80000000")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_INIT
        attr.pkey_index = pkey_index
        attr.port_num = port
        attr.qkey = qkey
        rc = ibv_modify_qp(self.qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY)
        if rc:
            raise verbs_error("ibv_modify_qp", _verbs_errno(rc), f"{self._describe()} port={port} RESET->INIT")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTR
        rc = ibv_modify_qp(self.qp, &attr, IBV_QP_STATE)
        if rc:
            raise verbs_error("ibv_modify_qp", _verbs_errno(rc), f"{self._describe()} INIT->RTR")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTS
        attr.sq_psn = 0
        rc = ibv_modify_qp(self.qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN)
        if rc:
            raise verbs_error("ibv_modify_qp", _verbs_errno(rc), f"{self._describe()} RTR->RTS")

    def post_recv(self, MemoryRegion mr not None, size_t offset, uint32_t length, uint64_t wr_id=0):
        """Post one receive buffer (it must hold the 40-byte GRH in front of the datagram)."""
        cdef ibv_sge sge
        cdef ibv_recv_wr wr
        cdef ibv_recv_wr *bad
        self._check_open()
        mr._check_open()
        if offset + length > mr.length:
            raise ValueError("receive buffer outside the memory region")
        sge.addr = <uintptr_t>mr.buffer + offset
        sge.length = length
        sge.lkey = mr.mr.lkey
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        rc = ibv_post_recv(self.qp, &wr, &bad)
        if rc:
            raise verbs_error("ibv_post_recv", _verbs_errno(rc), self._describe())

    def post_send(self, MemoryRegion mr not None, size_t offset, uint32_t length, AddressHandle ah not None,
                  uint32_t remote_qpn, uint32_t remote_qkey, uint64_t wr_id=0, bint signaled=True):
        """Post one UD send of mr[offset:offset+length] to (ah, remote_qpn, remote_qkey)."""
        cdef ibv_sge sge
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad
        self._check_open()
        mr._check_open()
        ah._check_open()
        if offset + length > mr.length:
            raise ValueError("send buffer outside the memory region")
        sge.addr = <uintptr_t>mr.buffer + offset
        sge.length = length
        sge.lkey = mr.mr.lkey
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        wr.opcode = IBV_WR_SEND
        wr.send_flags = IBV_SEND_SIGNALED if signaled else 0
        wr.wr.ud.ah = ah.ah
        wr.wr.ud.remote_qpn = remote_qpn
        wr.wr.ud.remote_qkey = remote_qkey
        rc = ibv_post_send(self.qp, &wr, &bad)
        if rc:
            raise verbs_error("ibv_post_send", _verbs_errno(rc), self._describe())
