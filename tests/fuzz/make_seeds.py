"""Seed corpus for fuzz_engine.c: for every collective and algorithm, what
rank 0's peers really send it (data for every receive step, END markers,
credits, a verdict, JOIN requests and replies), as records the harness fixes up (flag bit 0) with the
call's session, sequence and layout. Usage, from the repository's root (tests/ on PYTHONPATH
for wire_format): PYTHONPATH=.:tests python3 tests/fuzz/make_seeds.py DIRECTORY"""
import pathlib
import struct
import sys

import wire_format
from ud_transport import _native

WORLD, COUNT, CHUNK_ELEMENTS = 3, 96, 16


def record(peer, datagram, flags=1):
    return struct.pack("<BBH", flags, peer - 1, len(datagram)) + datagram


def header(**fields):
    base = {"session_id": 0, "sequence": 0, "source_rank": 0}
    return wire_format.header(**{**base, **fields})


def seed(selector):
    all_to_all = selector & 0x80  # as the harness reads byte 0
    collective, algorithm, root = 5 if all_to_all else selector % 4, (selector >> 2) & 1, (selector >> 3) % WORLD
    _, steps = _native.schedule(collective, algorithm, 0, WORLD, root, 0)
    out = bytes([selector])
    for peer in range(1, WORLD):  # "are you in this call?" and its answer
        out += record(peer, header(kind=wire_format.KIND_JOIN, contributions=0))
        out += record(peer, header(kind=wire_format.KIND_JOIN, contributions=0, flags=wire_format.JOIN_REPLY))
    for index, step in enumerate(steps):
        phase = wire_format.PHASE_GATHER if (collective in (2, 5) or index >= WORLD - 1) else wire_format.PHASE_REDUCE
        if step["recv_peer"] >= 0:
            for chunk in range(2):
                payload = struct.pack("<16f", *([1.0] * CHUNK_ELEMENTS))
                out += record(step["recv_peer"], header(kind=wire_format.KIND_DATA, phase=phase, step=index,
                                                        chunk_index=chunk, payload_bytes=len(payload), credit=2) + payload)
            out += record(step["recv_peer"], header(kind=wire_format.KIND_END, phase=phase, step=index, contributions=0))
        if step["send_peer"] >= 0:
            out += record(step["send_peer"], header(kind=wire_format.KIND_CREDIT, contributions=0, credit=index * 2 + 2))
    verdict = struct.pack("<IIQQd", 0, 0, 64, COUNT, 1.0)
    for peer in range(1, WORLD):
        out += record(peer, header(kind=wire_format.KIND_AGREE, contributions=0, payload_bytes=len(verdict)) + verdict)
    return out


def main():
    directory = pathlib.Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    for selector in list(range(24)) + [0x80, 0x84]:  # and all_to_all
        (directory / f"seed-{selector:02d}").write_bytes(seed(selector))


if __name__ == "__main__":
    main()
