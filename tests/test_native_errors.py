"""Errors of the C layer cross into Python as values (native/error.h): the failed
call, its errno and the object it was called on are fields, not text to parse."""
import errno
import pickle
import socket

import pytest

from ud_transport import TransportError, _native, transports
from ud_transport import options as options_module

NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): no interface of this machine has it


def test_a_failed_bind_names_the_call_the_errno_and_the_address():
    with pytest.raises(_native.NativeCallError) as caught:
        _native.Transport.udp(NOT_HERE, 0, 1 << 20)
    error = caught.value
    assert (error.call, error.errno, error.object) == ("bind", errno.EADDRNOTAVAIL, f"udp {NOT_HERE}:0")
    assert isinstance(error, OSError) and error.detail == ""
    assert str(error) == f"bind failed: EADDRNOTAVAIL ({errno.EADDRNOTAVAIL}) [udp {NOT_HERE}:0]"
    copy = pickle.loads(pickle.dumps(error))  # rank processes send errors to their parent
    assert (type(copy), copy.call, copy.errno, copy.object, str(copy)) == (type(error), "bind", error.errno, error.object,
                                                                           str(error))


def test_a_taken_port_says_what_to_do():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(_native.NativeCallError) as caught:
            _native.Transport.udp("127.0.0.1", port, 1 << 20)
    assert (caught.value.call, caught.value.errno) == ("bind", errno.EADDRINUSE)
    assert caught.value.object == f"udp 127.0.0.1:{port}" and "port 0" in caught.value.detail


def test_a_check_of_the_library_has_no_call_and_no_errno():
    with pytest.raises(OSError) as caught:
        _native.Transport.udp("not-an-address", 0, 1 << 20)
    assert type(caught.value) is OSError and caught.value.errno is None
    assert str(caught.value) == "udp: bind address not-an-address is not an IPv4 address"


def test_the_transport_error_a_user_sees_keeps_the_fields():
    with pytest.raises(TransportError) as caught:
        transports.open_transport("udp", NOT_HERE, options_module.build(), 0, 1)
    error = caught.value
    assert (error.call, error.errno, error.object) == ("bind", errno.EADDRNOTAVAIL, f"udp {NOT_HERE}:0")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.call, copy.errno, copy.object, str(copy)) == (error.call, error.errno, error.object, str(error))
    plain = TransportError("no call underneath")
    assert (plain.call, plain.errno, plain.object) == (None, None, None)


def test_a_failed_call_of_the_engine_returns_its_error_as_fields():
    # two ranks, the other never started: the call ends at its join timeout with a check's error
    transport = _native.Transport.udp("127.0.0.1", 0, 1 << 20)
    options = options_module.build(join_timeout_s=0.2).engine_options(64, 1 << 16)
    own = transport.address  # the engine owns the transport once made
    engine = _native.Engine(transport, 0, 2, 7, options)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        peer = socket.inet_aton("127.0.0.1") + silent.getsockname()[1].to_bytes(2, "big")
        engine.set_peers(own + peer, 6)
        status, _, error = engine.run(collective=_native.COLLECTIVE_AGREE, algorithm=_native.ALGORITHM_DIRECT,
                                      agree_value=1, deadline_s=0.2)
    engine.close()
    assert status == _native.STATUS_PEER_TIMEOUT
    assert isinstance(error, _native.NativeError) and (error.call, error.errno, error.object) == ("", 0, "")
    assert error.message.startswith("rank 1 ")


def test_set_peers_refuses_a_buffer_that_does_not_hold_every_rank():
    """Finding 3: the engine read world size x address size bytes whatever the buffer held (a
    heap over-read for a short one). The length now travels with the pointer and is checked."""
    transport = _native.Transport.udp("127.0.0.1", 0, 1 << 20)
    options = options_module.build().engine_options(64, 1 << 16)
    own = transport.address
    engine = _native.Engine(transport, 0, 4, 7, options)
    try:
        for addresses, address_bytes in ((own, 6), (own * 3, 6), (own * 5, 6), (own * 4, 0), (b"", 6)):
            with pytest.raises(ValueError, match="set_peers: .* for 4 ranks"):
                engine.set_peers(addresses, address_bytes)
        engine.set_peers(own * 4, 6)  # the right length is taken
    finally:
        engine.close()
