"""Write small Llama-architecture GGUF files the way llama.cpp's converter does (q/k rows
permuted for its rotary layout, 2-D weights quantized), for the reader's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, FF, VOCAB, LAYERS = 64, 4, 2, 128, 64, 1
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute()` for attn_q / attn_k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a 1-layer GQA Llama."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "self_attn.q_proj.weight": r(HEADS * head_dim, HIDDEN),
        p + "self_attn.k_proj.weight": r(KV_HEADS * head_dim, HIDDEN),
        p + "self_attn.v_proj.weight": r(KV_HEADS * head_dim, HIDDEN),
        p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * head_dim),
        p + "post_attention_layernorm.weight": r(HIDDEN),
        p + "mlp.gate_proj.weight": r(FF, HIDDEN),
        p + "mlp.up_proj.weight": r(FF, HIDDEN),
        p + "mlp.down_proj.weight": r(HIDDEN, FF),
        "model.norm.weight": r(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
    }


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def quantize_iq4_nl(value: np.ndarray) -> np.ndarray:
    """`value` [N, K] as IQ4_NL blocks (the `gguf` package has no quantizer for it): per 32
    values a float16 d (the value of largest magnitude over -127) and the nearest entry of the
    code book per value, nibbles as Q4_0 lays them out."""
    n, k = value.shape
    x = value.reshape(-1, 32).astype(np.float32)
    peak = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    d = (peak / -127).astype(np.float16)
    safe = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    q = np.abs((x / safe)[:, :, None] - IQ4_NL_VALUES).argmin(axis=2).astype(np.uint8)
    blocks = np.concatenate([d[:, None].view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return blocks.reshape(n, k // 32 * 18)


def gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def write_tiny_gguf(path: Path, qtype: str = "Q8_0", weights: dict[str, np.ndarray] | None = None,
                    tie: bool = False, rope_freqs: np.ndarray | None = None,
                    types: dict[str, str] | None = None) -> Path:
    """A 1-layer Llama GGUF whose 2-D weights are stored as `qtype` (F32, F16, Q8_0, Q4_0...),
    or as `types[hf_name]` for the ones named there (a mixed file, as llama.cpp's presets)."""
    import gguf
    from gguf.quants import quantize

    weights = weights if weights is not None else tiny_hf_weights()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for hf, value in weights.items():
        if tie and hf == "lm_head.weight":
            continue
        name = (types or {}).get(hf, qtype)
        kind = gguf.GGMLQuantizationType[name]
        if "q_proj" in hf:
            value = llama_cpp_permute(value, HEADS)
        elif "k_proj" in hf:
            value = llama_cpp_permute(value, KV_HEADS)
        if value.ndim == 2 and name != "F32":
            if name == "F16":
                w.add_tensor(gguf_name(hf), value.astype(np.float16))
            elif name == "IQ4_NL":
                w.add_tensor(gguf_name(hf), quantize_iq4_nl(value), raw_dtype=kind)
            else:
                w.add_tensor(gguf_name(hf), quantize(value, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(hf), value)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
