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
PIECES_STRIDE = 0xE0000000 // WORLD - 1  # a sized all_to_all's positions (native/pieces.c, udt_pieces_stride)


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
    sized = selector & 0xC0 == 0xC0  # pieces of their own sizes: the harness's PIECES
    for index, step in enumerate(steps):
        phase = wire_format.PHASE_GATHER if (collective in (2, 5) or index >= WORLD - 1) else wire_format.PHASE_REDUCE
        if step["recv_peer"] >= 0:
            lengths = ([CHUNK_ELEMENTS] * 2 + [8] if step["recv_peer"] == 1 else [9]) if sized else [CHUNK_ELEMENTS] * 2
            for chunk, length in enumerate(lengths):
                payload = struct.pack(f"<{length}f", *([1.0] * length))
                out += record(step["recv_peer"], header(kind=wire_format.KIND_DATA, phase=phase, step=index,
                                                        chunk_index=chunk, payload_bytes=len(payload),
                                                        credit=len(lengths)) + payload)
            out += record(step["recv_peer"], header(kind=wire_format.KIND_END, phase=phase, step=index, contributions=0))
        if step["send_peer"] >= 0:
            credit = index * PIECES_STRIDE + (2 if step["send_peer"] == 1 else 0) if sized else index * 2 + 2
            out += record(step["send_peer"], header(kind=wire_format.KIND_CREDIT, contributions=0, credit=credit))
    verdict = struct.pack("<IIQQd", 0, 0, 64, COUNT, 1.0)
    for peer in range(1, WORLD):
        out += record(peer, header(kind=wire_format.KIND_AGREE, contributions=0, payload_bytes=len(verdict)) + verdict)
    return out


def main():
    directory = pathlib.Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    for selector in list(range(24)) + [0x80, 0x84, 0xC0, 0xC4]:  # and all_to_all, of pieces of their own sizes too
        (directory / f"seed-{selector:02d}").write_bytes(seed(selector))


if __name__ == "__main__":
    main()
