"""The UDP transport (native/transport_udp.c) driven directly through the compiled extension's
C symbols and its ops table (ctypes), so a test sees exactly what the engine sees. Shared by
tests/test_udp_batching.py and the child processes it starts (which import this module, not
the test)."""
import ctypes
import time

import ud_transport._native as _native

UDT_UDP_GSO, UDT_UDP_GRO, UDT_UDP_RCVBUF_FORCED, UDT_UDP_GSO_REFUSED, UDT_UDP_DROPS_COUNTED = (
    _native.UDP_GSO, _native.UDP_GRO, _native.UDP_RCVBUF_FORCED, _native.UDP_GSO_REFUSED, _native.UDP_DROPS_COUNTED)
UDT_UDP_PATH_MTU_IGNORED = _native.UDP_PATH_MTU_IGNORED


UDT_SEND_APART = 1  # native/transport.h


class SendItem(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_uint32), ("header", ctypes.c_void_p), ("header_bytes", ctypes.c_uint32),
                ("payload", ctypes.c_void_p), ("payload_bytes", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class RecvItem(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("bytes", ctypes.c_uint32), ("peer", ctypes.c_int32)]


class Ops(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p),
                ("set_peers", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32)),
                ("send_batch", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(SendItem), ctypes.c_int)),
                ("recv_batch", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(RecvItem), ctypes.c_int)),
                ("wait", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)),
                ("destroy", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


class NativeError(ctypes.Structure):  # struct udt_error (native/error.h)
    _fields_ = [("call", ctypes.c_char * 40), ("errno_value", ctypes.c_int), ("object", ctypes.c_char * 160),
                ("detail", ctypes.c_char * 160), ("message", ctypes.c_char * 400)]


class TransportBase(ctypes.Structure):  # struct udt_transport (native/transport.h)
    _fields_ = [("ops", ctypes.POINTER(Ops)), ("max_datagram_bytes", ctypes.c_uint32), ("address_bytes", ctypes.c_uint32),
                ("address", ctypes.c_uint8 * 64), ("counter_injected_drops", ctypes.c_uint64),
                ("counter_receive_overflows", ctypes.c_uint64), ("counter_send_calls", ctypes.c_uint64),
                ("counter_receive_calls", ctypes.c_uint64), ("ports", ctypes.c_void_p), ("error", NativeError)]


class Counters(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "send_calls", "send_messages", "send_gso_messages", "send_gso_datagrams",
        "recv_calls", "recv_messages", "recv_gro_messages", "recv_gro_datagrams", "icmp_errors",
        "icmp_unverified", "send_refused", "icmp_too_big")]


lib = ctypes.CDLL(_native.__file__)
lib.udt_udp_open.restype = ctypes.POINTER(TransportBase)
lib.udt_udp_open.argtypes = [ctypes.c_char_p, ctypes.c_uint16, ctypes.c_uint32, ctypes.POINTER(NativeError)]
for _name in ("udt_udp_features", "udt_udp_receive_buffer_bytes", "udt_udp_send_buffer_bytes"):
    getattr(lib, _name).restype = ctypes.c_uint32
    getattr(lib, _name).argtypes = [ctypes.c_void_p]
lib.udt_udp_disable.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
lib.udt_udp_describe.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
lib.udt_udp_counters.argtypes = [ctypes.c_void_p, ctypes.POINTER(Counters)]


class Udp:
    """One UDP transport, driven through its ops table."""

    def __init__(self, bind="127.0.0.1", buffer_bytes=8 << 20):
        error = NativeError()
        self.ptr = lib.udt_udp_open(bind.encode(), 0, buffer_bytes, ctypes.byref(error))
        if not self.ptr:
            raise OSError(error.message.decode())
        self.ops = self.ptr.contents.ops.contents
        self.max_datagram_bytes = self.ptr.contents.max_datagram_bytes
        self.address = bytes(self.ptr.contents.address[:self.ptr.contents.address_bytes])

    def set_peers(self, *transports):
        blob = b"".join(t.address for t in transports)
        assert self.ops.set_peers(self.ptr, blob, 6, len(transports)) == 0

    def send(self, datagrams, timeout=5.0):
        """datagrams: [(peer, header, payload)] or [(peer, header, payload, flags)], handed over in one
        send_batch call where the socket takes them."""
        keep = [(ctypes.create_string_buffer(d[1], len(d[1])), ctypes.create_string_buffer(d[2], len(d[2])))
                for d in datagrams]
        items = (SendItem * len(datagrams))(*[
            SendItem(d[0], ctypes.addressof(h), len(d[1]), ctypes.addressof(p) if d[2] else None, len(d[2]),
                     d[3] if len(d) > 3 else 0)
            for d, (h, p) in zip(datagrams, keep)])
        done, deadline = 0, time.monotonic() + timeout
        while done < len(datagrams):
            rc = self.ops.send_batch(self.ptr, ctypes.cast(ctypes.byref(items, done * ctypes.sizeof(SendItem)),
                                                           ctypes.POINTER(SendItem)), len(datagrams) - done)
            assert rc >= 0, self.ptr.contents.error.message.decode()
            done += rc
            assert time.monotonic() < deadline, f"only {done} of {len(datagrams)} datagrams taken"
        return done

    def receive(self, count, max_items=64, timeout=5.0):
        """[(peer, bytes)] until `count` datagrams arrived (or the timeout), max_items per recv_batch."""
        items = (RecvItem * max_items)()
        got, deadline = [], time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            n = self.ops.recv_batch(self.ptr, items, max_items)
            assert n >= 0, self.ptr.contents.error.message.decode()
            assert n <= max_items
            got += [(items[i].peer, ctypes.string_at(items[i].data, items[i].bytes)) for i in range(n)]
            if n == 0:
                self.ops.wait(self.ptr, 20000)
        return got

    def quiet(self, seconds=0.05):
        """What arrives in `seconds` more (nothing, if the exchange was exact)."""
        return self.receive(1 << 30, timeout=seconds)

    def send_without_checksums(self):
        """SO_NO_CHECK on the transport's socket: the kernel then refuses every GSO message
        (EINVAL), as it does on a route through IPsec or, before Linux 6.x, on a device without
        checksum offload. Found among this process's descriptors by its bound address."""
        import os
        import socket

        for name in os.listdir("/proc/self/fd"):
            try:
                probe = socket.socket(fileno=int(name))
            except OSError:
                continue
            try:
                if probe.family == socket.AF_INET and probe.type == socket.SOCK_DGRAM:
                    host, port = probe.getsockname()
                    if socket.inet_aton(host) + port.to_bytes(2, "big") == self.address:
                        probe.setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK
                        return
            finally:
                probe.detach()
        raise AssertionError("the transport's socket is not among this process's descriptors")

    @property
    def features(self):
        return lib.udt_udp_features(self.ptr)

    @property
    def counters(self):
        c = Counters()
        assert lib.udt_udp_counters(self.ptr, ctypes.byref(c)) == 0
        return {name: getattr(c, name) for name, _ in Counters._fields_}

    def describe(self):
        text = ctypes.create_string_buffer(256)
        lib.udt_udp_describe(self.ptr, text, 256)
        return text.value.decode()

    def close(self):
        if self.ptr:
            self.ops.destroy(self.ptr)
            self.ptr = None
