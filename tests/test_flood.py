"""A live flood during 4-rank allreduces (ring and direct): datagrams of earlier calls captured off
loopback and replayed with their real source addresses, random bytes and truncated headers from
strangers and from real peers' addresses, headers of another session, and forged CREDIT, END
and JOIN datagrams that the checks must refuse. Inputs differ from call to call, so a replay
admitted into a later call would change its result. Every call stays exact on every rank, and
every rank counts drops."""
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import tasks
import wire_format
from conftest import skip_or_fail
from support import raw_sender, spoof
from ud_transport.lab.local_cluster import LocalCluster

WORLD, COUNT, CHUNK_BYTES = 4, 20000, 1024
CALLS_CAPTURED, CALLS_FLOODED = 3, 20
DROP_COUNTERS = ("dropped_stale", "dropped_duplicate", "dropped_foreign", "dropped_invalid", "dropped_early")
ETH_P_ALL = 0x0003


def address(raw):
    return socket.inet_ntoa(raw[:4]), struct.unpack("!H", raw[4:6])[0]


def capture_on_loopback(ports, stop, captured):
    """Every UDP datagram between two of `ports` seen on lo, once: (source, destination, payload)."""
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL)) as sniffer:
        sniffer.bind(("lo", 0))
        sniffer.settimeout(0.05)
        while not stop.is_set():
            try:
                frame, where = sniffer.recvfrom(70000)
            except socket.timeout:
                continue
            if where[2] == socket.PACKET_OUTGOING or frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_UDP:
                continue  # lo shows each packet leaving and arriving: keep one copy; IPv4 UDP only
            ip = frame[14:]
            udp = ip[(ip[0] & 15) * 4:]
            source_port, destination_port, length = struct.unpack("!HHH", udp[:6])
            if source_port in ports and destination_port in ports:
                captured.append(((socket.inet_ntoa(ip[12:16]), source_port), (socket.inet_ntoa(ip[16:20]), destination_port),
                                 bytes(udp[8:length])))


def refused_forgeries(session, sequence, source_rank):
    """Headers with the session and a real rank's address that the checks refuse whatever the call."""
    header = lambda **fields: wire_format.header(**{"session_id": session, "sequence": sequence,
                                                     "source_rank": source_rank, "contributions": 0, **fields})
    return [
        header(kind=wire_format.KIND_CREDIT, credit=2**31, step=3),                   # a credit naming a step
        header(kind=wire_format.KIND_END, step=60000),                                # an END past every step
        header(kind=wire_format.KIND_JOIN, flags=1),                                  # a JOIN flag that does not exist
        header(kind=wire_format.KIND_JOIN, credit=60000),                             # a JOIN past every step
        header(kind=wire_format.KIND_CREDIT, sequence=sequence - 5, credit=1),        # an old call's credit
        header(kind=wire_format.KIND_DATA, contributions=1, payload_bytes=4)[:30],    # a truncated header
        wire_format.header(kind=wire_format.KIND_DATA, session_id=session ^ 1, sequence=sequence,
                           source_rank=source_rank, payload_bytes=16) + bytes(16),    # another session
    ]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_a_flood_of_replays_and_forgeries_leaves_every_result_exact(algorithm):
    if os.geteuid() != 0:
        skip_or_fail("capturing on loopback and forging source addresses needs raw sockets (root)")
    # without GSO every datagram crosses loopback as itself, so a replay is one real datagram
    with LocalCluster(WORLD, chunk_bytes=CHUNK_BYTES, environment={"UD_UDP_GSO": "0"}) as cluster:
        addresses = [address(a) for a, _ in cluster.run(tasks.address_of)]
        session = cluster.run(tasks.session_of, ranks=[0])[0]
        stop, captured = threading.Event(), []
        sniffer = threading.Thread(target=capture_on_loopback, args=({p for _, p in addresses}, stop, captured))
        sniffer.start()
        time.sleep(0.2)
        for call in range(CALLS_CAPTURED):
            cluster.run(tasks.call_dependent_allreduce, COUNT, call, algorithm)
        time.sleep(0.2)
        stop.set()
        sniffer.join()
        assert len(captured) > 100, f"captured only {len(captured)} datagrams"
        kinds = {payload[5] for _, _, payload in captured if len(payload) >= 44}
        assert {wire_format.KIND_DATA, wire_format.KIND_END, wire_format.KIND_CREDIT, wire_format.KIND_AGREE} <= kinds

        stop.clear()
        sent = {"replays": 0, "forged": 0, "garbage": 0}

        def flood():
            rng = np.random.default_rng(1)
            with raw_sender() as raw, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
                while not stop.is_set() and sent["replays"] < 20000:
                    for index in rng.permutation(len(captured))[:200]:
                        spoof(raw, *captured[index])
                        sent["replays"] += 1
                    for rank, target in enumerate(addresses):
                        peer = (rank + 1) % WORLD
                        for datagram in refused_forgeries(session, CALLS_CAPTURED + 2 + sent["forged"] % 7, peer):
                            spoof(raw, addresses[peer], target, datagram)
                            sent["forged"] += 1
                        for size in (0, 7, 44, 300):
                            stranger.sendto(rng.bytes(size), target)
                            sent["garbage"] += 1
                    time.sleep(0.002)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        while sent["replays"] == 0 and flooder.is_alive():
            time.sleep(0.01)  # the flood is on before the first call
        try:
            outcomes = [cluster.run(tasks.call_dependent_allreduce, COUNT, call, algorithm)
                        for call in range(CALLS_CAPTURED, CALLS_CAPTURED + CALLS_FLOODED)]
        finally:
            stop.set()
            flooder.join()
    dropped = [0] * WORLD
    for call, per_rank in enumerate(outcomes):
        for rank, (exact, stats) in enumerate(per_rank):
            assert exact and stats.delivered_fraction == 1.0, (call, rank, stats)
            dropped[rank] += sum(getattr(stats, name) for name in DROP_COUNTERS)
    assert min(sent.values()) > 0, sent
    assert all(count > 0 for count in dropped), (dropped, sent)
