"""The 6-bit layout (quant/cpu_w6.py, kernels/cpu/int8_dot.c): the torch packer against its
definition, each build's loops against a float64 reference, the GGUF C packer against the
`gguf` package's dequantization and against the numpy int8 route, and the layer, embedding and
fused forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from localpaged.kernels import native
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


# (top bits, zero point): 6-bit with offsets (Q5_1), 6-bit symmetric (Q6_K, Q5_0),
# 4-bit symmetric (Q4_0), IQ4_NL's code book (4-bit codes, bytes up to 241 through the int16
# sums of the builds without VNNI)
KINDS = [(True, 0), (True, 32), (False, 8), (False, cpu_w6.NL)]
KIND_IDS = ["6-bit", "6-bit-sym", "4-bit-sym", "iq4nl"]


def _packed(n: int, k: int, group: int, seed: int, six: bool, zp: int):
    codes, s, o = _weight(n, k, group, seed, 64 if six else 16)
    codes[:, : k // 2] = 63 if six else 15  # the largest products
    return cpu_w6.pack(codes, s, None if zp else o, zero_point=zp, top_bits=six)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 13])
@pytest.mark.parametrize(("n", "k", "group"), [(32, 64, 16), (48, 256, 32), (576, 1536, 16),
                                              (64, 96, 24)])
@pytest.mark.parametrize(("six", "zp"), KINDS, ids=KIND_IDS)
def test_loops_equal_the_int8_reference(cpu_variant: str, rows: int, n: int, k: int,
                                        group: int, six: bool, zp: int) -> None:
    """Each build's vector loops and its plain-C loops, float32 and bf16, against the float64
    product of the weight and the activations rounded to int8 per group; codes up to 63 fill
    the int16 sums of the builds without VNNI to their limit."""
    packed, high, sb = _packed(n, k, group, rows, six, zp)
    w = cpu_w6.dequantize(packed, high, sb, zp)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, : k // 2] = x[0, : k // 2].abs() * 10  # all of one sign, at the largest code
    exact = _int8_reference(x, w, cpu_w6.activation_block(zp, group, k, six))
    for plain in (False, True):
        got = cpu_w6.matmul(x, packed, high, sb, zp, plain=plain)
        assert got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()
    xb = x.bfloat16()  # read as bf16: the float32 product of the same values, rounded
    got = cpu_w6.matmul(xb, packed, high, sb, zp)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_w6.matmul(xb.float(), packed, high, sb, zp).bfloat16())


@needs_kernels
@pytest.mark.parametrize(("six", "zp", "group"),
                         [(six, zp, 32) for six, zp in KINDS] + [(True, 32, 16), (False, cpu_w6.KQ, 32)],
                         ids=[*KIND_IDS, "q6_k-form", "super-block"])
def test_a_row_gives_the_same_bits_in_any_pass(cpu_variant: str, six: bool, zp: int,
                                               group: int) -> None:
    """A row's product does not depend on how many rows share its pass over a tile (1-4 rows,
    or up to 8 in the VNNI builds' wide tile) nor on K being taken in spans (many rows): 13
    rows at once equal each row alone, bit for bit, float32 and bf16 (super-block scales and
    Q6_K's form too: their sums per super-block in every VNNI tile)."""
    n, k = 48, 1536
    if zp == cpu_w6.KQ:
        kq = _kq_layer(n, k, 13)
        packed, high, sb = kq.packed, kq.high, kq.sb
    else:
        packed, high, sb = _packed(n, k, group, 13, six, zp)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(7))
    for xs in (x, x.bfloat16()):
        together = cpu_w6.matmul(xs, packed, high, sb, zp)
        for r in range(13):
            assert torch.equal(together[r:r + 1], cpu_w6.matmul(xs[r:r + 1], packed, high, sb, zp))


def _kq_layer(n: int, k: int, seed: int) -> W6Linear:
    """A random Q4_K-like layer with super-block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    dmin = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    sc, mins = (torch.randint(0, 64, (n, k // 32), generator=g) for _ in range(2))
    packed, _, sb = cpu_w6.pack_kq(codes, d, dmin, sc, mins)
    return W6Linear(packed, None, sb, cpu_w6.KQ)


@needs_kernels
@pytest.mark.parametrize("rows", [27, 28, 45])
@pytest.mark.parametrize(("six", "zp"), [*KINDS, (False, cpu_w6.KQ)], ids=[*KIND_IDS, "super-block"])
def test_many_bf16_rows_on_amx_take_the_weight_in_bf16(cpu_variant: str, rows: int, six: bool,
                                                       zp: int) -> None:
    """On AMX, bf16 products of many rows unpack the quads layout (every form of codes and
    scales) to bf16 tiles: each row then equals the float64 product of the bf16-rounded weight
    within bf16's rounding, and fewer rows take the int8 activations. Elsewhere every row count
    takes int8 activations (the bf16 product is the float32 one, rounded)."""
    lib = native.library()
    amx_from = lib.w4_bf16_quads_amx_rows() if lib is not None else 0
    n, k = 48, 512
    if zp == cpu_w6.KQ:
        layer = _kq_layer(n, k, rows)
        packed, high, sb = layer.packed, None, layer.sb
    else:
        packed, high, sb = _packed(n, k, 32, rows, six, zp)
    w = cpu_w6.dequantize(packed, high, sb, zp)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_w6.matmul(x, packed, high, sb, zp)
    assert got.dtype == torch.bfloat16
    if amx_from and rows >= amx_from:
        exact = x.double() @ w.bfloat16().double().t()
        assert (got.double() - exact).abs().max() <= 2**-7 * exact.abs().max()
        assert not torch.equal(got, cpu_w6.matmul(x.float(), packed, high, sb, zp).bfloat16())
    else:
        assert torch.equal(got, cpu_w6.matmul(x.float(), packed, high, sb, zp).bfloat16())


@needs_kernels
def test_symmetric_groups_equal_their_offsets_written_out() -> None:
    """Scales alone with a zero point give the products of the same weight with its offsets
    `-zp * scale` stored, bit for bit (the offsets are exact: zp is a power of two); in Q6_K's
    form (groups of 16) through activations per super-block, each the int8 product of its own
    activation blocks."""
    codes, s, _ = _weight(48, 256, 32, 3)
    sym = cpu_w6.pack(codes, s, None, zero_point=32)
    full = cpu_w6.pack(codes, s, -32 * s)
    assert sym[2].shape == (3, 8, 1, 16) and full[2].shape == (3, 8, 2, 16)
    x = torch.randn(5, 256)
    assert torch.equal(cpu_w6.matmul(x, *sym, 32), cpu_w6.matmul(x, *full))
    with pytest.raises(ValueError, match="zero point"):
        W6Linear(sym[0], sym[1], sym[2])
    codes, s, _ = _weight(48, 256, 16, 3)
    sym = cpu_w6.pack(codes, s, None, zero_point=32)
    full = cpu_w6.pack(codes, s, -32 * s)
    w = cpu_w6.dequantize(*full)
    assert torch.equal(cpu_w6.dequantize(*sym, 32), w)
    assert cpu_w6.activation_block(32, 16, 256, True) == 256
    for got, block in ((cpu_w6.matmul(x, *sym, 32), 256), (cpu_w6.matmul(x, *full), 16)):
        exact = _int8_reference(x, w, block)
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()


@pytest.fixture(scope="module")
def fixture_tensors() -> dict[str, np.ndarray]:
    return {t.name: t.data for t in FastGGUFReader(FIXTURE).tensors}


# Where the 6-bit layout rounds the file's scales to float16: Q6_K's d * sc; Q5_0's and Q5_1's
# d and m are float16 in the file already (Q5_K keeps its super-block scales, exact).
SCALE_ROUNDING = {"Q5_0": 0.0, "Q5_1": 0.0, "Q6_K": 2**-11}


@needs_kernels
@pytest.mark.parametrize("type_name", sorted(set(W6_TYPES) - {"Q5_K"}))  # Q5_K: super-block
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
    zero = {"Q6_K": 32, "Q5_0": 16}.get(type_name, 0)
    assert layer.zero_point == zero and layer.sb.shape[2] == (1 if zero else 2)
    want = torch.from_numpy(gguf_dequantize(data, _qtype(type_name)).reshape(n, k)[rows].copy())
    got = layer.dequantize()
    bound = SCALE_ROUNDING[type_name] * want.abs().max() * 2 + 1e-7 * want.abs().max()
    assert (got - want).abs().max() <= bound
    blocks = int8_blocks(type_name, data, n, k)
    scales = blocks.scales.half().float()
    offsets = None if zero else blocks.offsets.half().float()  # type: ignore[union-attr]
    ref = cpu_w6.pack((blocks.codes.int() + zero)[rows], scales[rows],
                      None if offsets is None else offsets[rows], zero_point=zero)
    assert torch.equal(layer.packed, ref[0]) and torch.equal(layer.high, ref[1])
    assert torch.equal(layer.sb.view(torch.int16), ref[2].view(torch.int16))


@needs_kernels
def test_q4_0_keeps_its_scales_alone(fixture_tensors) -> None:
    """A Q4_0 matrix in the quads layout with symmetric groups: the `gguf` package's values
    exactly, and the int8 products of its activations per super-block (`activation_block`),
    as the 4-bit layer with its offsets stored gives them per group."""
    from localpaged.quant.ggml_int4 import GgmlInt4Weight
    from localpaged.quant.linear import QuantLinear

    n, k = SHAPE
    data = fixture_tensors["Q4_0"]
    w = GgmlInt4Weight.from_blocks("Q4_0", data, n, k)
    layer = W6Linear.from_q4_0(w)
    assert layer.high is None and layer.zero_point == 8 and layer.sb.shape[2] == 1
    want = torch.from_numpy(gguf_dequantize(data, _qtype("Q4_0")).reshape(n, k).copy())
    assert torch.equal(layer.dequantize(), want)
    four = QuantLinear.from_int4(w, None, torch.float32, "cpu")
    x = torch.randn(3, k)
    by_groups = cpu_w4.matmul_int8_activations(x, cpu_w4.to_quads(
        cpu_w4.to_pairs(four.w4_packed)), four.w4_sb)
    block = cpu_w6.activation_block(8, 32, k)
    assert block == (256 if k % 256 == 0 else 32)
    for got, size in ((layer(x), block), (by_groups, 32)):
        exact = _int8_reference(x, want, size)
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()


@needs_kernels
@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS"])
def test_code_book_types_keep_their_codes_and_scales(fixture_tensors, type_name: str) -> None:
    """An IQ4_NL / IQ4_XS matrix packed in C (rows permuted) keeps its 4-bit codes and a
    float16 scale per 32 (4.5 bits a weight): the `gguf` package's values (exactly for IQ4_NL;
    IQ4_XS's d * (ls - 32) rounded to float16), its codes and scales where `cpu_w6.pack` puts
    them, products within the int8 scheme's rounding of the exact ones, and its embedding rows."""
    from localpaged.quant.q8_linear import Q8Linear

    n, k = SHAPE
    data = fixture_tensors[type_name]
    rows = np.random.default_rng(5).permutation(n).astype(np.int32)
    weight = GgmlInt8Weight(type_name, data, n, k, rows)
    layer = W6Linear.from_gguf(weight)
    assert layer.zero_point == cpu_w6.NL and layer.high is None and layer.group_size == 32
    assert layer.sb.shape == (n // 16, k // 32, 1, 16)
    assert layer.packed.numel() + layer.sb.numel() * 2 == n * k * 4.5 / 8
    want = torch.from_numpy(gguf_dequantize(data, _qtype(type_name)).reshape(n, k)[rows].copy())
    got = layer.dequantize()
    if type_name == "IQ4_NL":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= 2**-11 * want.abs().max()
    blocks = weight.blocks()  # the int8 route: the code book's signed values, float32 scales
    assert torch.equal(layer.blocks().codes, blocks.codes)
    index = torch.zeros(256, dtype=torch.uint8)
    index[cpu_w6.NL_VALUES.long()] = torch.arange(16, dtype=torch.uint8)
    nibbles = index[blocks.codes.long() + 128]
    ref = cpu_w6.pack(nibbles, blocks.scales.half().float(), None, zero_point=cpu_w6.NL,
                      top_bits=False)
    assert torch.equal(layer.packed, ref[0])
    assert torch.equal(layer.sb.view(torch.int16), ref[2].view(torch.int16))
    x = torch.randn(5, k)
    exact = _int8_reference(x, got, 32)
    assert (layer(x).double() - exact).abs().max() <= 2**-18 * exact.abs().max()
    q8 = Q8Linear.from_blocks(blocks)(x).double()  # the int8 blocks it replaces
    assert (q8 - exact).abs().max() <= 2**-10 * exact.abs().max()
    ids = torch.tensor([0, n - 1, 7])
    assert torch.equal(W6Embedding(layer, torch.float32)(ids), got[ids])


@needs_kernels
def test_iq4_nl_fuses_with_its_kind_only() -> None:
    """IQ4_NL layers fuse keeping the code book; with another kind the model's fusion joins
    them side by side, each in its own form."""
    from localpaged.model.llama import fuse_linears
    from localpaged.quant.joined_linear import JoinedLinear

    a, b = (W6Linear(*_packed(32, 128, 32, seed, False, cpu_w6.NL), cpu_w6.NL) for seed in (2, 3))
    both = fuse_linears([a, b])
    assert isinstance(both, W6Linear) and both.zero_point == cpu_w6.NL
    x = torch.randn(3, 128)
    assert torch.equal(both(x), torch.cat([a(x), b(x)], dim=1))
    six = W6Linear(*_packed(48, 128, 16, 1, True, 32), 32)
    with pytest.raises(ValueError, match="IQ4_NL"):
        W6Linear.concat([a, six])
    mixed = fuse_linears([a, six])
    assert isinstance(mixed, JoinedLinear) and list(mixed.parts) == [a, six]
    assert torch.equal(mixed(x), torch.cat([a(x), six(x)], dim=1))


def _qtype(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


@needs_kernels
@pytest.mark.parametrize(("six", "zp"), KINDS, ids=KIND_IDS)
def test_embedding_rows(six: bool, zp: int) -> None:
    """W6Embedding gathers the dequantized rows."""
    layer = W6Linear(*_packed(48, 128, 16, 1, six, zp), zp)
    ids = torch.tensor([[0, 47, 9], [16, 8, 31]])
    assert torch.equal(W6Embedding(layer, torch.float32)(ids), layer.dequantize()[ids])
    with pytest.raises(IndexError):
        W6Embedding(layer, torch.float32)(torch.tensor([48]))


@needs_kernels
def test_fused_layers() -> None:
    """Fused layers compute their parts' outputs side by side, at the smaller group size:
    4-bit (offsets stored) with 6-bit symmetric writes the zero point's offsets out; two
    symmetric parts of one zero point stay symmetric, without top bits if neither has any."""
    six = W6Linear(*_packed(48, 128, 16, 1, True, 32), 32)
    four = _four_bit_layer(32, 128)
    fused = W6Linear.concat([four, six])
    assert fused.group_size == 16 and fused.out_features == 80 and fused.zero_point == 0
    w4 = cpu_w4.dequantize(four.w4_packed, four.w4_sb)
    assert torch.equal(fused.dequantize(), torch.cat([w4, six.dequantize()]))
    x = torch.randn(3, 128)
    want = _int8_reference(x, fused.dequantize(), 16)
    assert (fused(x).double() - want).abs().max() <= 2**-18 * want.abs().max()
    a, b = (W6Linear(*_packed(32, 128, 32, seed, False, 8), 8) for seed in (2, 3))
    both = W6Linear.concat([a, b])
    assert both.zero_point == 8 and both.high is None and both.sb.shape[2] == 1
    assert torch.equal(both(x), torch.cat([a(x), b(x)], dim=1))


def _four_bit_layer(n: int, k: int):
    from localpaged.quant.layout import from_codes
    from localpaged.quant.linear import QuantLinear

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // 32, n, generator=g) * 0.02 + 0.001).half().float()
    zeros = torch.full((k // 32, n), 8.0)
    w = from_codes(codes, scales, zeros, 32)
    return QuantLinear.from_int4(w, None, torch.float32, "cpu")


def _kq_fields(type_name: str, data: np.ndarray, n: int, k: int):
    """Q4_K's or Q5_K's own numbers, read with numpy (ggml_types): codes [N, K] (Q5_K's
    fifth bits from qh), d and dmin [N, K/256], 6-bit scales and mins [N, K/32]."""
    from localpaged.quant import ggml_types as gt

    b = gt.blocks_of(type_name, data, n * k)
    sc, mins = gt.k4_scales_mins(b[:, 4:16])
    if type_name == "Q4_K":
        codes = gt.k4_codes(b[:, 16:144])
    else:  # the fifth bit of value l of group i is bit i of qh byte l
        fifth = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        codes = gt.k4_codes(b[:, 48:176]) | (fifth << 4)
    return (torch.from_numpy(codes.reshape(n, k).astype(np.uint8)),
            torch.from_numpy(gt.f16_field(b, 0).reshape(n, -1)),
            torch.from_numpy(gt.f16_field(b, 2).reshape(n, -1)),
            torch.from_numpy(sc.reshape(n, -1).astype(np.int32)),
            torch.from_numpy(mins.reshape(n, -1).astype(np.int32)))


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quants_keep_their_super_block_scales(fixture_tensors, type_name: str) -> None:
    """A Q4_K / Q5_K matrix packed in C (rows permuted) with its super-block scales (Q5_K's
    fifth bits in the top-bit plane): the `gguf` package's values exactly (d * sc is exact in
    float32), the torch packer's bytes from the numpy reading of the blocks, and products
    closer to the exact ones than float16 scales and offsets per group (the 4-bit layer's, and
    the 6-bit layout's before), which round d * sc and dmin * m."""
    from localpaged.quant.ggml_int4 import GgmlInt4Weight

    n, k = SHAPE
    data = fixture_tensors[type_name]
    rows = np.random.default_rng(4).permutation(n).astype(np.int32)
    five = type_name == "Q5_K"
    layer = (W6Linear.from_gguf(GgmlInt8Weight(type_name, data, n, k, rows)) if five
             else W6Linear.from_q4_k(GgmlInt4Weight.from_blocks(type_name, data, n, k, rows)))
    assert layer.zero_point == cpu_w6.KQ and layer.group_size == 32
    assert (layer.high is not None) == five
    assert layer.sb.shape == (n // 16, k // 256, cpu_w6.KQ_RECORD)
    kept = (layer.packed, layer.high, layer.sb)
    bits = 8 * sum(t.numel() * t.element_size() for t in kept if t is not None) / (n * k)
    assert bits == (6.625 if five else 4.625)
    want = torch.from_numpy(gguf_dequantize(data, _qtype(type_name)).reshape(n, k)[rows].copy())
    assert torch.equal(layer.dequantize(), want)
    codes, d, dmin, sc, mins = (v[rows] for v in _kq_fields(type_name, data, n, k))
    packed, high, sb = cpu_w6.pack_kq(codes, d, dmin, sc, mins, top_bits=five)
    assert torch.equal(layer.packed, packed) and torch.equal(layer.sb, sb)
    assert high is None if not five else torch.equal(layer.high, high)
    x = torch.randn(4, k)
    assert cpu_w6.activation_block(layer.zero_point, 32) == 256  # activations per super-block
    exact = _int8_reference(x, want, 256)
    error = (layer(x).double() - exact).abs().max()
    assert error <= 2**-18 * exact.abs().max()
    # float16 scales and offsets per group are off by their rounding
    s, o = (v.half().float() for v in cpu_w6.scales_offsets(layer.sb, cpu_w6.KQ))
    old = cpu_w6.pack(codes, s, o, top_bits=five)
    assert (cpu_w6.matmul(x, *old).double() - _int8_reference(x, want, 32)).abs().max() > error


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 13])
@pytest.mark.parametrize(("n", "k"), [(32, 256), (576, 1536)])
@pytest.mark.parametrize("top_bits", [False, True], ids=["4-bit", "6-bit"])
def test_super_block_loops_equal_the_int8_reference(cpu_variant: str, rows: int, n: int,
                                                    k: int, top_bits: bool) -> None:
    """Super-block scales (4-bit codes as Q4_K's, or with top bits as Q5_K's, here up to 63)
    through each build's vector loops and plain-C loops, float32 and bf16, against the float64
    product of the weight and the int8-rounded activations; the embedding gathers its rows
    and two such layers fuse keeping them."""
    g = torch.Generator().manual_seed(rows)
    top = 63 if top_bits else 15
    codes = torch.randint(0, top + 1, (n, k), generator=g, dtype=torch.uint8)
    codes[:, : k // 2] = top  # the int16 sums' largest, with the largest scales below
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    dmin = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    sc, mins = (torch.randint(0, 64, (n, k // 32), generator=g) for _ in range(2))
    sc[:, : k // 64] = 63
    packed, high, sb = cpu_w6.pack_kq(codes, d, dmin, sc, mins, top_bits=top_bits)
    layer = W6Linear(packed, high, sb, cpu_w6.KQ)
    w = layer.dequantize()
    s = (d.repeat_interleave(8, 1) * sc).repeat_interleave(32, 1)
    o = (dmin.repeat_interleave(8, 1) * mins).repeat_interleave(32, 1)
    assert torch.equal(w, codes.float() * s - o)
    x = torch.randn(rows, k, generator=g)
    x[0, : k // 2] = x[0, : k // 2].abs() * 10
    exact = _int8_reference(x, w, cpu_w6.activation_block(cpu_w6.KQ, 32))
    for plain in (False, True):
        got = cpu_w6.matmul(x, layer.packed, layer.high, layer.sb, cpu_w6.KQ, plain=plain)
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()
    xb = x.bfloat16()
    assert torch.equal(layer(xb), layer(xb.float()).bfloat16())
    ids = torch.tensor([0, n - 1, 17 % n, 9])
    assert torch.equal(W6Embedding(layer, torch.float32)(ids), w[ids])
    both = W6Linear.concat([layer, layer])
    assert both.zero_point == cpu_w6.KQ and torch.equal(both(x), torch.cat([layer(x)] * 2, 1))
    six = W6Linear(*_packed(n, k, 16, 1, True, 32), 32)
    mixed = W6Linear.concat([layer, six])  # written out: float16 scales and offsets per group
    assert mixed.zero_point == 0 and mixed.group_size == 16
    want = torch.cat([w, six.dequantize()])
    assert (mixed.dequantize() - want).abs().max() <= 2**-10 * want.abs().max()
