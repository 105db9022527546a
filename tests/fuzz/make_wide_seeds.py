"""Seed corpus for fuzz_engine_wide.c: for each collective, algorithm, world of 2 to 5 and three
counts, a shape picked at random (dtype, in place, copies, chunk size, calls, rank) and, per call,
what peers send: JOIN requests and replies, data and END markers for each step, credits and a
verdict, all as records the harness makes consistent with the schedule (flag bits 0 and 2).
Usage: python3 tests/fuzz/make_wide_seeds.py DIRECTORY"""
import pathlib
import random
import struct
import sys

KIND_DATA, KIND_END, KIND_CREDIT, KIND_AGREE, KIND_JOIN = 1, 2, 3, 4, 5
FIX_UP, CONSISTENT, PLAUSIBLE_VERDICT, NEXT_CALL = 1, 4, 8, 0x30


def header(kind, step=0, chunk=0, contributions=1, credit=0xFFFFFFFF, flags=0):
    """The fields the harness keeps; it fills in the session, the sequence and the layout."""
    out = bytearray(44)
    out[5], out[7] = kind, flags
    struct.pack_into("<H", out, 20, step)
    struct.pack_into("<I", out, 24, chunk)
    struct.pack_into("<H", out, 28, contributions)
    struct.pack_into("<I", out, 40, credit)
    return bytes(out)


def record(flags, selector, datagram):
    return struct.pack("<BBH", flags, selector, len(datagram)) + datagram


def one_call(world):
    fixed = FIX_UP | CONSISTENT
    out = b""
    for peer in range(world - 1):
        out += record(fixed, peer, header(KIND_JOIN, credit=0))
        out += record(fixed, peer, header(KIND_JOIN, credit=0, flags=2))
    for step in range(2 * world):
        for chunk in range(3):
            out += record(fixed, 0, header(KIND_DATA, step, chunk, contributions=0, credit=0))
        out += record(fixed, 0, header(KIND_END, step))
        out += record(fixed, step, header(KIND_CREDIT, credit=1000 * step))
    for peer in range(world - 1):
        out += record(fixed | PLAUSIBLE_VERDICT, peer, header(KIND_AGREE, flags=1) + bytes(32))
        out += record(fixed | 2, peer, header(KIND_CREDIT, credit=2))  # bit 1: the next call's
        out += record(fixed | 2, peer, header(KIND_JOIN, credit=0))
        out += record(fixed | 2 | PLAUSIBLE_VERDICT, peer, header(KIND_AGREE) + bytes(32))
    return out + record(NEXT_CALL, 0, b"")


def main(directory):
    out = pathlib.Path(directory)
    rng = random.Random(1)
    index = 0
    for collective in range(6):  # allreduce .. agree, all_to_all
        for algorithm in range(2):
            for world in (2, 3, 4, 5):
                for count in (96, 7, 200):
                    dtype, in_place, copies = rng.randrange(5), rng.randrange(2), rng.randrange(4)
                    configuration = bytes([collective | (algorithm << 3),
                                           (world - 2) | (dtype << 2) | (in_place << 5) | (copies << 6), count,
                                           rng.randrange(8) | (rng.randrange(4) << 3) | (rng.randrange(3) << 5),
                                           rng.randrange(world)])
                    body = b"".join(one_call(world) for _ in range(rng.choice((1, 2))))
                    (out / f"seed-{index:03d}").write_bytes(configuration + body)
                    index += 1


if __name__ == "__main__":
    main(sys.argv[1])
