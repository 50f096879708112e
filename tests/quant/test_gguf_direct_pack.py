"""GGUF Q4_0 / Q4_1 / Q4_K matrices repacked straight into the CPU kernel's layout
(`GgmlInt4Weight.cpu_w4_pack`) give the same bytes as the `Int4Weight` route
(`cpu_w4.pack(q4_to_int4(...))`), with and without llama.cpp's q/k row permutation, and the
values of the `gguf` package's own reader and dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from localpaged.model.gguf_loader import RawTensor, q4_parts, q4_to_int4
from localpaged.model.gguf_reader import FastGGUFReader
from localpaged.quant import cpu_w4
from localpaged.quant.ggml_int4 import INT4_TYPES, GgmlInt4Weight
from localpaged.quant.linear import QuantLinear, to_cpu_int4pack
from tests.quant.test_ggml_fixtures import FIXTURE, SHAPE


@pytest.fixture(scope="module")
def fixture_data() -> dict[str, np.ndarray]:
    return {t.name: t.data for t in FastGGUFReader(FIXTURE).tensors}


def _raw(type_name: str, data: np.ndarray) -> RawTensor:
    return RawTensor("w", type_name, type_name, SHAPE, data)


@pytest.mark.parametrize("quads", [False, True], ids=["pairs", "quads"])
@pytest.mark.parametrize("heads", [None, 4])
@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_direct_pack_equals_int4_route(fixture_data, type_name: str, heads: int | None,
                                       quads: bool) -> None:
    """Q4_0/Q4_1 through the C packer (where the library builds), Q4_K through numpy."""
    raw = _raw(type_name, fixture_data[type_name])
    packed, sb = q4_parts(raw, heads).cpu_w4_pack(quads)
    want_packed, want_sb = cpu_w4.pack(q4_to_int4(raw, heads))
    if quads:
        want_packed = cpu_w4.quads_in_torch(want_packed)
    assert packed.dtype == torch.uint8 and sb.dtype == torch.float16
    assert torch.equal(packed, want_packed)
    assert torch.equal(sb.view(torch.int16), want_sb.view(torch.int16))  # bit for bit


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_c_packer_equals_numpy_on_every_kind_of_scale(type_name: str) -> None:
    """Random float16 bit patterns for d and m / dmin (subnormal, tiny, huge; a d of 0 makes
    constant Q4_1 blocks, and Q4_K groups whose 6-bit scale is 0 too): the C packer's float16
    rounding and float32 order are numpy's."""
    if not cpu_w4.available():
        pytest.skip("the CPU kernels do not build here")
    rng = np.random.default_rng(7)
    n, k = 48, 512
    size, block = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}[type_name]
    blocks = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    exps = rng.integers(0, 30, blocks.shape[0])  # no inf / NaN
    halves = (exps << 10) | rng.integers(0, 1024, blocks.shape[0])
    halves[::7] = 0  # d = 0: constant blocks
    blocks[:, 0], blocks[:, 1] = halves & 0xFF, halves >> 8
    if type_name != "Q4_0":  # m (Q4_1) or dmin (Q4_K)
        m = rng.integers(0, 0x7800, blocks.shape[0]) | (rng.integers(0, 2, blocks.shape[0]) << 15)
        blocks[:, 2], blocks[:, 3] = m & 0xFF, m >> 8
    data = blocks.reshape(-1)
    rows = np.random.default_rng(1).permutation(n)
    fast = GgmlInt4Weight.from_blocks(type_name, data, n, k, rows)
    numpy_route = GgmlInt4Weight(*fast._numpy_parts())
    for quads in (False, True):
        got, want = fast.cpu_w4_pack(quads), numpy_route.cpu_w4_pack(quads)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_direct_pack_holds_the_gguf_values(fixture_data, type_name: str) -> None:
    """Q4_0/Q4_1 keep float16 scales and offsets: the kernel layout dequantizes to the
    `gguf` package's values (up to the float32 rounding of d * q + m)."""
    data = GGUFReader(FIXTURE).tensors[[t.name for t in GGUFReader(FIXTURE).tensors]
                                       .index(type_name)].data
    want = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name]).reshape(SHAPE)
    packed, sb = q4_parts(_raw(type_name, fixture_data[type_name])).cpu_w4_pack()
    got = cpu_w4.dequantize(packed, sb).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_torch_int4_packing_from_parts(fixture_data, type_name: str) -> None:
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        pytest.skip("this torch has no CPU int4 op")
    raw = _raw(type_name, fixture_data[type_name])
    got = to_cpu_int4pack(q4_parts(raw), 32, torch.bfloat16)
    want = to_cpu_int4pack(q4_to_int4(raw), 32, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_quant_linear_from_parts_equals_int4_route(fixture_data, type_name: str,
                                                    dtype: torch.dtype) -> None:
    raw = _raw(type_name, fixture_data[type_name])
    parts = q4_parts(raw)
    assert isinstance(parts, GgmlInt4Weight)
    a = QuantLinear.from_int4(parts, None, dtype, "cpu")
    b = QuantLinear.from_int4(q4_to_int4(raw), None, dtype, "cpu")
    for name in ("w4_packed", "w4_sb", "cpu_packed", "cpu_scale_zeros", "qweight", "scales",
                 "zeros"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        assert x is None or torch.equal(x, y), name
    x = torch.randn(3, SHAPE[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_parts_codes_and_dense_values_equal_int4_route(fixture_data, type_name: str) -> None:
    """The codes the other paths unpack, and the dense float32 values a 4-bit token
    embedding is stored with, are the `Int4Weight`'s bit for bit."""
    raw = _raw(type_name, fixture_data[type_name])
    parts, want = q4_parts(raw, 4), q4_to_int4(raw, 4)
    assert torch.equal(parts.codes(), want.codes())
    assert torch.equal(parts.dequantize(), want.dequantize())


def test_q4_1_constant_blocks_repack_like_int4_route(fixture_data) -> None:
    """Q4_1 blocks whose scale is 0 (constant `m`) take the `Int4Weight`'s special form."""
    data = np.array(fixture_data["Q4_1"]).reshape(-1, 20)
    data[::3, 0:2] = 0  # d = 0 in every third block
    raw = _raw("Q4_1", data.reshape(SHAPE[0], -1))
    packed, sb = q4_parts(raw).cpu_w4_pack()
    want_packed, want_sb = cpu_w4.pack(q4_to_int4(raw))
    assert torch.equal(packed, want_packed)
    assert torch.equal(sb.view(torch.int16), want_sb.view(torch.int16))


@pytest.mark.parametrize("heads", [None, 4])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q6_K"])
def test_c_int8_packer_equals_the_numpy_route(fixture_data, type_name: str,
                                              heads: int | None) -> None:
    """Q8_0 / Q5_0 / Q6_K from the file's blocks straight into the 8-bit kernel's tiles: the
    tiles and scales of `Q8Linear.from_blocks(q_to_int8(...))`, bit for bit (Q8_0's scales
    kept float16), with and without
    llama.cpp's q/k row permutation; and random Q6_K / Q5_0 blocks (any bit pattern, no
    inf / NaN scales) likewise."""
    from localpaged.model.gguf_loader import q8_parts, q_to_int8
    from localpaged.quant.ggml_int8 import GgmlInt8Weight
    from localpaged.quant.q8_linear import Q8Linear

    if not GgmlInt8Weight.packable(type_name):
        pytest.skip("the CPU kernels do not build here")
    rng = np.random.default_rng(3)
    size, values = {"Q8_0": (34, 32), "Q5_0": (22, 32), "Q6_K": (210, 256)}[type_name]
    at = 208 if type_name == "Q6_K" else 0  # where d is
    random = rng.integers(0, 256, (48 * 512 // values, size), dtype=np.uint8)
    halves = (rng.integers(0, 30, random.shape[0]) << 10) | rng.integers(0, 1024, random.shape[0])
    random[:, at], random[:, at + 1] = halves & 0xFF, halves >> 8
    cases = [_raw(type_name, fixture_data[type_name]),
             RawTensor("w", type_name, type_name, (48, 512), random.reshape(-1))]
    for raw in cases:
        fast = q8_parts(raw, heads)
        assert isinstance(fast, GgmlInt8Weight)
        got = Q8Linear.from_blocks(fast)
        want = Q8Linear.from_blocks(q_to_int8(raw, heads))
        assert torch.equal(got.tiles, want.tiles)
        # Q8_0 keeps its float16 d (the same values: exact in float32 too)
        assert got.tile_scales.dtype == (torch.float16 if type_name == "Q8_0" else torch.float32)
        assert torch.equal(got.tile_scales.float().view(torch.int32),
                           want.tile_scales.view(torch.int32))
        assert got.tile_offsets is None and want.tile_offsets is None
        assert torch.equal(fast.blocks().codes, q_to_int8(raw, heads).codes)
