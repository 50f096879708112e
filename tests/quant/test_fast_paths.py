"""The CPU fast paths of the quantized layers: QuantLinear joined along N (q/k/v, gate/up),
its dequantized copy for many-row batches, and the int8 lm_head. Each is compared with the
plain computation it replaces."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import native
from localpaged.quant import cpu_w4
from localpaged.quant.int8_linear import Int8Linear
from localpaged.quant.layout import from_codes
from localpaged.quant.linear import QuantLinear


def _int4(k: int, n: int, group: int, seed: int, act_order: bool = False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)]
    return from_codes(codes, scales, zeros, group, g_idx)


def _layers(dtype: torch.dtype, sizes=(128, 64, 32), act_order: bool = False):
    w0 = _int4(128, sizes[0], 32, 0, act_order)
    layers = []
    for i, n in enumerate(sizes):
        w = _int4(128, n, 32, i + 1, act_order)
        if act_order:
            w.perm = w0.perm  # q/k/v of one GPTQ layer share the input's order
        layers.append(QuantLinear.from_int4(w, None, dtype, "cpu"))
    return layers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act_order", [False, True])
def test_concat_equals_the_layers_side_by_side(dtype: torch.dtype, act_order: bool) -> None:
    layers = _layers(dtype, act_order=act_order)
    fused = QuantLinear.concat(layers)
    assert fused.out_features == sum(layer.out_features for layer in layers)
    x = torch.randn(5, 128, dtype=dtype)
    expected = torch.cat([layer(x) for layer in layers], dim=-1)
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=0)


@pytest.fixture(params=["own", "torch"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Layers built with the package's CPU kernel (where it builds) or with torch's ops only."""
    if request.param == "torch":
        monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")
    elif not native.has_compiler():
        pytest.skip("no C compiler here to build the CPU kernels")
    return request.param


def test_concat_refuses_layers_that_differ(cpu_kernels: str) -> None:
    a, b = _layers(torch.bfloat16, sizes=(64, 32))
    c = QuantLinear.from_int4(_int4(128, 32, 64, 9), None, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="differ"):
        QuantLinear.concat([a, c])
    d = QuantLinear.from_int4(_int4(128, 32, 32, 9, act_order=True), None, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="differ"):
        QuantLinear.concat([a, d])
    assert QuantLinear.concat([a, b]).out_features == 96
    if cpu_kernels == "torch":
        with pytest.raises(ValueError, match="multiples of 64"):  # the CPU packing's N blocks
            QuantLinear.concat([b, a])
    else:  # the own kernel's tiles join anywhere; torch's packing is left out of the join
        joined = QuantLinear.concat([b, a])
        assert joined.cpu_packed is None and joined.w4_packed is not None
        x = torch.randn(3, 128, dtype=torch.bfloat16)
        torch.testing.assert_close(joined(x), torch.cat([b(x), a(x)], -1), rtol=0, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_dequantized_recovers_the_weight_from_the_cpu_packing(act_order: bool, cpu_kernels: str) -> None:
    w = _int4(128, 48, 32, 3, act_order)
    layer = QuantLinear.from_int4(w, None, torch.bfloat16, "cpu")
    assert layer.qweight is None  # only CPU packings: the own kernel's, else torch's
    assert (layer.w4_packed is not None) == (cpu_kernels == "own")
    assert (layer.cpu_packed is not None) == (cpu_kernels != "own")
    dense = layer.dequantized()
    # What the int4 op computes, to its own rounding (bf16; int8 activations for few rows on
    # AVX-512 builds with native bf16: within 2% of the largest output)...
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    want, got = torch.nn.functional.linear(x, dense).float(), layer(x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    # ... and the weight itself, to the rounding of its bf16 scales and offsets.
    ref = w.dequantize(torch.float32)
    assert (dense.float() - ref).abs().max() <= 0.01 * ref.abs().max()


def test_dense_copy_serves_wide_batches_only(cpu_kernels: str) -> None:
    layer = QuantLinear.from_int4(_int4(128, 48, 32, 4), None, torch.bfloat16, "cpu")
    narrow, wide = torch.randn(3, 128, dtype=torch.bfloat16), torch.randn(20, 128, dtype=torch.bfloat16)
    before_narrow, before_wide = layer(narrow), layer(wide)
    layer.keep_dense_copy(min_rows=16)
    assert torch.equal(layer(narrow), before_narrow)  # still the int4 op
    dense = torch.nn.functional.linear(wide, layer.dense_weight)
    assert torch.equal(layer(wide), dense)
    # The int4 op's own rounding: bf16, or int8 activations for every row count on AVX-512
    # builds with native bf16 but no AMX (within 2% of the largest output, as above).
    assert (layer(wide).float() - before_wide.float()).abs().max() <= 0.02 * dense.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_head_codes_are_the_torch_formula(cpu_kernels: str, dtype: torch.dtype) -> None:
    """bf16 heads are quantized in one C pass where the library builds: the same bytes as
    torch's ops (scale = max|w| / 127, codes rounded half to even), tiles included."""
    g = torch.Generator().manual_seed(3)
    for n in (1008, 1000):  # whole 16-row tiles, and not
        weight = (torch.randn(n, 96, generator=g) * 0.05).to(dtype)
        weight[5] = 0  # a row of zeros: the scale's floor
        weight[7, 3] = 40.0  # one large value: the rest of its row rounds to few codes
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(w / scale[:, None]).to(torch.int8)
        head = Int8Linear(weight, dense_min_rows=8)
        assert torch.equal(head.codes, codes)
        assert torch.equal(head.scales, scale.to(dtype))
        assert (head.tiles is not None) == (cpu_kernels == "own" and n % 16 == 0)
        if head.tiles is not None:
            assert torch.equal(head.tiles, cpu_w4.pack_w8(codes))
            assert torch.equal(head.tile_scales, scale.to(dtype).float())


def test_int8_head_is_close_to_the_dense_head(cpu_kernels: str) -> None:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(1008, 64, generator=g) * 0.05).to(torch.bfloat16)
    head = Int8Linear(weight, dense_min_rows=8)
    assert (head.tiles is not None) == (cpu_kernels == "own")
    assert head.dense.data_ptr() == weight.data_ptr()  # shared: a tied embedding is not copied
    for rows in (2, 3, 8, 20):  # torch's int8 op, then the own kernel or the dense weight
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), weight.float())
        got = head(x).float()
        int8_x = rows > 2 and head.q8_scales is not None  # x in int8 per block too (no AMX)
        # Per-channel int8 keeps logits within a percent of their spread; int8 activations
        # per block of 32 (as GGUF's Q8_0 heads) within three.
        assert (got - ref).abs().max() < (0.03 if int8_x else 0.01) * ref.abs().max()
        if rows >= 8 and cpu_kernels == "torch":
            assert torch.equal(head(x), torch.nn.functional.linear(x, weight))
        if int8_x:  # the 8-bit block kernel's answer (its plain-C loops), to bf16 rounding
            plain = cpu_w4.matmul_q8(x, head.tiles, head.q8_scales, plain=True)
            assert (got - plain).abs().max() <= 2**-7 * plain.abs().max()
        elif rows > 2 and cpu_kernels == "own":  # exactly the int8 product, to bf16 rounding
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            exact = (x.float() @ head.codes.float().t()) * head.scales.float()
            assert (got - exact).abs().max() <= 2**-7 * exact.abs().max()
        else:
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
