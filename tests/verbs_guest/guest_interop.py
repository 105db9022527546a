"""Interop with a UD implementation nobody here wrote: Debian's pyverbs.

Runs inside the SoftRoCE guest (tests/test_verbs_interop.py boots it). pyverbs_peer.py, under
/usr/bin/python3, plays rank 0 of a two-rank allreduce by sending datagrams this file builds
from the wire format's specification (native/wire.h: 44-byte little-endian header), written
here independently of the C encoder. Our rank 1 runs the real Communicator and engine over the
verbs transport. Checked: our receiver accepts the peer's datagrams (the result is exact) and
drops and counts each piece of garbage; what our sender puts on the wire reaches pyverbs byte
for byte as specified; raw datagrams cross both ways unchanged, with a RoCEv2 GRH.
"""
import json
import os
import secrets
import struct
import subprocess
import threading

import numpy as np
import pytest

import wire_format
from conftest import skip_or_fail
from ud_transport import Communicator, _native as native, _verbs as verbs, options as options_module

SYSTEM_PYTHON = "/usr/bin/python3"
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyverbs_peer.py")

# ---- the wire format, from its specification (tests/wire_format.py) ---------------------------
HEADER = wire_format.HEADER  # magic version kind phase flags session sequence step source chunk
MAGIC, VERSION = wire_format.MAGIC, wire_format.VERSION  # contributions reserved payload layout credit
DATA, END, CREDIT, AGREE = wire_format.KIND_DATA, wire_format.KIND_END, wire_format.KIND_CREDIT, wire_format.KIND_AGREE
REDUCE_SCATTER, ALL_GATHER = 0, 1  # the phase byte: first and second half of the schedule
HAVE_YOURS = 1


def header(kind, session, sequence=1, phase=0, step=0, source=0, chunk=0, contributions=0, payload_bytes=0,
           layout=0, credit=0, flags=0):
    return wire_format.header(kind=kind, session_id=session, sequence=sequence, source_rank=source, phase=phase,
                              step=step, chunk_index=chunk, contributions=contributions, payload_bytes=payload_bytes,
                              layout=layout, credit=credit, flags=flags)


def verdict(reduce_weighted, fresh_elements, loss_budget):
    """An AGREE payload: no cause, agree value 0, this rank's counts, its budget."""
    return struct.pack("<IIQQd", 0, 0, reduce_weighted, fresh_elements, loss_budget)


# ---- the pyverbs process --------------------------------------------------------------------

class PyverbsPeer:
    def __init__(self, endpoint, qkey):
        self.process = subprocess.Popen(
            [SYSTEM_PYTHON, PEER_SCRIPT, "--device", endpoint["device"], "--port", str(endpoint["port"]),
             "--gid-index", str(endpoint["gid_index"]), "--qkey", str(qkey)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})
        self.hello = self._read()
        self.gid = bytes.fromhex(self.hello["gid"])

    def _read(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"pyverbs peer exited with status {self.process.wait(10)}")
        return json.loads(line)

    def ask(self, **command):
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def send(self, items):
        return self.ask(op="send", items=items)["sent"]

    def close(self):
        if self.process.poll() is None:
            try:
                self.ask(op="quit")
            except (BrokenPipeError, RuntimeError, ValueError):
                pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


class AnsweringStore:
    """A store in which rank 0 (the pyverbs peer) has already published its session and address."""

    def __init__(self, session, rank0_address):
        self.values, self.session, self.rank0_address = {}, session, rank0_address

    def _known(self, key):
        if key.endswith("/session"):
            return f"{self.session:016x}".encode()
        if key.endswith("/address/0"):
            return self.rank0_address
        if key.endswith(("/identity/0", "/cores/0", "/ready/0")):  # the pyverbs peer speaks this library's wire
            return self.values.get(key[:-1] + "1")  # format, in our job, on our machine, and met us when we did
        return self.values.get(key)

    def check(self, keys):
        return all(self._known(k) is not None for k in keys)

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else bytes(value)

    def add(self, key, amount):
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def get(self, key):
        value = self._known(key)
        if value is None:
            raise KeyError(key)
        return value

    def wait(self, keys, timeout=None):
        missing = [k for k in keys if self._known(k) is None]
        if missing:
            raise TimeoutError(f"keys never set: {missing}")


@pytest.fixture(scope="module")
def endpoint():
    if verbs.verbs_active_device_count() == 0:
        skip_or_fail("no RDMA device with an active port here: these tests run in the SoftRoCE guest "
                     "(python -m pytest tests/test_verbs_interop.py boots it)")
    if not os.path.exists(SYSTEM_PYTHON) or subprocess.run([SYSTEM_PYTHON, "-c", "import pyverbs.qp"],
                                                          capture_output=True).returncode != 0:
        skip_or_fail(f"{SYSTEM_PYTHON} cannot import pyverbs (apt-get install python3-pyverbs)")
    return verbs.choose_endpoint()


@pytest.fixture
def session():
    return secrets.randbits(64)


@pytest.fixture
def peer(endpoint, session):
    started = PyverbsPeer(endpoint, verbs.qkey_for_session(session))
    yield started
    started.close()


# ---- the allreduce: our engine as rank 1, pyverbs as rank 0 ---------------------------------------

COUNT, CHUNK_BYTES = 1000, 256
CHUNK_ELEMENTS = CHUNK_BYTES // 4


def segment_chunks(count, world, segment):
    """[(chunk index, first element, element count)] of a segment."""
    start, end = native.block_start(count, world, segment), native.block_start(count, world, segment + 1)
    return [(i, first, min(CHUNK_ELEMENTS, end - first)) for i, first in enumerate(range(start, end, CHUNK_ELEMENTS))]


def rank_input(rank):
    return ((np.arange(COUNT) * 7 + rank * 3) % 11 - 5).astype(np.float32)


def test_engine_accepts_pyverbs_datagrams_and_our_sender_matches_the_spec(endpoint, session, peer):
    qkey = verbs.qkey_for_session(session)
    peer_address = struct.pack("<I", peer.hello["mtu"]) + verbs.pack_verbs_address(peer.gid, peer.hello["qpn"], 0, qkey)
    options = options_module.build(chunk_bytes=CHUNK_BYTES, window_bytes=1 << 16, idle_close_us=500_000)
    communicator = Communicator(1, 2, AnsweringStore(session, peer_address), "verbs", options)
    ours = verbs.unpack_verbs_address(communicator.address)
    assert ours["qkey"] == qkey and ours["gid"] == endpoint["gid"]
    to_us = {"dgid": ours["gid"].hex(), "dqpn": ours["qpn"], "qkey": qkey}

    world, sequence = 2, 1
    # at two ranks "auto" runs the ring; blocks are rotated by the call's sequence number
    _, ours_steps = native.schedule(native.COLLECTIVE_ALLREDUCE, native.ALGORITHM_RING, 1, world, 0, sequence % world)
    theirs_summary, theirs_steps = native.schedule(native.COLLECTIVE_ALLREDUCE, native.ALGORITHM_RING, 0, world, 0, sequence % world)
    rs_to_us, ag_to_us = ours_steps[0]["recv_block"], ours_steps[1]["recv_block"]
    assert rs_to_us == theirs_steps[0]["send_block"]
    rs_from_us, ag_from_us = ours_steps[0]["send_block"], ours_steps[1]["send_block"]
    layout = wire_format.layout_tag(COUNT, "float32", 0, CHUNK_BYTES, algorithm="ring")
    mine, theirs = rank_input(1), rank_input(0)
    total = mine + theirs

    def data(phase, segment, values, contributions, source):  # phase 0 is step 0, phase 1 step 1 at two ranks
        chunks = segment_chunks(COUNT, world, segment)
        return [header(DATA, session, sequence, phase, phase, source, index, contributions, 4 * n, layout, len(chunks))
                + values[first:first + n].tobytes() for index, first, n in chunks]

    def end(phase, source):
        return header(END, session, sequence, phase, phase, source, layout=layout)

    first_rs = data(REDUCE_SCATTER, rs_to_us, theirs, 1, 0)[0]
    garbage = {
        "foreign": [
            struct.pack("<I", 0xDEADBEEF) + first_rs[4:],                       # wrong magic
            first_rs[:4] + bytes([VERSION + 1]) + first_rs[5:],                 # wrong version
            first_rs[:8] + struct.pack("<Q", session ^ 1) + first_rs[16:],      # another session
            first_rs[:22] + struct.pack("<H", 1) + first_rs[24:],               # claims to be rank 1 (us)
            bytes(range(100)),                                                  # noise
        ],
        "invalid": [
            b"",                                                                # empty
            first_rs[:20],                                                      # truncated header
            first_rs[:-4],                                                      # payload shorter than announced
            first_rs[:24] + struct.pack("<I", 999) + first_rs[28:],             # chunk index out of range
        ],
    }
    stranger = [first_rs]  # a well-formed datagram from a QP that is not in our peer table
    # credit for all we will send (the engine refuses a credit beyond its last send step to the
    # sender: step index x the most chunks a block has, plus the chunks of that step's block)
    most_chunks = max(len(segment_chunks(COUNT, world, block)) for block in range(world))
    all_we_send = 1 * most_chunks + len(segment_chunks(COUNT, world, ag_from_us))
    items = [dict(to_us, hex=header(CREDIT, session, sequence, source=0, credit=all_we_send, layout=layout).hex())]
    items += [dict(to_us, hex=g.hex()) for kind in ("foreign", "invalid") for g in garbage[kind]]
    items += [dict(to_us, hex=g.hex(), **{"from": "stranger"}) for g in stranger]
    items += [dict(to_us, hex=d.hex()) for d in data(REDUCE_SCATTER, rs_to_us, theirs, 1, 0)]
    items += [dict(to_us, hex=end(REDUCE_SCATTER, 0).hex())] * 3
    assert peer.send(items) == len(items)

    outcome = {}

    def run():
        tensor = mine.copy()
        try:
            outcome["stats"] = communicator.allreduce(tensor, loss_budget=0.0, deadline=30.0)
        except Exception as error:  # reported below
            outcome["error"] = error
        outcome["tensor"] = tensor

    thread = threading.Thread(target=run)
    thread.start()
    # our reduce-scatter END says our all-gather may begin: then send the owner's result
    our_rs_end = end(REDUCE_SCATTER, 1)
    assert peer.ask(op="wait_for", prefix=our_rs_end[:24].hex(), timeout=30)["found"]
    ag = data(ALL_GATHER, ag_to_us, total, 2, 0)
    assert peer.send([dict(to_us, hex=d.hex()) for d in ag] + [dict(to_us, hex=end(ALL_GATHER, 0).hex())] * 3)
    # the verdict round: once our verdict came, answer with the peer's own, acknowledging ours
    our_verdict = header(AGREE, session, sequence, source=1)[:6]
    assert peer.ask(op="wait_for", prefix=our_verdict.hex(), timeout=30)["found"]
    owned = theirs_summary["owned_block"]  # its shard holds both contributions: world x its length
    theirs_verdict = verdict(world * (COUNT * (owned + 1) // world - COUNT * owned // world), COUNT, 0.0)
    answer = header(AGREE, session, sequence, source=0, payload_bytes=len(theirs_verdict), layout=layout, flags=HAVE_YOURS)
    assert peer.send([dict(to_us, hex=(answer + theirs_verdict).hex())] * 3)
    thread.join(60)
    received = peer.ask(op="collect", idle=1.5)["received"]
    communicator.close()
    assert "error" not in outcome, outcome.get("error")
    stats = outcome["stats"]

    # our receiver: accepted every valid datagram, dropped and counted every bad one
    np.testing.assert_array_equal(outcome["tensor"], total)
    assert stats.delivered_fraction == 1.0 and stats.chunks_lost == 0
    valid = len(data(REDUCE_SCATTER, rs_to_us, theirs, 1, 0)) + len(ag)
    assert stats.datagrams_received == valid
    assert stats.dropped_foreign == len(garbage["foreign"]) + len(stranger), stats
    assert stats.dropped_invalid == len(garbage["invalid"]), stats

    # our sender: every DATA datagram byte for byte as the specification says
    from_us = [bytes.fromhex(r["hex"]) for r in received if r["src_qp"] == ours["qpn"]]
    expected = data(REDUCE_SCATTER, rs_from_us, mine, 1, 1) + data(ALL_GATHER, ag_from_us, total, 2, 1)
    sent_data = [d for d in from_us if len(d) >= 44 and HEADER.unpack_from(d)[2] == DATA]
    assert sorted(sent_data) == sorted(expected)
    for datagram in from_us:
        fields = HEADER.unpack_from(datagram)
        assert fields[0] == MAGIC and fields[1] == VERSION and fields[5] == session
        assert fields[4] == 0 or fields[2] == AGREE
        if fields[2] in (END, CREDIT):
            assert len(datagram) == 44 and fields[12] == 0 and fields[8] == 1  # no payload; source rank 1
    assert any(HEADER.unpack_from(d)[2] == CREDIT for d in from_us)
    assert sum(HEADER.unpack_from(d)[2] == END for d in from_us) >= 2  # one per step (repeated)


def test_raw_datagrams_cross_both_ways_unchanged_with_a_roce_v2_grh(endpoint, session, peer):
    qkey = verbs.qkey_for_session(session)
    transport = verbs.VerbsTransport.open(endpoint["device"], endpoint["port"], endpoint["gid_index"], qkey)
    peer_address = verbs.pack_verbs_address(peer.gid, peer.hello["qpn"], 0, qkey)
    transport.set_peers([peer_address, transport.address])
    mtu = transport.max_datagram_bytes
    rng = np.random.default_rng(7)
    payloads = [bytes([0x5A]), rng.integers(0, 256, 44, dtype=np.uint8).tobytes(),
                rng.integers(0, 256, mtu, dtype=np.uint8).tobytes()]
    for payload in payloads:
        assert transport.send(0, payload[:44], payload[44:]) == 1
    received = peer.ask(op="collect", idle=1.0)["received"]
    assert [bytes.fromhex(r["hex"]) for r in received] == payloads
    assert {r["src_qp"] for r in received} == {transport.qpn}
    ipv4 = bytes.fromhex(received[0]["grh"])[20:]  # RoCEv2 over IPv4: the IP header is the GRH's last 20 bytes
    if verbs.gid_ipv4(endpoint["gid"]):
        assert ipv4[0] == 0x45 and ipv4[12:16] == endpoint["gid"][12:]

    back = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 300, mtu)]
    to_transport = {"dgid": transport.gid.hex(), "dqpn": transport.qpn, "qkey": qkey}
    assert peer.send([dict(to_transport, hex=b.hex()) for b in back]) == 3
    got = []
    while len(got) < 3:
        batch = transport.receive(timeout=10.0)
        assert batch, got
        got += batch
    assert got == [(0, b) for b in back]  # in order, each from peer 0 (the pyverbs QP, by QPN and GID)
    assert peer.send([dict(to_transport, hex=b"from a stranger".hex(), **{"from": "stranger"})]) == 1
    assert transport.receive(timeout=10.0) == [(-1, b"from a stranger")]
