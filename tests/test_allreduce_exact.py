"""With no loss the result equals a reliable allreduce: bit for bit on
integer-valued data, within float rounding otherwise. Ranks are real
processes talking UDP over loopback; chunks are tiny so every input spans
many datagrams."""
import numpy as np
import pytest

import tasks
from conftest import get_cluster
from support import expected_allreduce

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
CHUNK_BYTES = 24  # 6 float32 per datagram: small inputs exercise the multi-chunk path
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32"]


def element_counts(world):
    # empty, one element, fewer than the ranks, not divisible by the chunk, many chunks per segment
    return sorted({0, 1, max(world - 1, 1), 6 * world + 5, 997, 1000})


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_exact_without_loss(world, dtype, op, algorithm):
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    for count in element_counts(world):
        results = cluster.run(tasks.allreduce_values, count, dtype, op, True, 0.0, 10.0, algorithm)
        want = expected_allreduce(world, count, op)
        for rank, (result, stats) in enumerate(results):
            assert stats.delivered_fraction == 1.0 and stats.chunks_lost == 0
            if op == "sum" or dtype == "int32" and np.all(want == np.round(want)):
                # integer-valued sums are exact in every dtype (all fit in 16-bit floats here)
                np.testing.assert_array_equal(result.astype(np.float64), np.round(want) if dtype == "int32" else want,
                                              err_msg=f"rank {rank} count {count}")
            elif dtype == "int32":
                np.testing.assert_array_equal(result, np.round(want).astype(np.int32))  # mean of ints rounds to nearest
            else:
                tolerance = {"float16": 1e-3, "bfloat16": 8e-3}.get(dtype, 1e-6)
                np.testing.assert_allclose(result.astype(np.float64), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("world", [2, 3])
def test_non_integer_floats_within_rounding(world):
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    for dtype, tolerance in [("float32", 1e-6), ("float64", 1e-14)]:
        results = cluster.run(tasks.allreduce_values, 997, dtype, "sum", False)
        want = expected_allreduce(world, 997, "sum", integer_valued=False)
        for result, _ in results:
            np.testing.assert_allclose(result, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "float64"])
def test_torch_tensors_in_place(dtype, world):
    """On every rank the torch tensor itself (same storage, dtype and shape) holds the exact sum
    of every rank's input, rounded once to the tensor's own type."""
    count = 100
    cluster = get_cluster(world, chunk_bytes=CHUNK_BYTES)
    results = cluster.run(tasks.allreduce_torch, count, dtype)
    import torch

    exact = sum(tasks.torch_values(rank, count, "float64") for rank in range(world))
    want = exact.to(getattr(torch, dtype)).double().numpy()
    assert len(results) == world
    for rank, (result, stats, same_tensor) in enumerate(results):
        assert same_tensor, f"rank {rank}: the result is not in the tensor that was passed"
        assert stats.delivered_fraction == 1.0 and stats.chunks_lost == 0, f"rank {rank}: {stats}"
        np.testing.assert_array_equal(result, want, err_msg=f"rank {rank}, {world} ranks, {dtype}")


def test_default_chunk_is_the_largest_datagram():
    """Without chunk_bytes, one datagram carries as much as loopback's MTU allows."""
    cluster = get_cluster(2)
    (address, chunk_bytes), _ = cluster.run(tasks.address_of)
    assert 60000 < chunk_bytes <= 65507 - 44 and chunk_bytes % 8 == 0
