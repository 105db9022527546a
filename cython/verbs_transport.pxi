# The verbs UD transport (native/transport_verbs.c), handed to an engine with detach(), or
# driven directly (peers, single datagrams) by tests and by whoever wants raw UD datagrams.
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
import struct as _struct

VERBS_ADDRESS_BYTES = UDT_VERBS_ADDRESS_BYTES
_ADDRESS = _struct.Struct("<16sIHI")  # GID, QPN, LID, Q_Key


def qkey_for_session(uint64_t session_id):
    """The Q_Key every rank of a session uses: folded from the session id, below
    0x80000000 (a Q_Key with the high bit set is privileged), never 0."""
    return ((session_id ^ (session_id >> 32)) & 0x7FFFFFFF) or 1


def pack_verbs_address(bytes gid, uint32_t qpn, uint16_t lid, uint32_t qkey):
    return _ADDRESS.pack(gid, qpn, lid, qkey)


def unpack_verbs_address(bytes address):
    """{gid, qpn, lid, qkey} of a verbs transport address."""
    gid, qpn, lid, qkey = _ADDRESS.unpack(address)
    return {"gid": gid, "qpn": qpn, "lid": lid, "qkey": qkey}


cdef inline double _seconds() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef void _destroy_unadopted(object capsule) noexcept:
    # _native.Transport.adopt renames the capsule when it takes the transport
    if PyCapsule_IsValid(capsule, UDT_TRANSPORT_CAPSULE):
        udt_transport_destroy(<udt_transport *>PyCapsule_GetPointer(capsule, UDT_TRANSPORT_CAPSULE))


cdef class VerbsTransport:
    """One rank's UD QP. Open it with VerbsTransport.open(); hand it to an engine with
    _native.Transport.adopt(transport.detach()), or drive it with set_peers / send /
    receive."""
    cdef udt_transport *ptr
    cdef readonly str device
    cdef readonly int port, gid_index
    cdef readonly uint32_t qkey, qpn

    def __dealloc__(self):
        if self.ptr is not NULL:
            udt_transport_destroy(self.ptr)
            self.ptr = NULL

    def _check_open(self):
        if self.ptr is NULL:
            raise ValueError("transport already handed to an engine or closed")

    def detach(self):
        """Give the C transport up: a PyCapsule for _native.Transport.adopt (which the engine
        then owns); this object is closed afterwards. Dropped unadopted, the capsule destroys it."""
        self._check_open()
        capsule = PyCapsule_New(self.ptr, UDT_TRANSPORT_CAPSULE, _destroy_unadopted)
        self.ptr = NULL
        return capsule

    @property
    def address(self):
        self._check_open()
        return bytes(self.ptr.address[:self.ptr.address_bytes])

    @property
    def max_datagram_bytes(self):
        self._check_open()
        return self.ptr.max_datagram_bytes

    @staticmethod
    def open(str device not None, int port, int gid_index, uint32_t qkey, uint32_t max_datagram_bytes=0,
             uint32_t send_depth=0, uint32_t recv_depth=0, uint32_t signal_every=0, uint32_t spin_us=20):
        """Open a UD QP on device/port with source GID gid_index (see choose_endpoint) and
        bring it to RTS. max_datagram_bytes=0 takes the port's active MTU."""
        cdef udt_error error
        cdef udt_verbs_config config
        cdef VerbsTransport t = VerbsTransport.__new__(VerbsTransport)
        encoded = device.encode()
        if not 1 <= port <= 255:
            raise verbs_error("ibv_query_port", _errno.EINVAL, f"dev={device} port={port}", "ports are numbered from 1")
        memset(&config, 0, sizeof(config))
        memset(&error, 0, sizeof(error))
        config.device = encoded
        config.port = <uint8_t>port
        config.gid_index = gid_index
        config.qkey = qkey
        config.max_datagram_bytes = max_datagram_bytes
        config.send_depth = send_depth
        config.recv_depth = recv_depth
        config.signal_every = signal_every
        config.spin_us = spin_us
        with nogil:
            t.ptr = udt_verbs_open(&config, &error)
        if t.ptr is NULL:
            raise error_from_native(&error)
        fields = unpack_verbs_address(bytes(t.ptr.address[:t.ptr.address_bytes]))
        t.device, t.port, t.gid_index, t.qkey, t.qpn = device, port, gid_index, fields["qkey"], fields["qpn"]
        return t

    @property
    def gid(self):
        self._check_open()
        return bytes(self.ptr.address[:16])

    def set_peers(self, addresses):
        """The peer table (rank order): a list of addresses from VerbsTransport.address."""
        self._check_open()
        for rank, address in enumerate(addresses):  # the C side reads exactly this many bytes per peer
            if len(address) != UDT_VERBS_ADDRESS_BYTES:
                raise ValueError(f"peer {rank}'s address has {len(address)} bytes, a verbs address {UDT_VERBS_ADDRESS_BYTES}")
        blob = b"".join(addresses)
        cdef const uint8_t *data = blob
        if udt_transport_set_peers(self.ptr, data, UDT_VERBS_ADDRESS_BYTES, len(addresses)) < 0:
            raise error_from_native(&self.ptr.error)

    def send(self, uint32_t peer, bytes header not None, bytes payload=b""):
        """Queue one datagram (header + payload) to a peer; returns 1, or 0 if the send ring is full."""
        cdef udt_send_item item
        self._check_open()
        item.peer = peer
        item.header = <const char *>header
        item.header_bytes = len(header)
        item.payload = <const char *>payload
        item.payload_bytes = len(payload)
        item.flags = 0
        rc = udt_transport_send(self.ptr, &item, 1)
        if rc < 0:
            raise error_from_native(&self.ptr.error)
        return rc

    def receive(self, int max_items=64, double timeout=0.0):
        """[(peer, bytes)] of what arrived, waiting up to `timeout` seconds for the first."""
        cdef udt_recv_item items[64]
        cdef int got = 0
        cdef double deadline
        self._check_open()
        max_items = max(1, min(max_items, 64))
        deadline = _seconds() + timeout
        while True:
            with nogil:
                got = udt_transport_recv(self.ptr, items, max_items)
            if got < 0:
                raise error_from_native(&self.ptr.error)
            left = deadline - _seconds()
            if got > 0 or left <= 0:
                break
            with nogil:
                udt_transport_wait(self.ptr, <int>(min(left, 0.1) * 1e6))
        return [(items[i].peer, items[i].data[:items[i].bytes]) for i in range(got)]
