"""The UDP transport's kernel batching (native/transport_udp.c): GSO on send (one
sendmsg carries a run of same-size datagrams to one peer), GRO on receive (one
receive returns many datagrams, split back into separate items), the fallback
when the kernel refuses GSO, and the receive buffer the kernel granted.

The transport is driven directly through the compiled extension's C symbols
(ctypes, tests/udp_ctypes.py), so these tests see exactly what the engine sees. On loopback the
kernel hands a GSO message whole to a socket with UDP_GRO, so a GRO split is
certain there; the namespace tests cross a real veth link."""
import os
import socket
import subprocess
import sys
import time

import pytest

import ud_transport
from conftest import get_cluster, skip_or_fail
from support import child_environment
from udp_ctypes import (UDT_SEND_APART, UDT_UDP_DROPS_COUNTED, UDT_UDP_GRO, UDT_UDP_GSO, UDT_UDP_GSO_REFUSED,
                        UDT_UDP_PATH_MTU_IGNORED, UDT_UDP_RCVBUF_FORCED, Udp, lib)


def header(tag, index):
    """A 32-byte header naming its stream and position."""
    return f"{tag}:{index:08d}:".encode().ljust(32, b"#")


def payload(index, size):
    return bytes((index * 7 + k) & 0xFF for k in range(size))


def datagram(tag, index, size):
    """(header, payload) whose total is `size` bytes."""
    return header(tag, index), payload(index, size - 32)


def expected_messages(datagrams, max_datagram_bytes):
    """How many sendmsg messages the GSO rule makes of a send: consecutive datagrams to one peer of the
    first one's size (one shorter may end the run), at most 64 and 65000 bytes."""
    messages, i = 0, 0
    while i < len(datagrams):
        peer, size = datagrams[i][0], len(datagrams[i][1]) + len(datagrams[i][2])
        run, total = 1, size
        if 0 < size <= max_datagram_bytes:
            while i + run < len(datagrams) and run < 64:
                p, h, d = datagrams[i + run]
                if p != peer or not 0 < len(h) + len(d) <= size or total + len(h) + len(d) > 65000:
                    break
                total += len(h) + len(d)
                run += 1
                if len(h) + len(d) < size:
                    break
        messages += 1
        i += run
    return messages


@pytest.fixture
def transports():
    opened = []

    def make(count, **kwargs):
        made = [Udp(**kwargs) for _ in range(count)]
        opened.extend(made)
        return made

    yield make
    for t in opened:
        t.close()


def require_gso_gro(*ts):
    for t in ts:
        if not t.features & UDT_UDP_GSO or not t.features & UDT_UDP_GRO:
            skip_or_fail(f"this kernel gives no UDP GSO/GRO on loopback ({t.describe()})")


# ---- loopback -------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_items", [64, 7, 1])
def test_gro_train_is_split_into_its_datagrams_in_order(transports, max_items):
    sender, receiver = transports(2)
    require_gso_gro(sender, receiver)
    sender.set_peers(receiver)
    receiver.set_peers(sender)
    # 40 datagrams of 1000 bytes and a shorter last one: one GSO message, one GRO receive
    sent = [(0, *datagram("run", i, 1000)) for i in range(40)] + [(0, *datagram("run", 40, 300))]
    sender.send(sent)
    got = receiver.receive(len(sent), max_items=max_items)
    assert [len(data) for _, data in got] == [1000] * 40 + [300]
    assert [data for _, data in got] == [h + p for _, h, p in sent]
    assert all(peer == 0 for peer, _ in got)
    assert receiver.quiet() == []
    assert sender.counters["send_gso_messages"] == 1 and sender.counters["send_gso_datagrams"] == 41
    counters = receiver.counters
    assert counters["recv_messages"] == 1 and counters["recv_gro_messages"] == 1
    assert counters["recv_gro_datagrams"] == 41


@pytest.mark.parametrize("receivers_gro", [True, False], ids=["receivers-gro", "receivers-plain"])
def test_coalesced_send_of_mixed_sizes_and_peers_is_delivered_exactly(transports, receivers_gro):
    sender, b, c = transports(3)
    require_gso_gro(sender)
    if not receivers_gro:
        for t in (b, c):
            assert lib.udt_udp_disable(t.ptr, UDT_UDP_GRO) == 0
            assert not t.features & UDT_UDP_GRO
    sender.set_peers(b, c)
    b.set_peers(sender)
    c.set_peers(sender)
    plan = [(0, 800)] * 5 + [(1, 800)] * 3 + [(0, 500)] * 4 + [(0, 200)] + [(0, 500)] * 2 + [(1, 1200)] \
        + [(0, 32)] * 6 + [(1, 32)] + [(0, 1400)] * 70 + [(1, 9000)] * 9 + [(1, 9000)] + [(0, 64)] + [(0, 100)]
    counters = {0: 0, 1: 0}
    sent = []
    for peer, size in plan:
        sent.append((peer, *datagram("bc"[peer], counters[peer], size)))
        counters[peer] += 1
    sender.send(sent)
    for peer, receiver in ((0, b), (1, c)):
        want = [h + p for q, h, p in sent if q == peer]
        got = receiver.receive(len(want), max_items=16)
        assert [len(d) for _, d in got] == [len(w) for w in want]
        assert [d for _, d in got] == want
        assert {p for p, _ in got} == {0}
        assert receiver.quiet() == []
        if not receivers_gro:
            assert receiver.counters["recv_gro_messages"] == 0
    assert sender.counters["send_messages"] == expected_messages(sent, sender.max_datagram_bytes)
    assert sender.counters["send_gso_messages"] >= 8


def test_a_copy_starts_a_message_of_its_own(transports):
    """An item marked UDT_SEND_APART (a copy of one before it) is not folded into the GSO message
    before it: on loopback, and wherever a packet is dropped before segmentation, one message is
    one fate. Three copies of a control message, then a run of the same size: three messages, the
last a GSO one that the third copy starts and the run joins."""
    sender, receiver = transports(2)
    require_gso_gro(sender, receiver)
    sender.set_peers(receiver)
    receiver.set_peers(sender)
    copy = datagram("ctl", 0, 100)
    sent = [(0, *copy), (0, *copy, UDT_SEND_APART), (0, *copy, UDT_SEND_APART)] + \
        [(0, *datagram("run", i, 100)) for i in range(5)]
    sender.send(sent)
    got = receiver.receive(len(sent))
    assert [data for _, data in got] == [h + p for _, h, p, *_ in sent]
    assert sender.counters["send_messages"] == 3
    assert sender.counters["send_gso_messages"] == 1 and sender.counters["send_gso_datagrams"] == 6


def test_gso_and_gro_off_by_environment_give_the_plain_path(transports, monkeypatch):
    monkeypatch.setenv("UD_UDP_GSO", "0")
    monkeypatch.setenv("UD_UDP_GRO", "off")
    sender, receiver = transports(2)
    assert sender.features & (UDT_UDP_GSO | UDT_UDP_GRO) == 0
    assert "gso=off gro=off" in sender.describe()
    sender.set_peers(receiver)
    receiver.set_peers(sender)
    sent = [(0, *datagram("plain", i, 1200)) for i in range(50)] + [(0, *datagram("plain", 50, 40))]
    sender.send(sent)
    got = receiver.receive(len(sent))
    assert [d for _, d in got] == [h + p for _, h, p in sent]
    assert sender.counters["send_gso_messages"] == 0 and sender.counters["send_messages"] == len(sent)
    assert receiver.counters["recv_gro_messages"] == 0


def test_gso_disabled_at_run_time_sends_one_message_per_datagram(transports):
    sender, receiver = transports(2)
    require_gso_gro(sender)
    sender.set_peers(receiver)
    receiver.set_peers(sender)
    assert lib.udt_udp_disable(sender.ptr, UDT_UDP_GSO) == 0
    sent = [(0, *datagram("off", i, 1000)) for i in range(20)]
    sender.send(sent)
    assert [d for _, d in receiver.receive(20)] == [h + p for _, h, p in sent]
    assert sender.counters["send_messages"] == 20 and sender.counters["send_gso_messages"] == 0


def test_datagrams_larger_than_a_gso_message_go_alone(transports):
    sender, receiver = transports(2)
    sender.set_peers(receiver)
    receiver.set_peers(sender)
    big = min(sender.max_datagram_bytes, 40000)
    sent = [(0, *datagram("big", i, big)) for i in range(4)]
    sender.send(sent)
    assert [d for _, d in receiver.receive(4)] == [h + p for _, h, p in sent]
    assert sender.counters["send_gso_messages"] == 0


def test_receive_buffer_granted_is_read_back(transports):
    asked = 1 << 20
    (t,) = transports(1, buffer_bytes=asked)
    granted = lib.udt_udp_receive_buffer_bytes(t.ptr)
    with open("/proc/sys/net/core/rmem_max") as f:
        rmem_max = int(f.read())
    if t.features & UDT_UDP_RCVBUF_FORCED or asked <= rmem_max:
        assert granted == 2 * asked  # the kernel doubles it for its bookkeeping
    else:
        assert granted == 2 * rmem_max
    assert lib.udt_udp_send_buffer_bytes(t.ptr) > 0
    assert f"rcvbuf={granted}" in t.describe()
    assert lib.udt_udp_receive_buffer_bytes(None) == 0 and lib.udt_udp_features(None) == 0


DROP_CAP_NET_ADMIN = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
data = (ctypes.c_uint32 * 6)()                 # {effective, permitted, inheritable} x 2 words
assert libc.capget(header, data) == 0
CAP_NET_ADMIN = 12
data[0] &= ~(1 << CAP_NET_ADMIN)
data[1] &= ~(1 << CAP_NET_ADMIN)
assert libc.capset(header, data) == 0, ctypes.get_errno()
"""


def test_receive_buffer_without_cap_net_admin_is_capped_by_rmem_max():
    """Without CAP_NET_ADMIN, SO_RCVBUFFORCE fails and the kernel caps the buffer at net.core.rmem_max:
    what the transport reports is what the kernel granted, not what was asked."""
    if os.geteuid() != 0:
        skip_or_fail("needs root, to drop CAP_NET_ADMIN and compare")
    with open("/proc/sys/net/core/rmem_max") as f:
        rmem_max = int(f.read())
    probe = ("import udp_ctypes as t\n" + DROP_CAP_NET_ADMIN
             + f"u = t.Udp(buffer_bytes={4 * rmem_max})\n"
             + "print(t.lib.udt_udp_receive_buffer_bytes(u.ptr), u.features)\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env=child_environment())
    assert run.returncode == 0, run.stderr
    granted, features = map(int, run.stdout.split())
    assert not features & UDT_UDP_RCVBUF_FORCED
    assert granted == 2 * rmem_max


# ---- across a veth link (network namespaces) ------------------------------------------------------

@pytest.fixture(scope="module")
def jumbo_pair():
    from ud_transport.lab.hosts import Hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        skip_or_fail(f"veth hosts: {reason}")
    with Hosts(2, mtu=9000, switch=False) as hosts:
        yield hosts


@pytest.mark.netns
def test_gso_gro_across_a_veth_link_is_exact(jumbo_pair):
    hosts = jumbo_pair
    sender = hosts.in_host(0, Udp, hosts.addresses[0])
    receiver = hosts.in_host(1, Udp, hosts.addresses[1])
    try:
        assert sender.max_datagram_bytes == 9000 - 28
        require_gso_gro(sender, receiver)
        sender.set_peers(receiver)
        receiver.set_peers(sender)
        size = sender.max_datagram_bytes
        sent = [(0, *datagram("jumbo", i, size)) for i in range(7)] + [(0, *datagram("jumbo", 7, 999))]
        sent += [(0, *datagram("small", i, 1472)) for i in range(30)]
        sender.send(sent)
        got = receiver.receive(len(sent), max_items=5)
        assert [d for _, d in got] == [h + p for _, h, p in sent]
        assert receiver.quiet() == []
        assert sender.counters["send_gso_messages"] == 2
        # the link carries MTU-sized packets; the receiving interface's GRO put them back together
        assert receiver.counters["recv_gro_messages"] >= 1
    finally:
        sender.close()
        receiver.close()


@pytest.mark.netns
def test_gso_refused_by_the_kernel_falls_back_and_loses_nothing(jumbo_pair):
    """A socket whose GSO messages the kernel refuses (EINVAL: here SO_NO_CHECK, as a route
    through IPsec or, before Linux 6.x, a device without checksum offload refuses them). The
    transport turns GSO off and sends the datagrams again without it."""
    hosts = jumbo_pair
    sender = hosts.in_host(0, Udp, hosts.addresses[0])
    receiver = hosts.in_host(1, Udp, hosts.addresses[1])
    try:
        sender.send_without_checksums()
        require_gso_gro(sender, receiver)
        sender.set_peers(receiver)
        receiver.set_peers(sender)
        sent = [(0, *datagram("refused", i, 4000)) for i in range(12)] + [(0, *datagram("refused", 12, 100))]
        sender.send(sent)
        got = receiver.receive(len(sent))
        assert [d for _, d in got] == [h + p for _, h, p in sent]
        assert sender.features & UDT_UDP_GSO_REFUSED and not sender.features & UDT_UDP_GSO
        assert "kernel refused" in sender.describe()
        assert sender.counters["send_gso_messages"] == 0
        sender.send(sent[:3])  # later sends go out plainly at once
        assert [d for _, d in receiver.receive(3)] == [h + p for _, h, p in sent[:3]]
    finally:
        sender.close()
        receiver.close()


@pytest.mark.netns
def test_a_route_mtu_does_not_resize_datagrams(jumbo_pair):
    """Datagrams are sized by the interface (or the mtu option), never by the route's path MTU,
    which a forged ICMP "fragmentation needed" can lower for ten minutes (IP_PMTUDISC_PROBE, see
    SECURITY.md): with the route's MTU locked at 1500 on a 9000-byte link, GSO messages of
    4000-byte datagrams go out whole, unfragmented (DF set), and arrive whole."""
    hosts = jumbo_pair
    route = ["ip", "-n", hosts.namespaces[0], "route", "replace", f"{hosts.addresses[1]}/32", "dev", "eth0",
             "mtu", "lock", "1500"]
    subprocess.run(route, check=True)
    sender = hosts.in_host(0, Udp, hosts.addresses[0])
    receiver = hosts.in_host(1, Udp, hosts.addresses[1])
    try:
        require_gso_gro(sender, receiver)
        assert sender.features & UDT_UDP_PATH_MTU_IGNORED
        sender.set_peers(receiver)
        receiver.set_peers(sender)
        sent = [(0, *datagram("whole", i, 4000)) for i in range(12)]
        sender.send(sent)
        assert [d for _, d in receiver.receive(len(sent))] == [h + p for _, h, p in sent]
        assert sender.counters["send_gso_messages"] >= 1 and not sender.features & UDT_UDP_GSO_REFUSED
    finally:
        sender.close()
        receiver.close()
        subprocess.run(["ip", "-n", hosts.namespaces[0], "route", "del", f"{hosts.addresses[1]}/32"], check=False)


@pytest.mark.netns
def test_switch_drops_single_datagrams_not_gso_trains():
    """Hosts' loss sits in the switch, where a link carries MTU-sized packets: a GSO message of 32
    datagrams loses some of them, not all or none (as an input hook behind GRO would). The switch
    does no IP filtering of bridged frames (where br_netfilter is loaded), and its loss rules work
    without it."""
    from ud_transport.lab.hosts import Hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        skip_or_fail(f"veth hosts: {reason}")
    with Hosts(3, mtu=1500, udp_loss=0.2) as hosts:
        sender = hosts.in_host(0, Udp, hosts.addresses[0])
        receiver = hosts.in_host(2, Udp, hosts.addresses[2])
        try:
            require_gso_gro(sender, receiver)
            sender.set_peers(receiver)
            receiver.set_peers(sender)
            runs, size = 40, sender.max_datagram_bytes
            for run in range(runs):
                sender.send([(0, *datagram(f"r{run:03d}", i, size)) for i in range(32)])
                time.sleep(0.002)
            got = receiver.receive(runs * 32, timeout=1.0)
            assert sender.counters["send_gso_messages"] == runs
            per_run = [sum(1 for _, d in got if d.startswith(f"r{run:03d}".encode())) for run in range(runs)]
            assert 0.7 < sum(per_run) / (32 * runs) < 0.9, per_run  # 20% lost, as datagrams
            assert sum(1 for n in per_run if 0 < n < 32) >= runs // 2, per_run
            assert hosts.dropped_packets("udp") == runs * 32 - len(got)
            filtering = subprocess.run(["ip", "netns", "exec", hosts.switch_namespace, "sh", "-c",
                                        "cat /proc/sys/net/bridge/bridge-nf-call-* 2>/dev/null; true"],
                                       capture_output=True, text=True, check=True).stdout.split()
            assert set(filtering) <= {"0"}, filtering
        finally:
            sender.close()
            receiver.close()


@pytest.mark.netns
def test_allreduce_between_hosts_on_a_bridge_is_exact():
    """Three ranks, each in its own host at MTU 1500: the engine's datagrams cross real links (GSO
    on send, GRO on receive) and the result is exact."""
    import tasks
    from ud_transport.lab.hosts import Hosts, unavailable_reason
    from ud_transport.lab.local_cluster import LocalCluster

    reason = unavailable_reason()
    if reason:
        skip_or_fail(f"veth hosts: {reason}")
    with Hosts(3, mtu=1500) as hosts, LocalCluster(3, hosts=hosts) as cluster:
        for rank, (address, chunk_bytes) in enumerate(cluster.run(tasks.address_of)):
            assert address[:4] == socket.inet_aton(hosts.addresses[rank])  # UDP address: IPv4 + port
            assert chunk_bytes <= 1500 - 28 - 32
        for fractions, lost, exact in cluster.run(tasks.many_large, (4 << 20) // 4, 2):
            assert fractions == [1.0, 1.0] and lost == 0 and exact


def test_datagrams_dropped_at_a_full_socket_are_counted_exactly():
    """Self-inflicted loss is not silent: with a small receive buffer and nobody receiving, the
    kernel drops what does not fit, and the transport counts those drops (SO_RXQ_OVFL) so that
    what arrived plus what the kernel dropped is exactly what was sent."""
    receiver = Udp(buffer_bytes=64 << 10)
    try:
        assert receiver.features & UDT_UDP_DROPS_COUNTED, receiver.describe()
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        target = (socket.inet_ntoa(receiver.address[:4]), int.from_bytes(receiver.address[4:6], "big"))
        sent = 2000
        for index in range(sent):
            sender.sendto(header("burst", index) + payload(index, 968), target)
        arrived = receiver.quiet(0.2)
        assert 0 < len(arrived) < sent, f"{len(arrived)} of {sent} arrived: the buffer did not overflow"
        # the kernel reports its drop count with each datagram it queues: one more tells the total
        sender.sendto(header("probe", sent) + payload(sent, 968), target)
        arrived += receiver.receive(1)
        sender.close()
        assert arrived[-1][1].startswith(b"probe:"), "the probe did not arrive"
        overflows = receiver.ptr.contents.counter_receive_overflows
        assert overflows > 0 and len(arrived) + overflows == sent + 1, (len(arrived), overflows)
    finally:
        receiver.close()


SEND_BATCH = 32  # native/engine_internal.h (a build with -DSEND_BATCH=N, for measuring, needs this changed too)


COUNTED_SETUPS = {"plain": {}, "loss wrapper": {"inject": ud_transport.Bernoulli(0.0, seed=1)}, "2 stripes": {"stripes": 2}}


def test_each_pass_of_a_call_in_copies_goes_in_messages_of_its_own():
    """A broadcast sent in 3 copies goes out as three passes, each in the GSO messages one pass
    alone makes: no pass is folded into another's message, where one dropped packet would take a
    chunk and its copies together (tests/test_kernel_loss.py shows what that cost)."""
    import tasks

    cluster = get_cluster(2, chunk_bytes=1400)
    once = cluster.run(tasks.gso_counts_of_a_broadcast_in_copies, 1000, 1)[0]  # the root's
    thrice = cluster.run(tasks.gso_counts_of_a_broadcast_in_copies, 1000, 3)[0]
    if once == (0, 0):
        skip_or_fail("this kernel gives no UDP GSO on loopback")
    assert thrice == (3 * once[0], 3 * once[1]), (once, thrice)


@pytest.mark.parametrize("setup", COUNTED_SETUPS)
def test_each_call_reports_the_system_calls_it_made(setup):
    """stats.send_calls and receive_calls are the call's own sendmmsg and recvmmsg counts: a large
    call batches many MTU-sized datagrams per system call, and the small call after it reports
    only its own few. A count carried over from the large call would be larger than the large
    call's own, which the window (192 datagrams in flight) keeps at 16 or more receives for 4 MiB.
    Through the loss wrapper (injecting nothing) the counts are the inner socket's; over stripes
    they are summed, and no send call carries more than SEND_BATCH datagrams, so a count of one
    stripe's calls against both stripes' datagrams shows here (about 35 per call against the 32
    allowed). Only while a stripe averages more than 16 datagrams per call: on loopback at 1400
    bytes it averages about 18."""
    import tasks

    cluster = get_cluster(2, chunk_bytes=1400, **COUNTED_SETUPS[setup])
    for description, (large, small) in cluster.run(tasks.system_calls_of_a_large_then_a_small_call,
                                                    (4 << 20) // 4, 64):
        if "gso=on" not in description or "gro=on" not in description:
            skip_or_fail(f"this kernel gives no UDP GSO/GRO on loopback ({description})")
        sent, send_calls, receive_calls, received = large
        assert 1 <= send_calls and 4 * send_calls <= sent <= SEND_BATCH * send_calls, large  # sendmmsg batches, GSO trains
        assert 1 <= receive_calls and 4 * receive_calls <= received, large  # recvmmsg batches, GRO
        assert 1 <= small[1] <= small[0] <= SEND_BATCH * small[1] and small[1] < send_calls, (small, large)
        assert 1 <= small[2] < receive_calls, (small, large)
