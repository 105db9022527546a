"""An independent encoder of ud_transport's wire format, written from the
specification in docs/wire_format.md (not from the C header), for tests that play a
stranger or a peer on the wire."""
import struct

MAGIC = 0x31544455
VERSION = 6
KIND_DATA, KIND_END, KIND_CREDIT, KIND_AGREE, KIND_JOIN = 1, 2, 3, 4, 5
JOIN_REPLY = 2
AGREE_HAVE_YOURS, AGREE_REPLY, AGREE_RELAYED, AGREE_HOLDING, AGREE_AGAIN = 1, 2, 4, 8, 16  # flags of a verdict
PHASE_REDUCE, PHASE_GATHER = 0, 1
COLLECTIVES = {"allreduce": 0, "reduce_scatter": 1, "all_gather": 2, "broadcast": 3, "agree": 4}
ALGORITHMS = {"ring": 0, "direct": 1}
HEADER = struct.Struct("<IBBBBQIHHIHHIII")
DTYPE_CODES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int32": 4}


def layout_tag(count, dtype, op, chunk_bytes, estimator=0, collective="allreduce", algorithm="direct", root=0):
    """FNV-1a over (collective, algorithm, count, dtype code, op code, chunk_bytes, estimator, root)
    as eight little-endian u64."""
    value = 2166136261
    fields = (COLLECTIVES[collective], ALGORITHMS[algorithm], count, DTYPE_CODES[dtype], op, chunk_bytes, estimator, root)
    for byte in struct.pack("<8Q", *fields):
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value


def header(*, kind, session_id, sequence, source_rank, phase=0, step=0, chunk_index=0, contributions=1,
           payload_bytes=0, layout=0, credit=0, reserved=0, magic=MAGIC, version=VERSION, flags=0):
    return HEADER.pack(magic, version, kind, phase, flags, session_id, sequence, step, source_rank, chunk_index,
                       contributions, reserved, payload_bytes, layout, credit)


assert HEADER.size == 44
