"""Hand-worked byte examples (shared/QUANT_FORMATS.md §1.8, §1.9, §2.6) and round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged.quant.formats import (
    QuantSpec,
    awq_pack,
    awq_to_int4,
    awq_unpack,
    gguf_q4_to_int4,
    gptq_pack,
    gptq_to_int4,
    gptq_unpack,
    parse_quant_config,
)
from localpaged.quant.layout import from_codes, pack_nibbles, unpack_nibbles


def i32(word: int) -> int:
    """The int32 reading of a 32-bit pattern."""
    return word - 2**32 if word >= 2**31 else word


def test_gptq_worked_example() -> None:
    # 16 inputs x 8 outputs; outputs 0 and 1 carry the example codes on inputs 0..7.
    codes = torch.zeros(16, 8, dtype=torch.int32)
    codes[0:8, 0] = torch.arange(8)
    codes[0:8, 1] = torch.arange(8, 16)
    zeros = (torch.arange(8) % 8 + 1).view(1, 8)
    qweight, qzeros = gptq_pack(codes, zeros)
    assert qweight[0, 0].item() == 0x76543210
    assert qweight[0, 1].item() == i32(0xFEDCBA98) == -19088744
    assert qzeros[0, 0].item() == 0x76543210
    c, z = gptq_unpack(qweight, qzeros)
    assert torch.equal(c, codes) and torch.equal(z, zeros.to(torch.int32))
    # Library decode: W = codes - z (scale 1).
    w = from_codes(c, torch.ones(1, 8), z.float(), 16).dequantize()
    assert w[0, 0:8].tolist() == list(range(-1, 7))
    assert w[1, 0:8].tolist() == list(range(6, 14))


def test_gptq_symmetric_zeros_word() -> None:
    _, qzeros = gptq_pack(torch.zeros(8, 8, dtype=torch.int32), torch.full((1, 8), 8))
    assert qzeros.item() == 0x77777777


def test_gptq_zero_point_zero_autogptq_word() -> None:
    # AutoGPTQ 0.7.1 wrote z = o % 8 as 0xFFFFFFFF (the -1 bled into every nibble); the
    # library and every nibble-wise decoder read all 8 zero-points as 0.
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    qzeros = torch.tensor([[i32(0xFFFFFFFF)]], dtype=torch.int32)
    _, z = gptq_unpack(qweight, qzeros)
    assert z.tolist() == [[0] * 8]


def test_gptq_zero_point_zero_gptqmodel_word() -> None:
    # GPTQModel subtracts 0x11111111 from the whole word: zero 0 borrows from nibble 1.
    word = (0x76543210 - 0x11111111) % 2**32
    assert word == 0x654320FF
    qzeros = torch.tensor([[i32(word)]], dtype=torch.int32)
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    _, z = gptq_unpack(qweight, qzeros, word_wise=True)
    assert z.tolist() == [list(range(8))]
    # Nibbles (LSB first) F F 0 2 3 4 5 6: the borrow ran through nibble 1 into nibble 2, so
    # a nibble-wise reading gets zero-points 1 and 2 wrong.
    _, z_nibble = gptq_unpack(qweight, qzeros)
    assert z_nibble.tolist() == [[0, 0, 1, 3, 4, 5, 6, 7]]


def test_gptq_zero_point_zero_our_writer() -> None:
    # Ours stores (0 - 1) & 15 = 0xF in its own nibble only.
    zeros = torch.arange(8).view(1, 8)
    _, qzeros = gptq_pack(torch.zeros(8, 8, dtype=torch.int32), zeros)
    assert qzeros.item() == 0x6543210F
    assert gptq_unpack(torch.zeros(1, 8, dtype=torch.int32), qzeros)[1].tolist() == [list(range(8))]


def test_awq_worked_example() -> None:
    # The spec's in = 2, gs = 2 example, padded to in = 8 (our layout packs 8 inputs a word).
    codes = torch.zeros(8, 32, dtype=torch.int32)
    codes[0, 0:8] = torch.arange(8)
    codes[1, 0:8] = torch.arange(15, 7, -1)
    zeros = torch.zeros(4, 32, dtype=torch.int32)
    zeros[0, 0:8] = torch.arange(1, 9)
    qweight, qzeros = awq_pack(codes, zeros)
    assert qweight[0, 0].item() == 0x75316420
    assert qweight[1, 0].item() == i32(0x8ACE9BDF)
    assert qzeros[0, 0].item() == i32(0x86427531)
    c, z = awq_unpack(qweight, qzeros)
    assert torch.equal(c, codes) and torch.equal(z, zeros)
    spec = QuantSpec(method="awq", group_size=2, sym=False)
    w = awq_to_int4(
        "l", {"qweight": qweight, "qzeros": qzeros, "scales": torch.ones(4, 32, dtype=torch.float16)},
        spec, 8, 32,
    ).dequantize()  # [out, in]
    assert w[0:8, 0].tolist() == [-1.0] * 8
    assert w[0:8, 1].tolist() == [14, 12, 10, 8, 6, 4, 2, 0]


def test_gguf_q4_blocks_by_hand() -> None:
    # One output row, 32 inputs. Q4_0: d = 0.5, byte j = (code of j) | (code of j+16) << 4.
    lo, hi = np.arange(16), 15 - np.arange(16)
    qs = (lo | (hi << 4)).astype(np.uint8)
    block0 = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    w = gguf_q4_to_int4("Q4_0", np.concatenate([block0, qs]), 1, 32).dequantize()
    expected = (np.concatenate([lo, hi]) - 8) * 0.5
    assert w[0].tolist() == expected.tolist()
    # Q4_1: d = 0.25, m = -1.0: w = q * d + m; and a flat block (d = 0) is all m.
    dm = np.frombuffer(np.array([0.25, -1.0], np.float16).tobytes(), np.uint8)
    flat = np.frombuffer(np.array([0.0, 3.0], np.float16).tobytes(), np.uint8)
    data = np.concatenate([dm, qs, flat, qs])
    w = gguf_q4_to_int4("Q4_1", data, 1, 64).dequantize()
    assert torch.allclose(w[0, :32], torch.tensor(np.concatenate([lo, hi]) * 0.25 - 1.0).float())
    assert w[0, 32:].tolist() == [3.0] * 32


@settings(max_examples=40, deadline=None)
@given(
    k_words=st.integers(1, 12),
    n_words=st.integers(1, 6),
    gs_words=st.sampled_from([1, 2, 4, 8, -1]),
    sym=st.booleans(),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trips(k_words: int, n_words: int, gs_words: int, sym: bool, act_order: bool, seed: int) -> None:
    k, n = 8 * k_words, 8 * n_words
    gs = k if gs_words == -1 else 8 * gs_words
    groups = -(-k // gs)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    zeros = torch.full((groups, n), 8) if sym else torch.randint(0, 16, (groups, n), generator=g)
    scales = torch.rand(groups, n, generator=g).half() + 0.01
    # nibble packing along either axis is exact
    assert torch.equal(unpack_nibbles(pack_nibbles(codes, 0), 0), codes)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes, 1), 1), codes)
    # GPTQ v1
    g_idx = torch.arange(k) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    qweight, qzeros = gptq_pack(codes, zeros)
    c, z = gptq_unpack(qweight, qzeros)
    assert torch.equal(c, codes) and torch.equal(z, zeros.to(torch.int32))
    spec = QuantSpec(method="gptq", group_size=-1 if gs_words == -1 else gs, sym=sym, desc_act=act_order)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.int()}
    w = gptq_to_int4("p", tensors, spec, k, n).dequantize(torch.float16)
    ref = ((codes - zeros[g_idx].to(torch.int32)).half() * scales[g_idx]).t()  # library decode
    assert torch.equal(w, ref)
    # AWQ GEMM (no act-order)
    if gs_words != -1 and k % gs == 0:
        qweight, qzeros = awq_pack(codes, zeros)
        c, z = awq_unpack(qweight, qzeros)
        assert torch.equal(c, codes) and torch.equal(z, zeros.to(torch.int32))


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="bits=8"):
        parse_quant_config({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ValueError, match="group_size=12"):
        parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 12})
    with pytest.raises(ValueError, match="version='gemv'"):
        parse_quant_config({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"})
    with pytest.raises(ValueError, match="quant_method='bitsandbytes'"):
        parse_quant_config({"quant_method": "bitsandbytes"})
    spec = parse_quant_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 64, "meta": {"quantizer": ["gptqmodel:7.7.0"]}}
    )
    assert spec.word_wise_zeros and spec.group_size == 64


def test_misshaped_tensor_error() -> None:
    spec = QuantSpec(method="gptq", group_size=64)
    tensors = {
        "qweight": torch.zeros(8, 32, dtype=torch.int32),
        "qzeros": torch.zeros(1, 4, dtype=torch.int32),
        "scales": torch.zeros(2, 32, dtype=torch.float16),
    }
    with pytest.raises(ValueError, match=r"'m.down_proj.scales': expected shape \(1, 32\)"):
        gptq_to_int4("m.down_proj", tensors, spec, 64, 32)
