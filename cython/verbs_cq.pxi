# Completion channel and completion queue.

@cython.no_gc_clear
cdef class CompletionChannel(VerbsObject):
    cdef ibv_comp_channel *channel
    cdef readonly Context context

    def __init__(self, Context context not None):
        context._check_open()
        self.context = context
        self.channel = ibv_create_comp_channel(context.context)
        if self.channel is NULL:
            raise verbs_error("ibv_create_comp_channel", _verbs_errno(-1), f"dev={context.name}")
        context._adopt(self)

    cdef bint _is_open(self):
        return self.channel is not NULL

    @property
    def fd(self):
        self._check_open()
        return self.channel.fd

    def close(self):
        """Close the CQs that use this channel, then the channel."""
        if self.channel is NULL:
            return
        self._close_children()
        rc = ibv_destroy_comp_channel(self.channel)
        self.channel = NULL
        if rc:
            raise verbs_error("ibv_destroy_comp_channel", _verbs_errno(rc), f"dev={self.context.name}")

    def get_event(self):
        """Block for the next CQ event and acknowledge it; returns the CQ's C address."""
        cdef ibv_cq *cq
        cdef void *cq_context
        cdef int rc
        self._check_open()
        with nogil:
            rc = ibv_get_cq_event(self.channel, &cq, &cq_context)
        if rc:
            raise verbs_error("ibv_get_cq_event", _verbs_errno(rc), f"dev={self.context.name}")
        ibv_ack_cq_events(cq, 1)
        return <uintptr_t>cq

    def __dealloc__(self):
        if self.channel is not NULL and self.context is not None and self.context.context is not NULL:
            ibv_destroy_comp_channel(self.channel)
        self.channel = NULL


WC_STATUS_SUCCESS = IBV_WC_SUCCESS
WC_FLAG_GRH = IBV_WC_GRH


@cython.no_gc_clear
cdef class CompletionQueue(VerbsObject):
    cdef ibv_cq *cq
    cdef readonly Context context
    cdef readonly CompletionChannel channel
    cdef readonly int cqe

    def __init__(self, Context context not None, int cqe, CompletionChannel channel=None, int comp_vector=0):
        context._check_open()
        self.context = context
        self.channel = channel
        self.cq = ibv_create_cq(context.context, cqe, NULL, channel.channel if channel is not None else NULL, comp_vector)
        if self.cq is NULL:
            raise verbs_error("ibv_create_cq", _verbs_errno(-1), f"dev={context.name} cqe={cqe}")
        self.cqe = self.cq.cqe
        context._adopt(self)
        if channel is not None:
            channel._adopt(self)

    cdef bint _is_open(self):
        return self.cq is not NULL

    def close(self):
        """Close the QPs that use this CQ, then the CQ."""
        if self.cq is NULL:
            return
        self._close_children()
        rc = ibv_destroy_cq(self.cq)
        self.cq = NULL
        if rc:
            raise verbs_error("ibv_destroy_cq", _verbs_errno(rc), f"dev={self.context.name}")

    def __dealloc__(self):
        if self.cq is not NULL and self.context is not None and self.context.context is not NULL:
            ibv_destroy_cq(self.cq)
        self.cq = NULL

    def req_notify(self, bint solicited_only=False):
        self._check_open()
        rc = ibv_req_notify_cq(self.cq, solicited_only)
        if rc:
            raise verbs_error("ibv_req_notify_cq", _verbs_errno(rc), f"dev={self.context.name}")

    def poll(self, int max_entries=16):
        """Up to max_entries completions, as dicts (wr_id, status, status_name, opcode,
        byte_len, qp_num, src_qp, wc_flags, slid)."""
        cdef ibv_wc wc[64]
        cdef int got
        self._check_open()
        if max_entries > 64:
            max_entries = 64
        with nogil:
            got = ibv_poll_cq(self.cq, max_entries, wc)
        if got < 0:
            raise verbs_error("ibv_poll_cq", _errno.EIO, f"dev={self.context.name}")
        return [{"wr_id": wc[i].wr_id, "status": wc[i].status, "status_name": ibv_wc_status_str(wc[i].status).decode(),
                 "opcode": wc[i].opcode, "byte_len": wc[i].byte_len, "qp_num": wc[i].qp_num, "src_qp": wc[i].src_qp,
                 "wc_flags": wc[i].wc_flags, "slid": wc[i].slid, "vendor_err": wc[i].vendor_err} for i in range(got)]
