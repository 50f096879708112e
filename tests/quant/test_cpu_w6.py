"""The 6-bit layout (quant/cpu_w6.py, kernels/cpu/int8_dot.c): the torch packer against its
definition, each build's loops against a float64 reference, the GGUF C packer against the
`gguf` package's dequantization and against the numpy int8 route, and the layer, embedding and
fused forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from localpaged.model.gguf_reader import FastGGUFReader
from localpaged.quant import cpu_w4, cpu_w6
from localpaged.quant.ggml_int8 import GgmlInt8Weight, int8_blocks
from localpaged.quant.w6_linear import W6_TYPES, W6Embedding, W6Linear
from tests.quant.test_ggml_fixtures import FIXTURE, SHAPE

needs_kernels = pytest.mark.skipif(not cpu_w6.available(),
                                   reason="the 6-bit loops need an x86 build (AVX2 and up)")


def _weight(n: int, k: int, group: int, seed: int, top: int = 64):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half().float()
    offsets = (-32 * scales + torch.randn(n, k // group, generator=g) * 1e-3).half().float()
    return codes, scales, offsets


def test_pack_holds_the_codes_where_the_layout_puts_them() -> None:
    codes, s, o = _weight(32, 64, 16, 0)
    packed, high, sb = cpu_w6.pack(codes, s, o)
    assert packed.shape == (2, 16, 32) and high.shape == (2, 8, 32) and sb.shape == (2, 4, 2, 16)
    assert torch.equal(cpu_w6.codes_of(packed, high), codes)
    # chunk c = 5, row i = 2 of it, column j = 3 of tile 1: nibbles of columns 19 and 27
    row, col = 4 * 5 + 2, 16 + 3
    assert int(packed[1, 5, 4 * 3 + 2]) == (int(codes[col, row]) & 15) | (int(codes[col + 8, row]) & 15) << 4
    # chunk 5 is the odd one of pair 2: its top bits are bits 4-5 (column 3) and 6-7 (column 11)
    top = int(high[1, 2, 4 * 3 + 2])
    assert (top >> 4) & 3 == int(codes[col, row]) >> 4 and top >> 6 == int(codes[col + 8, row]) >> 4
    w = codes.float() * s.repeat_interleave(16, 1) + o.repeat_interleave(16, 1)
    assert torch.equal(cpu_w6.dequantize(packed, high, sb), w)
    with pytest.raises(ValueError, match=r"0\.\.63"):
        cpu_w6.pack(codes + 64, s, o)
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_w6.pack(codes, s[:, :1].repeat(1, 16), o[:, :1].repeat(1, 16))  # groups of 4


def _int8_reference(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """x @ W.T as the int8-activation kernels define it, in float64."""
    xq, dx = cpu_w4.quantize_activations(x.float(), group)
    rounded = (xq.double().reshape(*dx.shape, group) * dx.double()[..., None]).reshape(x.shape)
    return rounded @ w.double().t()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize(("n", "k", "group"), [(32, 64, 16), (48, 256, 32), (576, 1536, 16),
                                              (64, 96, 24)])
def test_loops_equal_the_int8_reference(cpu_variant: str, rows: int, n: int, k: int,
                                        group: int) -> None:
    """Each build's vector loops and its plain-C loops, float32 and bf16, against the float64
    product of the weight and the activations rounded to int8 per group; codes up to 63 fill
    the int16 sums of the builds without VNNI to their limit."""
    codes, s, o = _weight(n, k, group, rows)
    codes[:, : k // 2] = 63  # the largest products
    packed, high, sb = cpu_w6.pack(codes, s, o)
    w = cpu_w6.dequantize(packed, high, sb)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, : k // 2] = x[0, : k // 2].abs() * 10  # all of one sign, at the largest code
    exact = _int8_reference(x, w, group)
    for plain in (False, True):
        got = cpu_w6.matmul(x, packed, high, sb, plain=plain)
        assert got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()
    xb = x.bfloat16()  # read as bf16: the float32 product of the same values, rounded
    got = cpu_w6.matmul(xb, packed, high, sb)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_w6.matmul(xb.float(), packed, high, sb).bfloat16())


@pytest.fixture(scope="module")
def fixture_tensors() -> dict[str, np.ndarray]:
    return {t.name: t.data for t in FastGGUFReader(FIXTURE).tensors}


# Where the 6-bit layout rounds the file's scales to float16: Q5_K's and Q6_K's d * sc (and
# Q5_K's dmin * m); Q5_0's and Q5_1's d and m are float16 in the file already.
SCALE_ROUNDING = {"Q5_0": 0.0, "Q5_1": 0.0, "Q5_K": 2**-11, "Q6_K": 2**-11}


@needs_kernels
@pytest.mark.parametrize("type_name", sorted(W6_TYPES))
def test_c_packer_holds_the_gguf_values(fixture_tensors, type_name: str) -> None:
    """A tensor of each type from the committed fixture (written by llama.cpp's quantizer's
    formats), packed in C with its rows reordered, dequantizes to the `gguf` package's values
    (up to the float16 rounding of the scales); the bytes equal the torch packer's from the
    numpy int8 route's numbers."""
    data = fixture_tensors[type_name]
    n, k = SHAPE
    rows = np.random.default_rng(3).permutation(n).astype(np.int32)
    layer = W6Linear.from_gguf(GgmlInt8Weight(type_name, data, n, k, rows))
    assert layer.group_size == W6_TYPES[type_name]
    want = torch.from_numpy(gguf_dequantize(data, _qtype(type_name)).reshape(n, k)[rows].copy())
    got = cpu_w6.dequantize(layer.packed, layer.high, layer.sb)
    bound = SCALE_ROUNDING[type_name] * want.abs().max() * 2 + 1e-7 * want.abs().max()
    assert (got - want).abs().max() <= bound
    blocks = int8_blocks(type_name, data, n, k)
    zero = {"Q6_K": 32, "Q5_0": 16}.get(type_name, 0)
    scales = blocks.scales.half().float()
    offsets = (-zero * scales if blocks.offsets is None else blocks.offsets.half().float())
    ref = cpu_w6.pack((blocks.codes.int() + zero)[rows], scales[rows], offsets[rows])
    assert torch.equal(layer.packed, ref[0]) and torch.equal(layer.high, ref[1])
    assert torch.equal(layer.sb.view(torch.int16), ref[2].view(torch.int16))


def _qtype(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


@needs_kernels
def test_embedding_rows_and_fused_layers() -> None:
    """W6Embedding gathers the dequantized rows; a 4-bit and a 6-bit layer fused compute
    both outputs side by side, at the smaller group size."""
    codes, s, o = _weight(48, 128, 16, 1)
    six = W6Linear(*cpu_w6.pack(codes, s, o))
    w = cpu_w6.dequantize(six.packed, six.high, six.sb)
    ids = torch.tensor([[0, 47, 9], [16, 8, 31]])
    rows = W6Embedding(six, torch.float32)(ids)
    assert torch.equal(rows, w[ids])
    with pytest.raises(IndexError):
        W6Embedding(six, torch.float32)(torch.tensor([48]))

    four = _four_bit_layer(32, 128)
    fused = W6Linear.concat([four, six])
    assert fused.group_size == 16 and fused.out_features == 80
    w4 = cpu_w4.dequantize(four.w4_packed, four.w4_sb)
    assert torch.equal(cpu_w6.dequantize(fused.packed, fused.high, fused.sb), torch.cat([w4, w]))
    x = torch.randn(3, 128)
    assert torch.equal(fused(x), torch.cat([four(x), six(x)], dim=1)) or torch.allclose(
        fused(x), _int8_reference(x, torch.cat([w4, w]), 16).float(), rtol=0, atol=1e-4)


def _four_bit_layer(n: int, k: int):
    from localpaged.quant.layout import from_codes
    from localpaged.quant.linear import QuantLinear

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // 32, n, generator=g) * 0.02 + 0.001).half().float()
    zeros = torch.full((k // 32, n), 8.0)
    w = from_codes(codes, scales, zeros, 32)
    return QuantLinear.from_int4(w, None, torch.float32, "cpu")
