"""Our GGML dequantization (`localpaged.quant.ggml_types`) and 4-bit mapping
(`localpaged.quant.ggml_int4`) against the `gguf` package's own `gguf.quants.dequantize`, the
independent reference: on random block bytes (every bit pattern of every field), on tensors the
`gguf` package quantizes itself, and (tests/quant/test_ggml_fixtures.py) on tensors llama.cpp's
quantizer wrote."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from localpaged.quant.ggml_int4 import INT4_TYPES, int4_parts
from localpaged.quant.ggml_types import BLOCK_TYPES, FLOAT_TYPES, dequantize

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning",
                                        "ignore:overflow:RuntimeWarning")


def _random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    size = BLOCK_TYPES[type_name][1]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(rows, blocks_per_row * size), dtype=np.uint8)


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_block_sizes_match_gguf(type_name: str) -> None:
    assert BLOCK_TYPES[type_name][:2] == GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_random_bytes_dequantize_like_gguf(type_name: str) -> None:
    """Random bytes exercise every bit of every field (NaN/inf f16 scales included: they
    must come out in the same places)."""
    block = BLOCK_TYPES[type_name][0]
    raw = _random_blocks(type_name, 24, 3)
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name])
    got = dequantize(type_name, raw, (24, 3 * block))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want).mean() > 0.8  # the comparison is mostly of numbers


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_quantized_tensors_dequantize_like_gguf(type_name: str) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 256)) * 0.05).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = gguf_quantize(x, qtype)
    got = dequantize(type_name, raw, x.shape)
    np.testing.assert_array_equal(got, gguf_dequantize(raw, qtype))
    assert np.abs(got - x).max() < 0.15 * np.abs(x).max()  # and it is the tensor quantized


@pytest.mark.parametrize("type_name", FLOAT_TYPES)
def test_float_types(type_name: str) -> None:
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    stored = gguf_quantize(x, qtype)
    np.testing.assert_array_equal(dequantize(type_name, stored, x.shape),
                                  gguf_dequantize(stored, qtype).reshape(x.shape))


def test_sizes_that_do_not_fit_are_refused() -> None:
    raw = _random_blocks("Q4_K", 2, 1)
    with pytest.raises(ValueError, match="Q4_K: 288 bytes do not hold 256 values"):
        dequantize("Q4_K", raw, (1, 256))
    with pytest.raises(ValueError, match="GGML type IQ2_XXS is not supported"):
        dequantize("IQ2_XXS", raw, (2, 256))


def _dequantized_parts(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    codes, scales, zeros = int4_parts(type_name, raw, n, k)
    assert codes.dtype == np.uint8 and int(codes.max()) <= 15
    assert scales.shape == zeros.shape == (n, k // 32)
    g = np.arange(k) // 32
    return (codes.astype(np.float32) - zeros[:, g]) * scales[:, g]


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_int4_parts_give_the_file_values(type_name: str) -> None:
    """codes/scales/zero-points per 32 values reproduce the dequantized matrix (float32
    rounding of the zero-point's division aside), constant blocks (scale 0) included."""
    n, k = 16, 512
    raw = _random_blocks(type_name, n, k // BLOCK_TYPES[type_name][0], seed=3)
    blocks = raw.reshape(-1, BLOCK_TYPES[type_name][1])
    # Sane f16 scales (random bytes give NaN/inf ones) and some zero scales.
    d_at = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}[type_name]
    rng = np.random.default_rng(4)
    for at in d_at:
        d = rng.uniform(-0.02 if at else 0.0, 0.02, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    blocks[::7, 0:2] = 0  # d == 0: constant blocks
    want = dequantize(type_name, raw, (n, k))
    got = _dequantized_parts(type_name, raw, n, k)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    np.testing.assert_array_equal(want, gguf_dequantize(raw, GGMLQuantizationType[type_name]))
