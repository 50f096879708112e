"""ModelConfig (both config.json styles), rope tables vs transformers, checkpoint loading:
sharded, bf16, llama3/yarn rope scaling, and the errors for bad checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from localpaged.kernels import cpu_isa
from localpaged.model.config import ModelConfig
from localpaged.model.loader import (
    build_model,
    cpu_compute_dtype,
    iter_safetensors,
    load_model,
    safetensors_files,
)
from localpaged.model.rope import build_cos_sin

BLOCK = 8


def _v4_style(cfg: dict) -> dict:
    """A transformers-4 config.json from a transformers-5 one."""
    out = dict(cfg)
    rope = dict(out.pop("rope_parameters"))
    out["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        rope["type"] = rope.pop("rope_type")  # the oldest spelling
        out["rope_scaling"] = rope
    else:
        out["rope_scaling"] = None
    out["torch_dtype"] = out.pop("dtype")
    return out


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _hf_config(rope: dict | None = None, **kw) -> LlamaConfig:
    params = {"rope_theta": 500000.0, **(rope or {"rope_type": "default"})}
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                       max_position_embeddings=256, rope_parameters=params, **kw)


def _save(cfg: LlamaConfig, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(path)
    return path


def _logits(model, ids: list[int], step_builder) -> torch.Tensor:
    n_blocks = -(-len(ids) // BLOCK)
    caches = model.allocate_kv_caches(n_blocks + 1, BLOCK, dtype=model.dtype)
    positions, meta = step_builder([(list(range(n_blocks, 0, -1)), 0, len(ids))], BLOCK)
    return model.compute_logits(model(torch.tensor(ids), positions, caches, meta))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_config_styles_agree(fixture: str, request: pytest.FixtureRequest) -> None:
    raw = json.loads((request.getfixturevalue(fixture) / "config.json").read_text())
    assert "rope_parameters" in raw  # saved by transformers 5
    v5, v4 = ModelConfig.from_dict(raw), ModelConfig.from_dict(_v4_style(raw))
    assert v5 == v4
    assert v5.qkv_bias == (fixture == "tiny_qwen2")
    assert (v5.num_heads, v5.num_kv_heads, v5.head_dim, v5.eos_token_ids) == (4, 2, 16, (2,))


def test_config_rope_scaling_styles_agree() -> None:
    raw = _hf_config(LLAMA3).to_dict()
    v5, v4 = ModelConfig.from_dict(raw), ModelConfig.from_dict(_v4_style(raw))
    assert v5 == v4
    assert v5.rope_theta == 500000.0
    assert v5.rope_scaling == LLAMA3


def test_config_sliding_window() -> None:
    base = _hf_config().to_dict()
    mistral = base | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict(mistral).sliding_window == 4096
    qwen = base | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict(qwen).sliding_window is None  # use_sliding_window is off
    assert ModelConfig.from_dict(qwen | {"use_sliding_window": True}).sliding_window == 4096


def test_config_rejects_other_architectures() -> None:
    raw = _hf_config().to_dict() | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    LLAMA3,
    YARN,
    YARN | {"beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
])
def test_rope_table_matches_hf(rope: dict | None) -> None:
    hf_cfg = _hf_config(rope)
    ours = build_cos_sin(ModelConfig.from_dict(hf_cfg.to_dict() | {
        "architectures": ["LlamaForCausalLM"]}))
    n, half = hf_cfg.max_position_embeddings, 8
    x = torch.zeros(1, n, 16)
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, torch.arange(n)[None])
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rope", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_scaled_rope_model_matches_hf(rope: dict, tmp_path: Path, step_builder, hf_logits) -> None:
    folder = _save(_hf_config(rope, tie_word_embeddings=True), tmp_path / "m")
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    model, config = load_model(folder)
    assert config.rope_scaling["rope_type"] == rope["rope_type"] and config.tie_word_embeddings
    torch.testing.assert_close(_logits(model, ids, step_builder), hf_logits(folder, ids),
                               atol=1e-5, rtol=0)


def test_sharded_checkpoint(tiny_llama: Path, tmp_path: Path, step_builder) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(safetensors_files(tmp_path)) > 1
    ids = list(range(5, 30))
    sharded, _ = load_model(tmp_path)
    single, _ = load_model(tiny_llama)
    torch.testing.assert_close(_logits(sharded, ids, step_builder),
                               _logits(single, ids, step_builder), atol=0, rtol=0)


@pytest.mark.parametrize("ckpt_dtype", [torch.bfloat16, torch.float16])
def test_16bit_checkpoint(ckpt_dtype: torch.dtype, tmp_path: Path, step_builder,
                          hf_logits) -> None:
    folder = _save(_hf_config(), tmp_path / "m", ckpt_dtype)
    ids = list(range(3, 40))
    auto, config = load_model(folder)  # CPU "auto": bf16 where the CPU has it, else float32
    assert config.torch_dtype == str(ckpt_dtype).removeprefix("torch.")
    assert auto.dtype == cpu_compute_dtype()[0]
    assert auto.model.layers[0].mlp.up_proj.weight.dtype == auto.dtype
    fp32, _ = load_model(folder, dtype="float32")
    ref = hf_logits(folder, ids)  # HF upcasts the 16-bit weights to fp32
    torch.testing.assert_close(_logits(fp32, ids, step_builder), ref, atol=1e-5, rtol=0)
    got = _logits(load_model(folder, dtype="bfloat16")[0], ids, step_builder)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize(("isa", "dtype"), [
    ("generic", torch.float32), ("avx2", torch.float32), ("avx2vnni", torch.float32),
    ("avx512", torch.float32), ("avx512vnni", torch.float32),
    ("avx512bf16", torch.bfloat16), ("amx", torch.bfloat16)])
def test_auto_computes_in_bf16_only_where_the_cpu_has_it(
        isa: str, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if isa not in cpu_isa.supported():
        pytest.skip(f"this CPU cannot execute the {isa} build")
    monkeypatch.setenv(cpu_isa.ENV, isa)
    assert cpu_compute_dtype()[0] == dtype
    folder = _save(_hf_config(), tmp_path / "m", torch.bfloat16)
    assert load_model(folder)[0].dtype == dtype
    assert load_model(folder, dtype="bfloat16")[0].dtype == torch.bfloat16  # asked: wins
    fp32 = _save(_hf_config(), tmp_path / "f", torch.float32)
    assert load_model(fp32)[0].dtype == torch.float32  # a float32 checkpoint stays float32


def test_bad_tensors_are_named(tiny_llama: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    weights = dict(iter_safetensors(safetensors_files(tiny_llama)))
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = weights | {name: weights[name][:16]}
    with pytest.raises(ValueError, match=r"k_proj.*expected shape \(32, 64\), found \(16, 64\)"):
        build_model(config, bad.items())
    missing = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(ValueError, match=r"k_proj.weight.*missing.*\(32, 64\)"):
        build_model(config, missing.items())

