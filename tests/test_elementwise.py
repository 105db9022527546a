"""16-bit conversions in C against numpy (float16) and torch (bfloat16)."""
import numpy as np
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
