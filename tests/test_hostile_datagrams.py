"""Strangers are dropped, not trusted: garbage, foreign, truncated, stale and
duplicate datagrams arrive during real collectives; results stay exact and
every drop is counted, in the counter its kind belongs to, on every rank."""
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import tasks
import wire_format
from conftest import get_cluster, skip_or_fail
from support import rank_fill_sum, raw_sender, spoof
from ud_transport import _native

WORLD, COUNT, CHUNK_BYTES = 3, 3000, 256
DROP_COUNTERS = ("dropped_stale", "dropped_duplicate", "dropped_foreign", "dropped_invalid", "dropped_early")


def address(raw):
    return socket.inet_ntoa(raw[:4]), struct.unpack("!H", raw[4:6])[0]


def drops(stats):
    return {name: getattr(stats, name) for name in DROP_COUNTERS}


def quiet_call(cluster, algorithm=None):
    """Calls until one sees no drop on any rank: whatever earlier tests left
    queued in the sockets is read and counted by then. Returns its stats."""
    for _ in range(500):
        per_rank = [stats for _, stats in cluster.run(tasks.stats_after_allreduce, COUNT, 10.0, algorithm)]
        if not any(any(drops(stats).values()) for stats in per_rank):
            return per_rank
    pytest.fail("the sockets never went quiet")


def stranger_datagrams(rng, session):
    """One round of datagrams from an address that is no rank's:
    (datagram, counter it must land in)."""
    out = [(rng.bytes(size), "dropped_invalid") for size in (0, 1, 43)]  # shorter than a header
    out += [(rng.bytes(size), "dropped_foreign") for size in (44, 300, 1500)]  # random magic
    # a well-formed header from another job (wrong session), and one with our session but a stranger's address
    out.append((wire_format.header(kind=1, session_id=session ^ 0x5A5A, sequence=1, source_rank=2) + bytes(16),
                "dropped_foreign"))
    out.append((wire_format.header(kind=1, session_id=session, sequence=1, source_rank=1) + bytes(16), "dropped_foreign"))
    return out


def test_garbage_from_strangers_is_dropped_and_counted_exactly_on_every_rank():
    cluster = get_cluster(WORLD, chunk_bytes=CHUNK_BYTES)
    targets = [address(a) for a, _ in cluster.run(tasks.address_of)]
    session = cluster.run(tasks.session_of, ranks=[0])[0]
    quiet_call(cluster)
    stop = threading.Event()
    sent = [dict.fromkeys(DROP_COUNTERS, 0) for _ in range(WORLD)]

    def flood():
        rng = np.random.default_rng(0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            for _ in range(400):  # bounded: the socket buffers hold all of it even if a rank is slow
                if stop.is_set():
                    break
                for rank, target in enumerate(targets):
                    for datagram, counter in stranger_datagrams(rng, session):
                        stranger.sendto(datagram, target)
                        sent[rank][counter] += 1
                time.sleep(0.002)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        outcomes = [cluster.run(tasks.stats_after_allreduce, COUNT, 10.0) for _ in range(20)]
    finally:
        stop.set()
        flooder.join()
    # one more call reads what arrived after the last one: a rank cannot finish it
    # without reading its peers' datagrams, which queue behind the strangers'
    outcomes.append(cluster.run(tasks.stats_after_allreduce, COUNT, 10.0))
    counted = [dict.fromkeys(DROP_COUNTERS, 0) for _ in range(WORLD)]
    for call, per_rank in enumerate(outcomes):
        for rank, (tensor, stats) in enumerate(per_rank):
            assert np.all(tensor == rank_fill_sum(WORLD)) and stats.delivered_fraction == 1.0, (call, rank, stats)
            for name, value in drops(stats).items():
                counted[rank][name] += value
    for rank in range(WORLD):
        assert sent[rank]["dropped_invalid"] > 0 and sent[rank]["dropped_foreign"] > 0
        assert counted[rank] == sent[rank], f"rank {rank}: counted {counted[rank]}, sent {sent[rank]}"


def spoof_once(source, destination, payload):
    """Send one UDP datagram with a forged source address (raw socket, root only)."""
    with raw_sender() as raw:
        spoof(raw, source, destination, payload)


def forgeries(rank, algorithm, session, sequence, layout):
    """What to forge against `rank` in call `sequence`: [(source rank whose
    address it carries, datagram, counter it must land in or None if admitted)].

    The schedule says what `rank` expects first: step 0, chunk 0 of a block,
    from one peer (`upstream`), whose input is upstream + 1 everywhere."""
    _, steps = _native.schedule(_native.COLLECTIVE_ALLREDUCE, wire_format.ALGORITHMS[algorithm], rank, WORLD, 0,
                                sequence % WORLD)
    upstream = steps[0]["recv_peer"]
    other = ({*range(WORLD)} - {rank, upstream}).pop()  # a real peer the schedule expects nothing from in step 0
    chunk_elements = CHUNK_BYTES // 4
    assert steps[0]["recv_needs_sent"] == 0 and COUNT // WORLD >= 4 * chunk_elements
    payload = np.full(chunk_elements, upstream + 1, dtype="<f4").tobytes()
    block = steps[0]["recv_block"]
    block_chunks = -(-(_native.block_start(COUNT, WORLD, block + 1) - _native.block_start(COUNT, WORLD, block))
                     // chunk_elements)
    assert steps[0]["recv_whole"]  # a reduce step: the sender sends every chunk of the block

    downstream = steps[0]["send_peer"]

    def credit(value, **fields):
        fields = {"kind": wire_format.KIND_CREDIT, "session_id": session, "sequence": sequence, "source_rank": downstream,
                  "contributions": 0, "layout": layout, "credit": value, **fields}
        return wire_format.header(**fields)

    def data(chunk, source=upstream, **fields):
        fields = {"kind": wire_format.KIND_DATA, "session_id": session, "sequence": sequence, "source_rank": source,
                  "chunk_index": chunk, "payload_bytes": len(payload), "layout": layout, "credit": block_chunks,
                  **fields}
        return wire_format.header(**fields) + payload

    def verdict(**fields):
        fields = {"kind": wire_format.KIND_AGREE, "session_id": session, "sequence": sequence, "source_rank": upstream,
                  "contributions": 0, "payload_bytes": 32, "layout": layout, **fields}
        return wire_format.header(**fields) + bytes(32)  # a plausible verdict: counts 0, budget 0

    relayed, reply = wire_format.AGREE_RELAYED, wire_format.AGREE_REPLY
    return [
        # a relay (another rank's verdict passed on) must be a reply, name a third rank of the
        # world, and carry no acknowledgement nor say it was sent before; a hint names a rank of
        # the world; no other flag
        (upstream, verdict(flags=relayed, chunk_index=other), "dropped_invalid"),
        (upstream, verdict(flags=relayed | reply, chunk_index=WORLD), "dropped_invalid"),
        (upstream, verdict(flags=relayed | reply, chunk_index=rank), "dropped_invalid"),
        (upstream, verdict(flags=relayed | reply, chunk_index=upstream), "dropped_invalid"),
        (upstream, verdict(flags=relayed | reply | wire_format.AGREE_HAVE_YOURS, chunk_index=other), "dropped_invalid"),
        (upstream, verdict(flags=relayed | reply | wire_format.AGREE_AGAIN, chunk_index=other), "dropped_invalid"),
        (upstream, verdict(flags=32), "dropped_invalid"),
        (upstream, verdict(chunk_index=WORLD + 1), "dropped_invalid"),
        # then: the chunk count a sender announces (finding 7) is known from the schedule here;
        # believed, one chunk would close the step and lose the rest, blamed on nobody
        (upstream, data(2, credit=1), "dropped_invalid"),
        (upstream, data(0), None),  # a faithful copy arrives first, so the real one becomes the duplicate
        (upstream, data(1, sequence=sequence - 1), "dropped_stale"),  # the previous call's
        (upstream, data(10**6), "dropped_invalid"),  # chunk out of range
        (upstream, data(1, step=99), "dropped_invalid"),  # step out of range
        (upstream, data(2, payload_bytes=len(payload) + 8), "dropped_invalid"),  # length lies
        (upstream, data(2, reserved=1), "dropped_invalid"),  # reserved must be 0
        (upstream, data(2, phase=wire_format.PHASE_GATHER), "dropped_invalid"),  # step 0 is in the reduce half
        (upstream, data(2, contributions=0), "dropped_invalid"),  # a payload that sums nobody
        # at step 0 the sender's piece is its own input alone, in a ring and in a direct exchange;
        # believed, a count of 2 made the chunk look complete and the last real piece be refused
        (upstream, data(3, contributions=2), "dropped_invalid"),
        (upstream, data(2, kind=9), "dropped_invalid"),  # no such kind
        (upstream, data(2, credit=block_chunks + 1), "dropped_invalid"),  # more chunks announced than the block has
        (upstream, wire_format.header(kind=wire_format.KIND_AGREE, session_id=session, sequence=sequence,
                                      source_rank=upstream, payload_bytes=16, layout=layout) + bytes(16),
         "dropped_invalid"),  # a verdict of the wrong size
        (other, data(2, source=other), "dropped_invalid"),  # a real peer, but not the one step 0 names
        (upstream, data(3, source=other), "dropped_foreign"),  # claims another rank than its address
        (upstream, data(3, version=1), "dropped_foreign"),  # the wire format before schedules
        # credits (finding 6): beyond the end of every send step to that peer, carrying a payload,
        # naming a step, or for another layout; each counted, none moves a credit limit
        (downstream, credit(2**31), "dropped_invalid"),
        (downstream, credit(1, payload_bytes=16) + bytes(16), "dropped_invalid"),
        (downstream, credit(1, step=1), "dropped_invalid"),
        (downstream, credit(1, layout=layout ^ 1), "dropped_invalid"),
    ]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_stale_duplicate_and_out_of_range_from_a_real_peer_address(algorithm):
    """Datagrams that carry a real peer's address and the session: every rank
    still checks sequence, step, the peer its schedule names, phase, chunk
    range, lengths, reserved bits and duplicates, and counts each drop once,
    in its own counter."""
    if os.geteuid() != 0:
        skip_or_fail("forging a peer's source address needs a raw socket (root)")
    cluster = get_cluster(WORLD, chunk_bytes=CHUNK_BYTES)
    addresses = [address(a) for a, _ in cluster.run(tasks.address_of)]
    session = cluster.run(tasks.session_of, ranks=[0])[0]
    sequences = {stats.sequence for stats in quiet_call(cluster, algorithm)}
    assert len(sequences) == 1
    next_sequence = sequences.pop() + 1
    layout = wire_format.layout_tag(COUNT, "float32", 0, CHUNK_BYTES, algorithm=algorithm)
    want = []
    for rank in range(WORLD):
        forged = forgeries(rank, algorithm, session, next_sequence, layout)
        for source, datagram, _ in forged:
            spoof_once(addresses[source], addresses[rank], datagram)
        counters = dict.fromkeys(DROP_COUNTERS, 0)
        for _, _, counter in forged:
            if counter:
                counters[counter] += 1
        counters["dropped_duplicate"] += 1  # the real chunk 0, after its forged copy
        want.append(counters)
    for rank, (tensor, stats) in enumerate(cluster.run(tasks.stats_after_allreduce, COUNT, 10.0, algorithm)):
        assert stats.sequence == next_sequence
        assert np.all(tensor == rank_fill_sum(WORLD)) and stats.delivered_fraction == 1.0, (rank, stats)
        assert drops(stats) == want[rank], f"rank {rank}: counted {drops(stats)}, forged {want[rank]}"


def test_a_forged_credit_lets_a_sender_send_at_most_one_window():
    """Finding 6: rank 1 is not in the call, so it grants nothing; a forged CREDIT
    from its address grants rank 0 everything the schedule allows. Rank 0 still
    sends no more than one window of chunks (16 here) before it waits for a
    credit from rank 1 itself; believed, the credit sent all 1024 chunks of
    the step at a receiver that was not reading."""
    if os.geteuid() != 0:
        skip_or_fail("forging a peer's source address needs a raw socket (root)")
    chunk_bytes, count, window_chunks = 256, 64 * 1024, 16
    # credits refreshed rarely: what rank 0 sends is then its data, its END markers and a few credits
    cluster = get_cluster(2, chunk_bytes=chunk_bytes, window_bytes=window_chunks * chunk_bytes,
                          credit_refresh_us=10_000_000)
    addresses = [address(a) for a, _ in cluster.run(tasks.address_of)]
    session = cluster.run(tasks.session_of, ranks=[0])[0]
    _, steps = _native.schedule(_native.COLLECTIVE_ALLREDUCE, wire_format.ALGORITHMS["ring"], 0, 2, 0, 1)
    max_chunks = count // 2 // (chunk_bytes // 4)
    ceiling = max(g * max_chunks + max_chunks for g, step in enumerate(steps) if step["send_peer"] == 1)
    credit = wire_format.header(kind=wire_format.KIND_CREDIT, session_id=session, sequence=1, source_rank=1,
                                contributions=0, layout=wire_format.layout_tag(count, "float32", 0, chunk_bytes,
                                                                               algorithm="ring"), credit=ceiling)
    spoof_once(addresses[1], addresses[0], credit)
    sent, stalls = cluster.run(tasks.alone_allreduce_sent, count, 1.0, "ring", ranks=[0])[0]
    assert stalls > 0
    assert window_chunks <= sent <= window_chunks + 8, sent  # a window of data, and a credit or two of its own
