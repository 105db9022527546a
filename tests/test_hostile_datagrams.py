"""Strangers are dropped, not trusted: garbage, foreign, truncated, stale and
duplicate datagrams arrive during real allreduces; results stay exact and
every drop is counted."""
import os
import socket
import struct
import threading

import numpy as np
import pytest

import tasks
import wire_format
from conftest import get_cluster, skip_or_fail
from ud_transport import _native

WORLD, COUNT, CHUNK_BYTES = 3, 3000, 256


def address(raw):
    return socket.inet_ntoa(raw[:4]), struct.unpack("!H", raw[4:6])[0]


def expected():
    return WORLD * (WORLD + 1) / 2


def test_garbage_from_strangers_is_dropped_and_counted():
    cluster = get_cluster(WORLD, chunk_bytes=CHUNK_BYTES)
    target = address(cluster.run(tasks.address_of, ranks=[0])[0][0])
    stop = threading.Event()
    sent = [0]

    def flood():
        rng = np.random.default_rng(0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            while not stop.is_set():
                for size in (0, 1, 43, 44, 300, 1500):
                    stranger.sendto(rng.bytes(size), target)
                # well-formed header, wrong session: a datagram from another job
                stranger.sendto(wire_format.header(kind=1, session_id=12345, sequence=1, source_rank=2) + bytes(16), target)
                sent[0] += 7

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        outcomes = [cluster.run(tasks.stats_after_allreduce, COUNT, 10.0) for _ in range(20)]
    finally:
        stop.set()
        flooder.join()
    dropped = 0
    for per_rank in outcomes:
        for tensor, stats in per_rank:
            assert np.all(tensor == expected()) and stats.delivered_fraction == 1.0
        dropped += per_rank[0][1].dropped_invalid + per_rank[0][1].dropped_foreign
    assert sent[0] > 0 and dropped > 0


def spoof(source, destination, payload):
    """Send a UDP datagram with a forged source address (raw socket, root only)."""
    udp = struct.pack("!HHHH", source[1], destination[1], 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(source[0]), socket.inet_aton(destination[0]))
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
        raw.sendto(ip + udp, (destination[0], 0))


def test_stale_duplicate_and_out_of_range_from_a_real_peer_address():
    """Datagrams that carry the real upstream's address and session: the engine
    must still check sequence, step, chunk range, lengths and duplicates."""
    if os.geteuid() != 0:
        skip_or_fail("forging a peer's source address needs a raw socket (root)")
    cluster = get_cluster(WORLD, chunk_bytes=CHUNK_BYTES)
    addresses = [address(a) for a, _ in cluster.run(tasks.address_of)]
    session = cluster.run(tasks.session_of, "ud_transport/comm0", ranks=[0])[0]
    # Warm-up calls until rank 0's socket holds nothing from earlier tests (a flood can leave
    # thousands of datagrams queued, and a full socket would drop the forged ones); the last
    # one also tells us how many calls rank 0 has made so far.
    for _ in range(500):
        warm_up = cluster.run(tasks.stats_after_allreduce, COUNT, 10.0)[0][1]
        if warm_up.dropped_invalid + warm_up.dropped_foreign == 0:
            break
    sequence = warm_up.sequence
    next_sequence = sequence + 1
    algorithm = "direct" if WORLD > 2 else "ring"  # what "auto" runs
    layout = wire_format.layout_tag(COUNT, "float32", 0, CHUNK_BYTES, algorithm=algorithm)
    chunk_elements = CHUNK_BYTES // 4
    # What rank 0's schedule expects first in the next call, from whom, byte for byte:
    # step 0, chunk 0 of the block it receives, the sender's own input (rank + 1 everywhere).
    _, steps = _native.schedule(_native.COLLECTIVE_ALLREDUCE, wire_format.ALGORITHMS[algorithm], 0, WORLD, 0,
                                next_sequence % WORLD)
    upstream, block = steps[0]["recv_peer"], steps[0]["recv_block"]
    assert steps[0]["recv_needs_sent"] == 0 and COUNT // WORLD >= 4 * chunk_elements
    payload = np.full(chunk_elements, upstream + 1, dtype="<f4").tobytes()
    genuine_copy = wire_format.header(kind=1, session_id=session, sequence=next_sequence, source_rank=upstream,
                                      chunk_index=0, payload_bytes=len(payload), layout=layout) + payload
    forged = [
        genuine_copy,  # arrives first, so the real one becomes the duplicate
        wire_format.header(kind=1, session_id=session, sequence=sequence, source_rank=upstream, chunk_index=1,
                           payload_bytes=len(payload), layout=layout) + payload,  # previous call: stale
        wire_format.header(kind=1, session_id=session, sequence=next_sequence, source_rank=upstream, chunk_index=10**6,
                           payload_bytes=len(payload), layout=layout) + payload,  # chunk out of range
        wire_format.header(kind=1, session_id=session, sequence=next_sequence, source_rank=upstream, step=99,
                           payload_bytes=len(payload), layout=layout) + payload,  # step out of range
        wire_format.header(kind=1, session_id=session, sequence=next_sequence, source_rank=upstream, chunk_index=2,
                           payload_bytes=len(payload) + 8, layout=layout) + payload,  # length lies
        wire_format.header(kind=1, session_id=session, sequence=next_sequence, source_rank=1, chunk_index=3,
                           payload_bytes=len(payload), layout=layout) + payload,  # claims another rank
    ]
    for datagram in forged:
        spoof(addresses[upstream], addresses[0], datagram)
    tensor, stats = cluster.run(tasks.stats_after_allreduce, COUNT, 10.0)[0]
    assert stats.sequence == next_sequence
    assert np.all(tensor == expected()) and stats.delivered_fraction == 1.0
    assert stats.dropped_duplicate >= 1, stats
    assert stats.dropped_stale >= 1, stats
    assert stats.dropped_invalid >= 3, stats
    assert stats.dropped_foreign >= 1, stats
