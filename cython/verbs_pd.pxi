# Protection domain: the parent of memory regions, queue pairs and address handles.

@cython.no_gc_clear
cdef class ProtectionDomain(VerbsObject):
    cdef ibv_pd *pd
    cdef readonly Context context

    def __init__(self, Context context not None):
        context._check_open()
        self.context = context
        self.pd = ibv_alloc_pd(context.context)
        if self.pd is NULL:
            raise verbs_error("ibv_alloc_pd", _verbs_errno(-1), f"dev={context.name}")
        context._adopt(self)

    cdef bint _is_open(self):
        return self.pd is not NULL

    def close(self):
        """Close the MRs, QPs and AHs of this PD, then the PD."""
        if self.pd is NULL:
            return
        self._close_children()
        rc = ibv_dealloc_pd(self.pd)
        self.pd = NULL
        if rc:
            raise verbs_error("ibv_dealloc_pd", _verbs_errno(rc), f"dev={self.context.name}")

    def __dealloc__(self):
        if self.pd is not NULL and self.context is not None and self.context.context is not NULL:
            ibv_dealloc_pd(self.pd)
        self.pd = NULL
