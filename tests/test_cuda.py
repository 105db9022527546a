"""CUDA tensors on every entry point (issue 37), on a machine with a GPU: every rank of a local
cluster on cuda:0, the engine on loopback UDP. Results on CUDA tensors equal the same calls on CPU
tensors bit for bit; a kernel queued on a non-default stream before the call is read after it; DDP,
the hook, the two-stage step and FSDP2 on CUDA models reach what Gloo reaches. The host-side logic
of the staging (order of the steps, what is copied back, errors) is tested everywhere in
tests/test_staging.py; these need CUDA, which CI's machine does not have, so they skip there and
run through scripts/device_gpu_check.sh on the lent GPU machine."""
import itertools

import pytest
import torch

from conftest import get_cluster

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: these run on a GPU machine (scripts/device_gpu_check.sh)")

import cuda_tasks  # noqa: E402  (imports torch_tasks: only where the module is collected)

_tags = itertools.count()


def tag():
    return f"c{next(_tags)}"


@pytest.mark.parametrize("world", [2, 4])
def test_the_api_and_the_exact_layer_on_cuda_equal_the_same_calls_on_cpu_bitwise(world):
    """allreduce, broadcast, reduce_scatter, all_gather, all_to_all (float32/64/16, bfloat16,
    int32; 1, 7, 4099 and 2**18+3 elements per rank) and the exact allreduce (int64, float32,
    uint8; SUM and MAX): the CUDA result is the CPU result, bit for bit, on every rank."""
    per_rank = get_cluster(world).run(cuda_tasks.api_collectives, tag(), timeout_s=600)
    for rank, results in enumerate(per_rank):
        for name, (host, device) in results.items():
            assert host.dtype == device.dtype and torch.equal(host, device), f"rank {rank}: {name}"
        assert len(results) == 5 * 5 * 4 + 6


@pytest.mark.parametrize("world", [2, 4])
def test_every_c10d_collective_on_cuda_equals_cpu_bitwise(world):
    """all_reduce (SUM, MAX), broadcast, all_gather(_into_tensor), reduce_scatter_tensor,
    all_to_all_single, reduce, gather, scatter, send/recv, barrier and all_gather_object on a "ud"
    group: CUDA tensors give what CPU tensors give, bit for bit."""
    per_rank = get_cluster(world).run(cuda_tasks.c10d_collectives, tag(), timeout_s=600)
    for rank, results in enumerate(per_rank):
        for name, (host, device) in results.items():
            assert torch.equal(host, device), f"rank {rank}: {name}"


def test_an_input_written_on_another_stream_is_read_after_the_kernel_and_wait_orders_the_result():
    """The input is written behind a 50 ms GPU sleep on a non-default stream and the call made at
    once; the result is consumed on that stream after work.wait(), with no synchronize: correct.
    With the staging's wait on the caller's event removed, the same test reads the zeros the
    tensor held before the kernel (so it can fail)."""
    cluster = get_cluster(2)
    expected = torch.full((1 << 20,), 2.0 * (1 + 2))  # (rank 0's 1 + rank 1's 2), doubled
    for consumed in cluster.run(cuda_tasks.stream_order, tag(), timeout_s=300):
        assert torch.equal(consumed, expected)
    broken = cluster.run(cuda_tasks.stream_order, tag(), True, timeout_s=300)
    assert any(not torch.equal(consumed, expected) for consumed in broken), \
        "without the event the copy still read the kernel's values: this test cannot tell"


@pytest.mark.parametrize("world", [2, 4])
def test_calls_queued_on_one_tensor_read_each_others_results(world):
    """Two async all_reduces of one CUDA tensor and a broadcast queued before any wait: the
    result is world x the sum, as if each call waited for the one before (a copy to the host
    queued at once, before the first call's copy back, read the old values)."""
    total = world * sum(range(1, world + 1))
    for result in get_cluster(world).run(cuda_tasks.back_to_back, tag(), timeout_s=300):
        assert torch.equal(result, torch.full((1 << 18,), float(total)))


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_the_hook_and_the_two_stage_step_on_cuda_models_equal_ddp_on_gloo(world):
    """20 AdamW steps of a CUDA model from each rank's own init: DDP over "ud", the lossy hook at
    budget 0 and the two-stage step reach DDP-over-Gloo's parameters within 1e-5, on every rank."""
    per_rank = get_cluster(world).run(cuda_tasks.ddp_ways, tag(), timeout_s=600)
    reference = per_rank[0]["gloo"]
    for rank, results in enumerate(per_rank):
        for way, parameters in results.items():
            torch.testing.assert_close(parameters, reference, rtol=0, atol=1e-5, msg=f"rank {rank} {way}")
    assert len(per_rank[0]) == 4


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_on_cuda_over_ud_equals_fsdp2_over_gloo(world):
    """FSDP2 (fully_shard) of a CUDA model, a few SGD steps over "ud", reaches what the same
    model reaches on Gloo (1e-5). Gloo's side runs on the CPU: FSDP2 of a CUDA model over Gloo
    killed the rank process in torch 2.11 (docs/device_runs/2026-11-28-gpu-a/tests.log)."""
    cluster = get_cluster(world)
    name = tag()
    ud = cluster.run(cuda_tasks.fsdp2_steps, name, "ud", timeout_s=300)
    gloo = cluster.run(cuda_tasks.fsdp2_steps, name, "gloo", "cpu", timeout_s=300)
    for rank in range(world):
        torch.testing.assert_close(ud[rank], gloo[rank], rtol=0, atol=1e-5, msg=f"rank {rank}")


def test_a_failed_call_leaves_every_cuda_tensor_as_it_was():
    """Rank 0 passes one element more: every rank's call fails (LayoutMismatch) and its CUDA
    tensor keeps its values."""
    for name, before, after in get_cluster(2).run(cuda_tasks.error_keeps_values, tag(), timeout_s=120):
        assert name == "LayoutMismatch"
        assert torch.equal(before, after)
