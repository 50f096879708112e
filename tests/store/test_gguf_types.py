"""GGUF files mixing tensor types the way llama.cpp's presets do: each tensor takes its own
path (4-bit kept, others dequantized once), the load line says which, Q4_K matrices map onto
the 4-bit layout exactly, and a type localpaged cannot read is refused before any work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ggufmaker import HEADS, write_tiny_gguf

from localpaged.model.gguf_loader import (
    RawTensor,
    kept_4bit,
    open_gguf,
    q4_to_int4,
    unpermute_rotary,
)
from localpaged.quant import ggml_types
from localpaged.quant.layout import Int4Weight

P = "model.layers.0."
MIXED = {P + "self_attn.k_proj.weight": "Q5_0", P + "self_attn.v_proj.weight": "Q8_0",
         P + "mlp.down_proj.weight": "Q5_1", P + "mlp.up_proj.weight": "Q4_0"}  # rest Q4_1


def test_mixed_file_each_tensor_takes_its_path(tmp_path: Path) -> None:
    gguf = open_gguf(write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_1", types=MIXED))
    dense = dict(gguf.weights())
    for name, value in gguf.int4_weights():
        kind = MIXED.get(name, "Q4_1")
        if isinstance(value, Int4Weight):
            assert kind in ("Q4_0", "Q4_1"), name  # (the embedding is dequantized when installed)
            torch.testing.assert_close(value.dequantize(), dense[name], rtol=0, atol=1e-6)
        else:
            assert value.ndim == 1 or kind not in ("Q4_0", "Q4_1"), name
            assert torch.equal(value, dense[name]), name
    assert gguf.load_summary(torch.bfloat16) == (
        "weights: Q4_0 x 1, Q4_1 x 4 kept 4-bit (group 32); Q4_1 x 1, Q5_0 x 1, Q5_1 x 1, "
        "Q8_0 x 1 -> bfloat16")
    assert gguf.load_summary(torch.float32) == (
        "weights: Q4_0 x 1, Q4_1 x 5, Q5_0 x 1, Q5_1 x 1, Q8_0 x 1 -> float32")
    # float32 on the own CPU kernel: Q4_0 / Q4_1 stay 4-bit (it holds them exactly)
    assert gguf.load_summary(torch.float32, kept_4bit(torch.float32, True)) == (
        "weights: Q4_0 x 1, Q4_1 x 4 kept 4-bit (group 32); Q4_1 x 1, Q5_0 x 1, Q5_1 x 1, "
        "Q8_0 x 1 -> float32")


def test_mixed_file_loads_and_runs_in_both_dtypes(tmp_path: Path) -> None:
    from localpaged.model.loader import load_model
    from localpaged.quant.linear import QuantLinear

    path = write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_1", types=MIXED)
    load_model(path, dtype="float32")
    packed, _ = load_model(path, dtype="bfloat16")
    layer = packed.model.layers[0]
    from localpaged.quant import w6_linear

    assert isinstance(layer.self_attn.q_proj, QuantLinear)  # Q4_1: 4-bit
    sym = w6_linear.cpu_w6.available() and w6_linear.cpu_w4.quads_wanted(torch.bfloat16)
    up = layer.mlp.up_proj  # Q4_0: 4-bit, with symmetric groups where the quads layout serves
    assert isinstance(up, w6_linear.W6Linear if sym else QuantLinear)
    if sym:
        assert up.high is None and up.zero_point == 8
    want = dict(open_gguf(path).weights())[P + "mlp.down_proj.weight"]
    from localpaged.quant import cpu_w4, cpu_w6
    from localpaged.quant.q8_linear import Q8Linear
    from localpaged.quant.w6_linear import W6Linear

    if cpu_w4.int8_activations():  # Q5_1: 6-bit (x86) or int8 blocks, the file's values
        kind = W6Linear if cpu_w6.available() else Q8Linear
        assert isinstance(layer.mlp.down_proj, kind)
        assert torch.equal(layer.mlp.down_proj.blocks().dequantize(), want)
    else:  # dequantized once
        assert isinstance(layer.mlp.down_proj, torch.nn.Linear)
        assert layer.mlp.down_proj.weight.dtype == torch.bfloat16
        assert torch.equal(layer.mlp.down_proj.weight, want.to(torch.bfloat16))


def test_mixed_file_in_float32_keeps_the_other_types_as_int8_blocks(
        tmp_path: Path, cpu_variant: str) -> None:
    """Where float32 activations are int8 (AVX2 and up), Q8_0 matrices stay int8 blocks and
    Q5_0/Q5_1 ones 6-bit (int8 blocks on builds without the 6-bit loops), holding the file's
    values exactly (and keep their own form beside 4-bit ones in a fused q/k/v);
    elsewhere they are dequantized once, as before."""
    from localpaged.model.loader import load_model
    from localpaged.quant import cpu_w4, cpu_w6
    from localpaged.quant.joined_linear import JoinedLinear
    from localpaged.quant.q8_linear import Q8Linear
    from localpaged.quant.w6_linear import W6Linear

    path = write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_1", types=MIXED)
    model, _ = load_model(path, dtype="float32")
    gguf = open_gguf(path)
    dense = dict(gguf.weights())
    int8 = cpu_w4.int8_activations()
    down = model.model.layers[0].mlp.down_proj  # Q5_1
    six = int8 and cpu_w6.available()
    assert isinstance(down, W6Linear) == six and isinstance(down, Q8Linear) == (int8 and not six)
    if int8:
        torch.testing.assert_close(down.blocks().dequantize(),
                                   dense["model.layers.0.mlp.down_proj.weight"], rtol=0, atol=1e-6)
        summary = gguf.load_summary(torch.float32, kept_4bit(torch.float32, True, True), True)
        assert "Q8_0 x 1 as int8 blocks" in summary
        assert ("Q5_0 x 1, Q5_1 x 1 kept 6-bit" in summary) == six, summary
        # q (Q4_1, 4-bit), k (Q5_0), v (Q8_0) join side by side, each in its own form: v's
        # int8 blocks hold the file's values, rows unpermuted
        model.fuse_projections()
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, JoinedLinear) and isinstance(qkv.parts[2], Q8Linear)
        v = qkv.parts[2]
        got = cpu_w4.dequantize_q8(v.tiles, v.tile_scales, v.tile_offsets)
        torch.testing.assert_close(got, dense[f"{P}self_attn.v_proj.weight"], rtol=0, atol=1e-6)


def _q4_k_bytes(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks with sane f16 d / dmin (random bytes make NaN/inf ones)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        blocks[:, at:at + 2] = rng.uniform(0, 1e-3, blocks.shape[0]).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def test_q4_k_matrix_maps_onto_int4_exactly() -> None:
    """A Q4_K attn_q matrix as Int4Weight: the file's values, q/k permutation undone."""
    n, k = 64, 512
    data = _q4_k_bytes(n, k, seed=5)
    raw = RawTensor("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", "Q4_K",
                    (n, k), data)
    w = q4_to_int4(raw, HEADS)
    assert w.group_size == 32 and (w.out_features, w.in_features) == (n, k)
    want = unpermute_rotary(ggml_types.dequantize("Q4_K", data, (n, k)), HEADS)
    torch.testing.assert_close(w.dequantize(), torch.from_numpy(want), rtol=0,
                               atol=2e-6 * float(np.abs(want).max()))


def _file_with(path: Path, type_name: str) -> Path:
    """A tiny llama GGUF whose ffn_down is replaced by a `[64, 256]` tensor of `type_name`
    (raw bytes: the reader must refuse it before reading them)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_feed_forward_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((64, 256 // block * size), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "IQ3_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"])
def test_unknown_type_is_refused_before_any_work(tmp_path: Path, type_name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from localpaged.model import loader

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(loader, "build_model", no_build)
    path = _file_with(tmp_path / f"{type_name}.gguf", type_name)
    for dtype in ("float32", "auto"):
        with pytest.raises(ValueError) as err:
            loader.load_model(path, dtype=dtype)
        msg = str(err.value)
        assert f"tensor blk.0.ffn_down.weight has GGML type {type_name}" in msg
        assert str(path) in msg and "use another quantization of this model, e.g. Q4_K_M" in msg


def test_type_id_unknown_to_this_package_is_refused(tmp_path: Path) -> None:
    """A type newer than this package's table (id 99 here) is not called corrupt."""
    import struct

    path = write_tiny_gguf(tmp_path / "new-type.gguf", "Q8_0")
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name)  # then: n_dims u32, dims u64 x n_dims, type u32
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"blk.0.ffn_down.weight has GGML type 99, unknown to "
                                         r"this localpaged; use another quantization of this "
                                         r"model, e.g. Q4_K_M"):
        open_gguf(path)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_4bit_token_embedding_stays_4bit(tmp_path: Path, dtype: torch.dtype, tie: bool) -> None:
    """A Q4_0 token embedding is held once in its bits on the own CPU kernel (and is the
    output layer when tied): its rows are the file's values, and the logits those of the
    same file loaded with torch's ops only (the embedding then dense). Where the layers take
    the quads layout it keeps symmetric groups (`W6Embedding`), else it is a 4-bit layer's."""
    from localpaged.model.loader import load_model
    from localpaged.quant import cpu_w4, w6_linear
    from localpaged.quant.linear import QuantEmbedding
    from localpaged.quant.q8_linear import TileEmbedding

    if not cpu_w4.available():
        pytest.skip("the CPU kernels do not build here")
    path = write_tiny_gguf(tmp_path / "q4.gguf", "Q4_0", tie=tie)
    model, _ = load_model(path, dtype=dtype)
    emb = model.model.embed_tokens
    sym = w6_linear.cpu_w6.available() and cpu_w4.quads_wanted(dtype)
    assert isinstance(emb, w6_linear.W6Embedding if sym else QuantEmbedding)
    assert isinstance(emb, (QuantEmbedding, TileEmbedding))
    assert (model.lm_head is emb.table) == tie
    from localpaged.model.loader import gguf_int8, gguf_kept_types

    cpu = torch.device("cpu")
    summary = open_gguf(path).load_summary(dtype, gguf_kept_types(dtype, cpu), gguf_int8(dtype, cpu))
    if gguf_int8(dtype, cpu):  # the load line counts the embedding among the 4-bit matrices
        assert summary.startswith("weights: Q4_0 x") and "->" not in summary, summary
    want = dict(open_gguf(path).weights())["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5, 17, 5], [31, 2, 16, 40]])
    assert torch.equal(emb(ids).float(), want[ids].to(dtype).float())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALPAGED_CPU_KERNELS", "off")
        dense, _ = load_model(path, dtype=torch.float32)
    assert not isinstance(dense.model.embed_tokens, (QuantEmbedding, TileEmbedding))
    hidden = emb(ids[0])
    got = model.compute_logits(hidden.to(dtype)).float()
    ref = dense.compute_logits(hidden.float())
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()


IQ4_MIXED = {P + "self_attn.v_proj.weight": "Q5_0"}  # the rest IQ4_NL (an IQ4_XS preset's mix)


def test_an_iq4_nl_file_keeps_its_code_book(tmp_path: Path, cpu_variant: str) -> None:
    """IQ4_NL matrices stay in their 4-bit codes and scales where the quads layout serves
    (every x86 build from AVX2 on), the tied embedding too (then also the output layer): the
    file's values exactly, the load line counts them among the 4-bit matrices, a q/k/v mixing
    IQ4_NL with Q5_0 joins them each in its own form, and the logits are those of
    the same file on torch's ops (dense float32 weights) within the int8 activations' rounding.
    Elsewhere they are int8 blocks, or dequantized once."""
    from localpaged.model.loader import gguf_int8, gguf_kept_types, load_model
    from localpaged.quant import cpu_w6
    from localpaged.quant.joined_linear import JoinedLinear
    from localpaged.quant.w6_linear import W6Embedding, W6Linear

    path = write_tiny_gguf(tmp_path / "iq4nl.gguf", "IQ4_NL", tie=True, types=IQ4_MIXED)
    gguf = open_gguf(path)
    dense = dict(gguf.weights())
    model, _ = load_model(path, dtype="float32")
    layer = model.model.layers[0]
    cpu = torch.device("cpu")
    summary = gguf.load_summary(torch.float32, gguf_kept_types(torch.float32, cpu),
                                gguf_int8(torch.float32, cpu))
    if not cpu_w6.available():
        assert not any(isinstance(m, W6Linear) for m in model.modules())
        assert "IQ4_NL" in summary and "kept 4-bit" not in summary, summary
        return
    assert summary == "weights: IQ4_NL x 7 kept 4-bit (group 32); Q5_0 x 1 kept 6-bit", summary
    assert isinstance(model.model.embed_tokens, W6Embedding) and model.lm_head is model.model.embed_tokens.table
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        got = layer.get_submodule(name)
        assert isinstance(got, W6Linear) and got.zero_point == cpu_w6.NL, name
        assert torch.equal(got.dequantize(), dense[f"{P}{name}.weight"]), name
    ids = torch.tensor([0, 7, 63, 7])
    assert torch.equal(model.model.embed_tokens(ids), dense["model.embed_tokens.weight"][ids])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALPAGED_CPU_KERNELS", "off")
        ref, _ = load_model(path, dtype="float32")
    x = torch.randn(5, 64)
    want = ref.compute_logits(x)
    assert (model.compute_logits(x) - want).abs().max() <= 0.02 * want.abs().max()
    model.fuse_projections()
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, JoinedLinear)  # IQ4_NL q and k with a Q5_0 v: each its own form
    for x, part in zip("qkv", qkv.parts, strict=True):
        assert torch.equal(part.dequantize(), dense[f"{P}self_attn.{x}_proj.weight"]), x
    assert qkv.parts[0].zero_point == cpu_w6.NL and qkv.parts[2].high is not None
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, W6Linear) and gate_up.zero_point == cpu_w6.NL
