"""The verbs extension and the verbs transport on a real (soft) RDMA device, and the libibverbs
and rxe facts the transport is built on.

Runs inside the SoftRoCE guest (tests/test_verbs_bindings.py boots it); anywhere else it skips
saying why, and fails under CI. A Context closes once and refuses use after close; bad device,
port and GID index give errors naming the verb, the errno and the object; the transport
identifies senders, refuses oversized datagrams, keeps its receive ring posted, and sleeps (not
spins) in wait(). The facts below the transport (a send to a QPN that does not exist completes
and is lost; a UD send above the MTU delivers nothing; a privileged Q_Key needs CAP_NET_RAW; an
address handle needs a populated source GID) are observed with Debian's pyverbs, an
implementation nobody here wrote (pyverbs_facts.py under /usr/bin/python3, once per run).
"""
import errno
import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from conftest import skip_or_fail
from ud_transport import _verbs as verbs

QKEY = 0x1234
GRH_BYTES = 40  # in front of every received UD datagram
SYSTEM_PYTHON = "/usr/bin/python3"
FACTS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyverbs_facts.py")


@pytest.fixture(scope="module")
def endpoint():
    if verbs.verbs_active_device_count() == 0:
        skip_or_fail("no RDMA device with an active port here: these tests run in the SoftRoCE guest "
                     "(python -m pytest tests/test_verbs_bindings.py boots it)")
    return verbs.choose_endpoint()


@pytest.fixture
def device(endpoint):
    return endpoint["device"]


# ---- lifetime ---------------------------------------------------------------------------

def test_context_closes_once_and_refuses_use_after_close(endpoint):
    with verbs.Context(endpoint["device"]) as context:
        assert context.name == endpoint["device"] and not context.closed
        assert context.query_port(endpoint["port"])["active_mtu"] == endpoint["active_mtu"]
    assert context.closed
    context.close()  # idempotent
    with pytest.raises(ValueError, match="Context is closed"):
        context.query_port(endpoint["port"])
    with pytest.raises(ValueError, match="Context is closed"):
        context.gid_table()


def test_contexts_dropped_without_close_are_released(endpoint):
    for _ in range(50):
        context = verbs.Context(endpoint["device"])
        del context  # __dealloc__ closes the device; no leak of device contexts
    with verbs.Context(endpoint["device"]) as context:
        assert context.query_device()["phys_port_cnt"] >= 1


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
    with pytest.raises(verbs.VerbsError, match=rf"^ibv_query_gid_ex failed: \w+ \(\d+\) \[dev={device} port={port} gid_index={bad}\]"):
        verbs.VerbsTransport.open(device, port, bad, QKEY)


def test_transport_refuses_a_privileged_qkey_and_a_datagram_size_above_the_mtu(endpoint, device):
    with pytest.raises(OSError, match="high bit"):
        verbs.VerbsTransport.open(device, endpoint["port"], endpoint["gid_index"], 0x80000001)
    with pytest.raises(OSError, match="exceeds the port's active MTU"):
        verbs.VerbsTransport.open(device, endpoint["port"], endpoint["gid_index"], QKEY,
                                   max_datagram_bytes=endpoint["active_mtu"] + 1)


# ---- what libibverbs and rxe do, seen through pyverbs ----------------------------------------

@pytest.fixture(scope="module")
def facts(endpoint):
    """What pyverbs_facts.py saw, run once without CAP_NET_RAW (as an unprivileged rank runs)."""
    if not os.path.exists(SYSTEM_PYTHON) or subprocess.run([SYSTEM_PYTHON, "-c", "import pyverbs.qp"],
                                                          capture_output=True).returncode != 0:
        skip_or_fail(f"{SYSTEM_PYTHON} cannot import pyverbs: apt-get install python3-pyverbs")
    if shutil.which("setpriv") is None:
        skip_or_fail("setpriv (util-linux) is missing: it drops CAP_NET_RAW for the privileged Q_Key fact")
    command = ["setpriv", "--inh-caps=-net_raw", "--bounding-set=-net_raw", SYSTEM_PYTHON, FACTS_SCRIPT,
               "--device", endpoint["device"], "--port", str(endpoint["port"]),
               "--gid-index", str(endpoint["gid_index"]), "--qkey", str(QKEY)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def observed(facts, name):
    seen = facts[name]
    assert "error" not in seen, seen.get("error")
    return seen


def test_send_to_a_qpn_that_does_not_exist_completes_and_is_lost(facts):
    seen = observed(facts, "missing_qpn")
    assert seen["lost"]["sends"] == [[1, 0]], seen  # completed with IBV_WC_SUCCESS
    assert seen["lost"]["arrivals"] == [], seen
    # control: the same send to the real QPN arrives, with the GRH in front
    assert seen["control"]["sends"] == [[2, 0]], seen
    (arrival,) = seen["control"]["arrivals"]
    payload = bytes.fromhex(seen["payload"])
    assert arrival["status"] == 0 and arrival["byte_len"] == GRH_BYTES + len(payload), seen
    assert arrival["src_qp"] == seen["sender_qpn"] and bytes.fromhex(arrival["data"]) == payload, seen
    assert seen["sender_state"] == "RTS"  # the lost datagram did not hurt the QP


def test_oversized_ud_send_sends_nothing(facts, endpoint):
    """Why max_datagram_bytes is the active MTU: above it, a UD send is not delivered."""
    seen = observed(facts, "oversized_send")
    assert seen["mtu"] == endpoint["active_mtu"]
    assert [wr_id for wr_id, _ in seen["oversized"]["sends"]] == [1], seen  # the send itself completes
    assert seen["oversized"]["arrivals"] == [], seen
    # control: exactly the MTU arrives whole
    assert seen["at_mtu"]["sends"] == [[2, 0]], seen
    assert [(a["status"], a["byte_len"]) for a in seen["at_mtu"]["arrivals"]] == [(0, GRH_BYTES + seen["mtu"])], seen


def test_a_privileged_qkey_needs_cap_net_raw(facts):
    """Why the transport refuses a Q_Key with the high bit set (qkey_for_session folds the session
    to 31 bits): a rank without CAP_NET_RAW cannot give its QP one; an ordinary Q_Key works."""
    seen = observed(facts, "privileged_qkey")
    assert seen["cap_net_raw"] is False, seen
    assert seen["privileged"]["errno"] == errno.EPERM and seen["privileged"]["state"] == "RESET", seen
    assert seen["ordinary"] == {"errno": None, "state": "INIT"}, seen


def test_an_address_handle_needs_a_populated_source_gid(facts):
    """Why the transport checks its GID index with ibv_query_gid_ex at open: ibv_create_ah refuses
    an index without a GID (ENODATA on rxe), so set_peers would fail much later."""
    seen = observed(facts, "unpopulated_gid_ah")
    assert seen["errno"] == errno.ENODATA, seen


# ---- the transport ----------------------------------------------------------------------------

def open_transports(endpoint, count, **kwargs):
    return [verbs.VerbsTransport.open(endpoint["device"], endpoint["port"], endpoint["gid_index"], QKEY, **kwargs)
            for _ in range(count)]


def test_set_peers_refuses_an_address_of_the_wrong_size(endpoint):
    """Finding 3 of issue 10 on verbs: the C side reads a fixed size per peer, so a short
    address is refused before it is read past."""
    first, second = open_transports(endpoint, 2)
    good = [first.address, second.address]
    with pytest.raises(ValueError, match="peer 1's address has"):
        first.set_peers([good[0], good[1][:-1]])
    first.set_peers(good)


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
