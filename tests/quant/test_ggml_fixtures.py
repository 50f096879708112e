"""Tensors quantized by llama.cpp's own quantizer, read by localpaged equal to the `gguf`
package's `gguf.quants.dequantize`: from the committed fixture (every type, always; made by
scripts/make_gguf_type_fixtures.py), and freshly quantized when llama.cpp is at hand
(llama-cpp-python here or in PEERS_PYTHON; skipped with the reason otherwise)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from localpaged.quant.ggml_int4 import INT4_TYPES, int4_parts
from localpaged.quant.ggml_types import dequantize

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "ggml_types.gguf"
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from make_gguf_type_fixtures import SHAPE, TYPES, source_matrix  # noqa: E402

# Largest relative RMS error of each type on weight-like rows (a sanity bound: the tensor is
# the quantization of the source; llama.cpp's errors on the fixture are about 2/3 of these).
RMS_BOUND = {"Q2_K": 0.45, "Q3_K": 0.25, "Q4_0": 0.17, "Q4_1": 0.13, "Q4_K": 0.12,
             "IQ4_NL": 0.14, "IQ4_XS": 0.14, "Q5_0": 0.085, "Q5_1": 0.065, "Q5_K": 0.06,
             "Q6_K": 0.035, "Q8_0": 0.012}


@pytest.fixture(scope="module")
def fixture_tensors() -> dict[str, tuple[str, np.ndarray]]:
    reader = GGUFReader(FIXTURE)
    return {t.name: (t.tensor_type.name, t.data) for t in reader.tensors}


def _check(type_name: str, data: np.ndarray, source: np.ndarray) -> np.ndarray:
    got = dequantize(type_name, data, source.shape)
    want = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name])
    np.testing.assert_array_equal(got, want.reshape(source.shape))
    rms = np.sqrt(np.mean((got - source) ** 2) / np.mean(source ** 2))
    assert rms < RMS_BOUND[type_name], f"{type_name}: relative RMS error {rms:.3f}"
    return got


def test_fixture_holds_every_type(fixture_tensors) -> None:
    assert set(TYPES) == set(RMS_BOUND)
    assert {name: kind for name, (kind, _) in fixture_tensors.items()} == {
        "source": "F32", **{t: t for t in TYPES}}
    np.testing.assert_array_equal(fixture_tensors["source"][1], source_matrix())
    assert FIXTURE.stat().st_size < 200_000


@pytest.mark.parametrize("type_name", TYPES)
def test_fixture_tensor_reads_like_gguf(fixture_tensors, type_name: str) -> None:
    got = _check(type_name, fixture_tensors[type_name][1], fixture_tensors["source"][1])
    if type_name in INT4_TYPES:  # the 4-bit form gives the same values
        codes, scales, zeros = int4_parts(type_name, fixture_tensors[type_name][1], *SHAPE)
        g = np.arange(SHAPE[1]) // 32
        again = (codes.astype(np.float32) - zeros[:, g]) * scales[:, g]
        np.testing.assert_allclose(again, got, rtol=0, atol=2e-6 * np.abs(got).max())


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_fixture_4bit_matrix_on_the_quant_linear(fixture_tensors, type_name: str) -> None:
    """The 4-bit matrix as a bf16 QuantLinear (the C kernel where it is built) computes
    x @ W.T of the dequantized matrix within bf16 rounding."""
    from localpaged.model.gguf_loader import RawTensor, q4_to_int4
    from localpaged.quant import cpu_w4
    from localpaged.quant.linear import QuantLinear

    raw = RawTensor("w", type_name, type_name, SHAPE, fixture_tensors[type_name][1])
    layer = QuantLinear.from_int4(q4_to_int4(raw), None, torch.bfloat16, "cpu")
    assert (layer.w4_packed is not None) == cpu_w4.available()
    dense = torch.from_numpy(dequantize(type_name, fixture_tensors[type_name][1], SHAPE))
    x = torch.randn(5, SHAPE[1], generator=torch.Generator().manual_seed(0))
    want = x.to(torch.bfloat16).float() @ dense.t()
    got = layer(x.to(torch.bfloat16)).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.fixture(scope="module")
def llamacpp():
    from llamacpp_peer import find

    quantizer, why = find()
    if quantizer is None:
        pytest.skip(why)
    return quantizer


@pytest.mark.slow
def test_fresh_llamacpp_quantization_reads_like_gguf(llamacpp) -> None:
    """Every type, quantized now by llama.cpp from new rows (a wider row than the fixture's)."""
    x = np.random.default_rng(7).standard_normal((8, 1024)).astype(np.float32) * 0.03
    for type_name in TYPES:
        data = llamacpp.quantize_rows(x, GGMLQuantizationType[type_name].value)
        _check(type_name, data, x)
