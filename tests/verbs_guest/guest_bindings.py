"""Verbs bindings and the verbs transport on a real (soft) RDMA device.

Runs inside the SoftRoCE guest (tests/test_verbs_bindings.py boots it); anywhere else it skips
saying why, and fails under CI. Objects open and close in any order; bad device, port and GID
index give errors naming the verb, the errno and the object; a send to a QPN that does not exist
completes and is simply lost; the transport identifies senders, refuses oversized datagrams,
keeps its receive ring posted, and sleeps (not spins) in wait().
"""
import errno
import random
import threading
import time

import pytest

from conftest import skip_or_fail
from ud_transport import _verbs as verbs

QKEY = 0x1234
MTU_SLACK = 64


@pytest.fixture(scope="module")
def endpoint():
    if verbs.verbs_active_device_count() == 0:
        skip_or_fail("no RDMA device with an active port here: these tests run in the SoftRoCE guest "
                     "(python -m pytest tests/test_verbs_bindings.py boots it)")
    return verbs.choose_endpoint()


@pytest.fixture
def device(endpoint):
    return endpoint["device"]


def build_all(endpoint):
    """One of every verbs object, wired the way the transport wires them."""
    context = verbs.Context(endpoint["device"])
    channel = verbs.CompletionChannel(context)
    cq = verbs.CompletionQueue(context, 64, channel)
    pd = verbs.ProtectionDomain(context)
    mr = verbs.MemoryRegion(pd, 8192)
    qp = verbs.UDQueuePair(pd, cq, cq, 16, 16)
    ah = verbs.AddressHandle(pd, endpoint["port"], endpoint["gid_index"], endpoint["gid"])
    return [context, channel, cq, pd, mr, qp, ah]


# ---- lifetime ---------------------------------------------------------------------------

def test_objects_close_in_any_order(endpoint):
    orders = [list(range(7)), list(reversed(range(7)))]
    rng = random.Random(3)
    orders += [rng.sample(range(7), 7) for _ in range(24)]
    for order in orders:
        objects = build_all(endpoint)
        for index in order:
            objects[index].close()
            objects[index].close()  # idempotent
        assert all(o.closed for o in objects), order


def test_closing_a_parent_closes_its_children_first(endpoint):
    context, channel, cq, pd, mr, qp, ah = build_all(endpoint)
    cq.close()  # the QP uses it: closed first
    assert qp.closed and cq.closed and not pd.closed
    pd.close()
    assert mr.closed and ah.closed and not context.closed
    context.close()
    assert channel.closed
    with pytest.raises(ValueError, match="Context is closed"):
        context.query_port(1)


def test_with_blocks_close_and_use_after_close_is_refused(endpoint):
    with verbs.Context(endpoint["device"]) as context:
        with verbs.ProtectionDomain(context) as pd, verbs.MemoryRegion(pd, 4096) as mr:
            mr.write(b"abc", 10)
            assert mr.read(3, 10) == b"abc"
        assert mr.closed and pd.closed
    assert context.closed
    with pytest.raises(ValueError, match="MemoryRegion is closed"):
        mr.lkey


def test_objects_dropped_without_close_are_released(endpoint):
    for _ in range(50):
        objects = build_all(endpoint)
        del objects  # __dealloc__ in any order the collector picks; no crash, no leak of device contexts
    context = verbs.Context(endpoint["device"])
    context.close()


# ---- errors that name the verb, the errno and the object -----------------------------------

def test_bad_device_name(endpoint):
    with pytest.raises(verbs.VerbsError) as caught:
        verbs.Context("no_such_dev0")
    assert caught.value.errno == errno.ENODEV
    assert str(caught.value).startswith("ibv_open_device failed: ENODEV (19) [dev=no_such_dev0]")
    assert endpoint["device"] in str(caught.value)  # lists what exists
    with pytest.raises(verbs.VerbsError, match=r"^ibv_open_device failed: ENODEV \(19\) \[dev=no_such_dev0\]"):
        verbs.VerbsTransport.open("no_such_dev0", 1, 1, QKEY)
    with pytest.raises(verbs.VerbsError, match=r"\[dev=no_such_dev0\]"):
        verbs.choose_endpoint(device="no_such_dev0")


def test_bad_port(endpoint, device):
    with verbs.Context(device) as context:
        ports = context.query_device()["phys_port_cnt"]
        bad = ports + 1
        with pytest.raises(verbs.VerbsError) as caught:
            context.query_port(bad)
    assert caught.value.errno == errno.EINVAL
    assert str(caught.value).startswith(f"ibv_query_port failed: EINVAL (22) [dev={device} port={bad}]")
    with pytest.raises(verbs.VerbsError, match=rf"^ibv_query_port failed: EINVAL \(22\) \[dev={device} port={bad}\]"):
        verbs.VerbsTransport.open(device, bad, endpoint["gid_index"], QKEY)
    with pytest.raises(verbs.VerbsError, match=rf"\[dev={device} port={bad}\]"):
        verbs.choose_endpoint(device=device, port=bad)


def test_bad_gid_index(endpoint, device):
    port = endpoint["port"]
    bad = 200  # inside the table's range on rxe (1024 entries) but not populated
    with verbs.Context(device) as context:
        with pytest.raises(verbs.VerbsError, match=rf"^ibv_query_gid_ex failed: \w+ \(\d+\) \[dev={device} port={port} gid_index={bad}\]"):
            context.query_gid(port, bad)
        with verbs.ProtectionDomain(context) as pd:
            with pytest.raises(verbs.VerbsError) as caught:
                verbs.AddressHandle(pd, port, bad, endpoint["gid"])
    assert str(caught.value).startswith(f"ibv_create_ah failed: {errno.errorcode[caught.value.errno]} ({caught.value.errno}) "
                                        f"[dev={device} port={port} gid_index={bad}]")
    with pytest.raises(verbs.VerbsError, match=rf"^ibv_query_gid_ex failed: \w+ \(\d+\) \[dev={device} port={port} gid_index={bad}\]"):
        verbs.VerbsTransport.open(device, port, bad, QKEY)


def test_transport_refuses_a_privileged_qkey_and_a_datagram_size_above_the_mtu(endpoint, device):
    with pytest.raises(OSError, match="high bit"):
        verbs.VerbsTransport.open(device, endpoint["port"], endpoint["gid_index"], 0x80000001)
    with pytest.raises(OSError, match="exceeds the port's active MTU"):
        verbs.VerbsTransport.open(device, endpoint["port"], endpoint["gid_index"], QKEY,
                                   max_datagram_bytes=endpoint["active_mtu"] + 1)


def test_not_supported_has_its_own_type():
    error = verbs.verbs_error("ibv_alloc_dm", errno.EOPNOTSUPP, "dev=rxe0")
    assert isinstance(error, verbs.VerbsNotSupported) and isinstance(error, verbs.VerbsError)
    assert str(error) == "ibv_alloc_dm failed: EOPNOTSUPP (95) [dev=rxe0]"


# ---- QP lifecycle and datagrams through the raw bindings -------------------------------------

def open_pair(endpoint, depth=32):
    context = verbs.Context(endpoint["device"])
    pd = verbs.ProtectionDomain(context)
    cq = verbs.CompletionQueue(context, 4 * depth)
    qps = [verbs.UDQueuePair(pd, cq, cq, depth, depth) for _ in range(2)]
    assert [qp.state for qp in qps] == ["RESET", "RESET"]
    for qp in qps:
        qp.to_rts(endpoint["port"], QKEY)
    assert [qp.state for qp in qps] == ["RTS", "RTS"]
    mr = verbs.MemoryRegion(pd, 2 * depth * (endpoint["active_mtu"] + MTU_SLACK) + 2 * endpoint["active_mtu"] + 8192)
    ah = verbs.AddressHandle(pd, endpoint["port"], endpoint["gid_index"], endpoint["gid"])
    return context, pd, cq, qps, mr, ah


def drain(cq, seconds):
    found, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        found += cq.poll(16)
        time.sleep(0.005)
    return found


def test_send_to_a_qpn_that_does_not_exist_completes_and_is_lost(endpoint):
    context, pd, cq, (sender, receiver), mr, ah = open_pair(endpoint)
    slot = endpoint["active_mtu"] + 64
    with context:
        for i in range(8):
            receiver.post_recv(mr, 8192 + i * slot, slot, wr_id=100 + i)
        mr.write(b"lost in space", 0)
        missing_qpn = max(sender.qpn, receiver.qpn) + 1000
        sender.post_send(mr, 0, 13, ah, missing_qpn, QKEY, wr_id=1)
        completions = drain(cq, 1.0)
        assert [(c["wr_id"], c["status"]) for c in completions] == [(1, verbs.WC_STATUS_SUCCESS)], completions
        # control: the same send to the real QPN arrives, with the GRH in front
        sender.post_send(mr, 0, 13, ah, receiver.qpn, QKEY, wr_id=2)
        completions = drain(cq, 1.0)
        received = [c for c in completions if c["wr_id"] >= 100]
        assert len(received) == 1 and received[0]["status"] == verbs.WC_STATUS_SUCCESS, completions
        assert received[0]["byte_len"] == verbs.GRH_BYTES + 13 and received[0]["src_qp"] == sender.qpn
        assert mr.read(13, 8192 + (received[0]["wr_id"] - 100) * slot + verbs.GRH_BYTES) == b"lost in space"
        assert sender.state == "RTS"  # the lost datagram did not hurt the QP


def test_oversized_ud_send_sends_nothing(endpoint):
    """Why max_datagram_bytes is the active MTU: above it, a UD send is not delivered."""
    context, pd, cq, (sender, receiver), mr, ah = open_pair(endpoint)
    mtu = endpoint["active_mtu"]
    slot = 2 * mtu + 64
    with context:
        for i in range(4):
            receiver.post_recv(mr, 8192 + i * slot, slot, wr_id=100 + i)
        sender.post_send(mr, 0, mtu + 1, ah, receiver.qpn, QKEY, wr_id=1)
        completions = drain(cq, 1.0)
        assert [c for c in completions if c["wr_id"] >= 100] == []
        assert [c["wr_id"] for c in completions] == [1]  # the send itself completes (successfully on rxe)


def test_qp_to_rts_refuses_a_privileged_qkey(endpoint):
    context, pd, cq, qps, mr, ah = open_pair(endpoint)
    with context:
        fresh = verbs.UDQueuePair(pd, cq)
        with pytest.raises(ValueError, match="privileged"):
            fresh.to_rts(endpoint["port"], 0x80000000)


# ---- the transport ----------------------------------------------------------------------------

def open_transports(endpoint, count, **kwargs):
    return [verbs.VerbsTransport.open(endpoint["device"], endpoint["port"], endpoint["gid_index"], QKEY, **kwargs)
            for _ in range(count)]


def test_transport_address_names_gid_qpn_and_qkey(endpoint):
    (transport,) = open_transports(endpoint, 1)
    fields = verbs.unpack_verbs_address(transport.address)
    assert len(transport.address) == verbs.VERBS_ADDRESS_BYTES == 26
    assert fields == {"gid": endpoint["gid"], "qpn": transport.qpn, "lid": endpoint["lid"], "qkey": QKEY}
    assert transport.max_datagram_bytes == endpoint["active_mtu"]


def test_transport_identifies_senders_and_marks_strangers(endpoint):
    a, b, stranger = open_transports(endpoint, 3)
    a.set_peers([a.address, b.address])
    b.set_peers([a.address, b.address])
    stranger.set_peers([a.address, b.address])
    assert b.send(0, b"from-b") == 1
    assert stranger.send(0, b"from-stranger") == 1
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += a.receive(timeout=1.0)
    assert sorted(got) == [(-1, b"from-stranger"), (1, b"from-b")]


def test_a_datagram_with_another_sessions_qkey_never_arrives(endpoint):
    a, b = open_transports(endpoint, 2)
    wrong = verbs.unpack_verbs_address(a.address)
    forged = verbs.pack_verbs_address(wrong["gid"], wrong["qpn"], wrong["lid"], QKEY + 1)
    a.set_peers([a.address, b.address])
    b.set_peers([forged, b.address])
    assert b.send(0, b"other session") == 1
    assert a.receive(timeout=1.0) == []
    b.set_peers([a.address, b.address])
    assert b.send(0, b"this session") == 1
    assert a.receive(timeout=5.0) == [(1, b"this session")]


def test_transport_refuses_a_datagram_above_its_mtu(endpoint):
    a, b = open_transports(endpoint, 2)
    a.set_peers([a.address, b.address])
    with pytest.raises(OSError, match="exceeds the 4096-byte MTU|exceeds the \\d+-byte MTU"):
        a.send(1, b"h" * 44, b"p" * (a.max_datagram_bytes - 43))
    assert a.send(1, b"h" * 44, b"p" * (a.max_datagram_bytes - 44)) == 1
    assert [len(data) for _, data in b.receive(timeout=5.0)] == [a.max_datagram_bytes]


def test_receive_ring_is_reposted_and_send_ring_wraps(endpoint):
    """Many times the depth of both rings goes through, each datagram once and in order;
    nothing is self-inflicted loss."""
    sender, receiver = open_transports(endpoint, 2, max_datagram_bytes=256, send_depth=16, recv_depth=128, signal_every=4)
    for t in (sender, receiver):
        t.set_peers([sender.address, receiver.address])
    # a receive call re-posts the buffers of the call before it, so up to 64 (max_items) of the
    # 128 can be out between calls: bursts of 64 always find a posted buffer
    total, burst = 5000, 64
    arrived = []
    for start in range(0, total, burst):
        index = start
        while index < min(start + burst, total):
            if sender.send(1, index.to_bytes(4, "little"), bytes(200)):
                index += 1
            else:  # send ring full: its completions free it
                time.sleep(0.001)
        deadline = time.monotonic() + 10
        while len(arrived) < index and time.monotonic() < deadline:
            arrived += receiver.receive(max_items=64, timeout=1.0)
        assert len(arrived) == index, f"after {index} sent, {len(arrived)} arrived"
    assert all(peer == 0 for peer, _ in arrived)
    assert [int.from_bytes(data[:4], "little") for _, data in arrived] == list(range(total))
    assert all(len(data) == 204 for _, data in arrived)


def test_wait_sleeps_instead_of_spinning_and_wakes_on_arrival(endpoint):
    a, b = open_transports(endpoint, 2)
    for t in (a, b):
        t.set_peers([a.address, b.address])
    cpu, wall = time.process_time(), time.monotonic()
    assert a.receive(timeout=1.0) == []
    waited, burned = time.monotonic() - wall, time.process_time() - cpu
    assert waited >= 0.99 and burned < 0.5 * waited, (waited, burned)
    timer = threading.Timer(0.3, lambda: b.send(0, b"wake up"))
    timer.start()
    start = time.monotonic()
    got = a.receive(timeout=10.0)
    timer.join()
    assert got == [(1, b"wake up")] and time.monotonic() - start < 3.0


def test_info_lists_devices_gids_and_the_choice(endpoint):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ud_transport", "info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    gid = verbs.format_gid(endpoint["gid"])
    assert f"{endpoint['device']}:" in text and f"active_mtu {endpoint['active_mtu']}" in text and "ACTIVE" in text
    assert f"gid {endpoint['gid_index']:3d}  {endpoint['gid_type']:7s}  {gid}" in text
    assert (f"ud_transport would use: {endpoint['device']} port {endpoint['port']} gid_index {endpoint['gid_index']} "
            f"({endpoint['gid_type']} {gid})") in text
    assert "transport='auto' resolves to: verbs" in text
