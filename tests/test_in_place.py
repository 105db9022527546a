"""Where an allreduce sums: in the caller's tensor when it is at least
Options.in_place_min_bytes (by default the CPU's largest cache), else in the
scratch with a copy out at the end. Both give the exact result, and the stats
say which ran (a failed call puts the tensor back either way:
test_deadline_budget.py)."""
import numpy as np
import pytest

import tasks
from conftest import get_cluster
from support import expected_allreduce
from ud_transport import cpu_cache, options as options_module

COUNT = 3000  # float32: 12000 bytes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("in_place_min_bytes, in_place, chunk_bytes", [(0, True, 512), (0, True, 8192), (1 << 40, False, 512)])
def test_both_paths_give_the_exact_sum(world, dtype, in_place_min_bytes, in_place, chunk_bytes):
    """8 KiB chunks: in place, the final values a rank does not relay go to the tensor with
    stores that bypass the cache (payloads of at least 4 KiB); 512 bytes: through the cache."""
    cluster = get_cluster(world, chunk_bytes=chunk_bytes, in_place_min_bytes=in_place_min_bytes)
    for result, stats in cluster.run(tasks.allreduce_values, COUNT, dtype, "sum"):
        assert stats.in_place is in_place, stats
        np.testing.assert_array_equal(result, expected_allreduce(world, COUNT).astype(dtype))


@pytest.mark.parametrize("in_place_min_bytes", [0, 1 << 40])
def test_the_write_of_the_result_is_timed_inside_the_call(in_place_min_bytes):
    """output_s (after the verdict: the copy out of the scratch, or nothing much in place) is measured
    and is part of elapsed_s, which ends when the call returns."""
    cluster = get_cluster(2, in_place_min_bytes=in_place_min_bytes)
    for _, stats in cluster.run(tasks.allreduce_values, 1 << 20, "float32", "sum"):
        assert 0 < stats.output_s < stats.elapsed_s, stats.to_dict()
        assert stats.join_wait_s + stats.agree_s + stats.output_s <= stats.elapsed_s, stats.to_dict()


def test_the_threshold_is_the_tensor_size_in_bytes():
    """A float32 tensor of exactly in_place_min_bytes sums in place, one element more than the
    tensor is not enough; float16 never does (it sums in a float32 scratch)."""
    bytes_ = COUNT * 4
    for threshold, dtype, expected in [(bytes_, "float32", True), (bytes_ + 1, "float32", False),
                                       (0, "float16", False)]:
        cluster = get_cluster(2, in_place_min_bytes=threshold)
        for _, stats in cluster.run(tasks.allreduce_values, COUNT, dtype, "sum"):
            assert stats.in_place is expected, (threshold, dtype, stats)


def test_by_default_a_tensor_smaller_than_the_cache_sums_in_the_scratch():
    assert options_module.build().resolved_in_place_min_bytes() == cpu_cache.largest_cache_bytes()
    for _, stats in get_cluster(2).run(tasks.allreduce_values, COUNT, "float32", "sum"):
        assert stats.in_place is False, stats


def test_by_default_ranks_on_one_machine_split_its_cache():
    """Each of two ranks on this machine sums in place from its half of the cache up: the ranks on
    one machine share its cache, each with a tensor and a scratch of its own."""
    for ranks_here, at_the_share, below_it in get_cluster(2).run(tasks.in_place_at_cache_share):
        assert ranks_here == 2
        assert (at_the_share, below_it) == (True, False)
    assert options_module.build().resolved_in_place_min_bytes(2) == cpu_cache.largest_cache_bytes() // 2
    assert options_module.build(in_place_min_bytes=4096).resolved_in_place_min_bytes(2) == 4096  # set: as set


def test_the_largest_cache_is_read_from_sysfs(tmp_path):
    for index, size in enumerate(["32K", "512K", "32768K", "garbage"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    assert cpu_cache.largest_cache_bytes(str(tmp_path)) == 32 << 20
    assert cpu_cache.largest_cache_bytes(str(tmp_path / "absent")) == cpu_cache.FALLBACK_BYTES
    assert cpu_cache.parse_size("1M") == 1 << 20 and cpu_cache.parse_size("4096") == 4096
    assert cpu_cache.parse_size("K") is None


def test_a_cache_larger_than_any_cpu_has_per_cpu_is_taken_for_a_share_of_a_hosts(tmp_path):
    """A VM lists its host's last-level cache: 480 MiB for 2 CPUs on the build machine of
    2026-11-26, where summing in place won from 2 MiB up. At most 32 MiB per CPU sharing it
    counts; a listing without CPUs counts whole."""
    for index, (size, cpus) in enumerate([("48K", "0"), ("2048K", "0"), ("491520K", "0-1")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
        (tmp_path / f"index{index}" / "shared_cpu_list").write_text(cpus + "\n")
    assert cpu_cache.largest_cache_bytes(str(tmp_path)) == 64 << 20
    (tmp_path / "index2" / "shared_cpu_list").write_text("0-15,32-47\n")  # a real 32-CPU share: unchanged
    cpu_cache.largest_cache_bytes.cache_clear()
    assert cpu_cache.largest_cache_bytes(str(tmp_path)) == 480 << 20
    (tmp_path / "index2" / "shared_cpu_list").unlink()
    cpu_cache.largest_cache_bytes.cache_clear()
    assert cpu_cache.largest_cache_bytes(str(tmp_path)) == 480 << 20
    assert cpu_cache.count_cpus("0-3,8") == 5 and cpu_cache.count_cpus("") is None


def test_a_threshold_below_minus_one_is_refused():
    with pytest.raises(ValueError, match="in_place_min_bytes"):
        options_module.build(in_place_min_bytes=-2)
