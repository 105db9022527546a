"""16-bit conversions in C against numpy (float16) and torch (bfloat16); the cache-bypassing copy."""
import numpy as np
import pytest
import torch

from ud_transport import _native


def special_floats():
    rng = np.random.default_rng(0)
    values = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 6e-8, 5.96e-8, 2.98e-8, 3e-8, 1e-10,
              np.inf, -np.inf, 0.1, 1 / 3, 2049.0, 2051.0, 1.0009765625, 1.00048828125]
    values += list(rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000))
    return np.array(values, dtype=np.float32)


@np.errstate(over="ignore")
def test_float_to_half_matches_numpy():
    for value in special_floats():
        assert _native.float_to_half_bits(float(value)) == int(np.float32(value).astype(np.float16).view(np.uint16)), value


def test_half_to_float_roundtrips_every_half():
    bits = np.arange(65536, dtype=np.uint16)
    halves = bits.view(np.float16).astype(np.float32)
    for b in range(0, 65536, 7):
        got = _native.half_bits_to_float(b)
        if np.isnan(halves[b]):
            assert np.isnan(got)
        else:
            assert got == halves[b]


def test_float_to_bfloat16_matches_torch():
    values = special_floats()
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for value, want in zip(values, expected):
        assert _native.float_to_bfloat16_bits(float(value)) == int(want), value
    assert _native.float_to_bfloat16_bits(float("nan")) & 0x7F80 == 0x7F80


def test_kernels_at_every_byte_offset_under_ubsan(tmp_path):
    """Finding 8 of issue 10: payloads follow a 44-byte header and numpy views start
    anywhere, so the kernels load and store through memcpy. A C harness built with
    UBSan (aborting on the first report) runs every kernel, every dtype, at byte
    offsets 0-7, and checks the values."""
    import shutil
    import subprocess
    from pathlib import Path

    from conftest import skip_or_fail

    root = Path(__file__).resolve().parent.parent
    compiler = shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        skip_or_fail("no C compiler (gcc or clang) to build the UBSan harness")
    binary = tmp_path / "misaligned_kernels"
    build = subprocess.run([compiler, "-O2", "-g", "-fsanitize=undefined", "-fno-sanitize-recover=all",
                            "-I", str(root / "native"), str(root / "tests" / "native" / "misaligned_kernels.c"),
                            str(root / "native" / "elementwise.c"), "-lm", "-o", str(binary)],
                           capture_output=True, text=True)
    if build.returncode != 0:
        if "ubsan" in build.stderr.lower():
            skip_or_fail(f"{compiler} cannot link the UBSan runtime: {build.stderr.strip()[-300:]}")
        raise AssertionError(build.stderr)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "runtime error" not in run.stderr, run.stderr


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_allreduce_on_arrays_at_odd_addresses_is_exact(algorithm):
    import tasks
    from conftest import get_cluster

    cluster = get_cluster(3, chunk_bytes=256)
    for dtype in ("float64", "float32", "float16", "int32"):
        want = sum(tasks.rank_values(rank, 1001, dtype).astype(np.float64) for rank in range(3))
        for misalignment, result, fraction in cluster.run(tasks.misaligned_allreduce, 1001, dtype, 3, algorithm):
            assert misalignment != 0 and fraction == 1.0
            assert np.array_equal(result.astype(np.float64), want), dtype


def test_the_uncached_copy_writes_exactly_its_bytes_at_any_alignment():
    """Streaming stores need 16-byte aligned targets: the copy does an unaligned head and a tail
    of less than 64 bytes through the cache. Every source and target offset within a line, every
    length around those edges: the target holds the source's bytes and nothing next to it changed."""
    rng = np.random.default_rng(1)
    source = rng.integers(0, 256, 9000, dtype=np.uint8)
    for length in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 4095, 4096, 8191]:
        for source_offset in (0, 1, 8, 15, 33):
            for target_offset in range(0, 17):
                target = rng.integers(0, 256, 9000, dtype=np.uint8)
                expected = target.copy()
                expected[target_offset:target_offset + length] = source[source_offset:source_offset + length]
                _native.copy_uncached(target[target_offset:target_offset + length], source[source_offset:source_offset + length])
                assert np.array_equal(target, expected), (length, source_offset, target_offset)
