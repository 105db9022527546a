# Memory region: a buffer this object owns, registered with a PD.

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)


@cython.no_gc_clear
cdef class MemoryRegion(VerbsObject):
    cdef ibv_mr *mr
    cdef void *buffer
    cdef readonly ProtectionDomain pd
    cdef readonly size_t length

    def __init__(self, ProtectionDomain pd not None, size_t length, int access=IBV_ACCESS_LOCAL_WRITE):
        pd._check_open()
        if length == 0:
            raise ValueError("a memory region needs at least one byte")
        self.pd = pd
        if posix_memalign(&self.buffer, 4096, length) != 0:
            self.buffer = NULL
            raise MemoryError(f"cannot allocate {length} bytes for a memory region")
        memset(self.buffer, 0, length)
        self.length = length
        self.mr = ibv_reg_mr(pd.pd, self.buffer, length, access)
        if self.mr is NULL:
            raise verbs_error("ibv_reg_mr", _verbs_errno(-1), f"dev={pd.context.name} length={length} access=0x{access:x}")
        pd._adopt(self)

    cdef bint _is_open(self):
        return self.mr is not NULL

    def close(self):
        if self.mr is NULL:
            return
        rc = ibv_dereg_mr(self.mr)
        self.mr = NULL
        if rc:
            raise verbs_error("ibv_dereg_mr", _verbs_errno(rc), f"dev={self.pd.context.name}")

    def __dealloc__(self):
        if self.mr is not NULL and self.pd is not None and self.pd.pd is not NULL:
            ibv_dereg_mr(self.mr)
        self.mr = NULL
        free(self.buffer)
        self.buffer = NULL

    @property
    def lkey(self):
        self._check_open()
        return self.mr.lkey

    @property
    def rkey(self):
        self._check_open()
        return self.mr.rkey

    @property
    def address(self):
        return <uintptr_t>self.buffer

    def write(self, data, size_t offset=0):
        cdef const unsigned char[:] view = memoryview(data).cast("B")
        if offset + view.shape[0] > self.length:
            raise ValueError(f"{view.shape[0]} bytes at offset {offset} do not fit in {self.length}")
        if view.shape[0]:
            memcpy(<char *>self.buffer + offset, &view[0], view.shape[0])

    def read(self, size_t length, size_t offset=0):
        if offset + length > self.length:
            raise ValueError(f"{length} bytes at offset {offset} exceed {self.length}")
        return (<char *>self.buffer)[offset:offset + length]
