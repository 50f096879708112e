"""Tiny random Llama / Qwen2 quantized by our GPTQ and AWQ, written in AutoGPTQ / AutoAWQ
format, loaded by the model room's loader: its logits equal those of transformers running
the same checkpoint dequantized (by an independent decoder written here) in float32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from localpaged.kernels import AttentionMetadata
from localpaged.model.loader import load_model
from localpaged.quant.calibrate import calibration_ids, quantize_model
from localpaged.quant.linear import QuantLinear
from localpaged.quant.writer import save_quantized

VARIANTS = {
    "gptq-sym": dict(method="gptq", sym=True, act_order=False),
    "gptq-asym-actorder": dict(method="gptq", sym=False, act_order=True),
    "awq": dict(method="awq", sym=False, act_order=False),
}
GS = 32


def _nibbles(words: np.ndarray, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Reference unpack straight from the spec: nibble k = bits 4k..4k+3 (LSB first)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    parts = [(u >> (4 * k)) & 0xF for k in range(8)]
    if order is not None:  # AWQ: column 8c + order[k] sits in nibble k
        placed = [None] * 8
        for k, col in enumerate(order):
            placed[col] = parts[k]
        parts = placed
    return np.stack(parts, axis=axis + 1).reshape(
        *((*words.shape[:axis], words.shape[axis] * 8, *words.shape[axis + 1:]))
    )


def reference_state(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as float32 dense weights, decoded independently of localpaged.quant."""
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    raw = load_file(str(folder / "model.safetensors"))
    state = {}
    for name, t in raw.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("qzeros", "scales", "g_idx") or (leaf == "bias" and f"{prefix}.qweight" in raw):
            continue
        if leaf != "qweight":
            state[name] = t.float()
            continue
        scales = raw[f"{prefix}.scales"].numpy().astype(np.float32)
        if cfg["quant_method"] == "gptq":
            q = _nibbles(t.numpy(), 0)  # [K, N]
            z = (_nibbles(raw[f"{prefix}.qzeros"].numpy(), 1) + 1) & 0xF
            g = raw[f"{prefix}.g_idx"].numpy()
        else:
            order = [0, 2, 4, 6, 1, 3, 5, 7]
            q = _nibbles(t.numpy(), 1, order)
            z = _nibbles(raw[f"{prefix}.qzeros"].numpy(), 1, order)
            g = np.arange(q.shape[0]) // cfg["group_size"]
        w = (q - z[g]).astype(np.float32) * scales[g]
        state[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(w.T))
        if f"{prefix}.bias" in raw:
            state[f"{prefix}.bias"] = raw[f"{prefix}.bias"].float()
    return state


def hf_reference_logits(src: Path, folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(reference_state(folder), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def our_logits(folder: Path, ids: list[int], dtype: str = "float32") -> torch.Tensor:
    model, _ = load_model(folder, dtype=dtype)
    n, block = len(ids), 16
    caches = model.allocate_kv_caches(num_blocks=-(-n // block), block_size=block)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(-(-n // block)).view(1, -1).int(),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n,
    )
    hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    return model.compute_logits(hidden)


@pytest.fixture(scope="module", params=[("tiny_llama", v) for v in VARIANTS]
                + [("tiny_qwen2", "awq"), ("tiny_qwen3", "awq"), ("tiny_qwen3", "gptq-asym-actorder")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    src = request.getfixturevalue(request.param[0])
    variant = VARIANTS[request.param[1]]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = calibration_ids(torch.randint(3, 512, (256,), generator=g).tolist(), 64)
    layers = quantize_model(model, ids, variant["method"], GS, sym=variant["sym"],
                            act_order=variant["act_order"], progress=lambda _m: None)
    out = save_quantized(model, layers, tmp_path_factory.mktemp("q"), variant["method"], GS,
                         sym=variant["sym"], act_order=variant["act_order"])
    return src, out, variant


@pytest.mark.usefixtures("exact_float32")
def test_logits_match_dequantized_fp32(quantized) -> None:
    src, out, _ = quantized
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_reference_logits(src, out, ids)
    ours = our_logits(out, ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_bf16_fast_path_close(quantized) -> None:
    src, out, _ = quantized
    ids = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_reference_logits(src, out, ids)
    ours = our_logits(out, ids, "bf16")
    err = (ours - ref).norm() / ref.norm()
    assert err < 0.03, err


def test_checkpoint_layout(quantized) -> None:
    _, out, variant = quantized
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    raw = load_file(str(out / "model.safetensors"))
    assert cfg["quant_method"] == variant["method"] and cfg["bits"] == 4 and cfg["group_size"] == GS
    down = raw["model.layers.0.mlp.down_proj.qweight"]  # in 128, out 64
    if variant["method"] == "gptq":
        assert (out / "quantize_config.json").exists()
        assert down.shape == (16, 64) and raw["model.layers.0.mlp.down_proj.qzeros"].shape == (4, 8)
        g_idx = raw["model.layers.0.mlp.down_proj.g_idx"]
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((4,), GS))
        monotone = torch.equal(g_idx.long(), torch.arange(128) // GS)
        assert monotone != variant["act_order"]
        qzeros = raw["model.layers.0.mlp.down_proj.qzeros"]
        if variant["sym"]:
            assert (qzeros == 0x77777777).all()
        else:  # no stored nibble 0xF: nibble-wise and word-wise readers agree (§1.9)
            nibbles = torch.stack([(qzeros >> (4 * j)) & 0xF for j in range(8)])
            assert (nibbles != 0xF).all()
    else:
        assert cfg["version"] == "gemm" and down.shape == (128, 8)
        assert "model.layers.0.mlp.down_proj.g_idx" not in raw
    assert "model.layers.0.mlp.down_proj.weight" not in raw


def test_too_little_calibration() -> None:
    with pytest.raises(ValueError, match="need at least 256 tokens"):
        calibration_ids(list(range(200)), 64)
