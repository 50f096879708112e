"""benchmarks/synthetic.py: tiny random-weight GGUFs in each type the `gguf` package writes
load in localpaged and read back the values written; one with SmolLM2's tokenizer generates
through the engine."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import synthetic  # noqa: E402

STAND_IN_VOCAB = 512  # a placeholder tokenizer: the file opens in milliseconds


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (what localpaged undoes for llama files)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_values(shape_name: str, spec: synthetic.TensorSpec, qtype: str) -> np.ndarray:
    """The seeded float32 values through the type's own rounding (`gguf.quants`)."""
    import gguf
    from gguf.quants import dequantize, quantize

    values = synthetic.float_values(shape_name, spec)
    kind = gguf.GGMLQuantizationType[synthetic.stored_type(spec, qtype)]
    if kind == gguf.GGMLQuantizationType.F32:
        return values
    if kind == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16).astype(np.float32)
    return dequantize(quantize(values, kind), kind)


def test_named_shapes_have_the_real_trunks() -> None:
    """SmolLM2-1.7B has SmolLM2's vocabulary, so its count is the real model's."""
    assert synthetic.parameter_count(synthetic.SHAPES["smollm2:1.7b"]) == 1_711_376_384
    qwen = synthetic.tensor_specs(synthetic.SHAPES["qwen2.5:7b"])
    assert qwen[-1].name == "output.weight" and "blk.0.attn_q.bias" in {s.name for s in qwen}
    assert synthetic.SHAPES["llama3.2:3b"].head_dim == 128


@pytest.mark.parametrize(("shape_name", "qtype"),
                         [("tiny", t) for t in synthetic.GGUF_TYPES] + [("tiny-qwen2", "Q8_0"),
                                                                         ("tiny-qwen3", "Q8_0"),
                                                                         ("tiny-qwen3moe", "Q8_0")])
def test_tiny_file_loads_and_reads_back(tmp_path: Path, shape_name: str, qtype: str) -> None:
    import gguf
    from gguf.quants import dequantize

    from localpaged.model.gguf_loader import hf_tensor_name, open_gguf
    from localpaged.model.loader import load_model

    shape = synthetic.SHAPES[shape_name]
    path = synthetic.write_gguf(shape_name, qtype, tmp_path / "m.gguf", None,
                                vocab=STAND_IN_VOCAB, log=False)
    specs = synthetic.tensor_specs(shape, STAND_IN_VOCAB)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert list(stored) == [s.name for s in specs]
    f = open_gguf(path)
    config = f.hf_config()
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, STAND_IN_VOCAB)
    assert config["tie_word_embeddings"] == shape.tied
    assert config["attention_bias"] == shape.qkv_bias
    assert config["rope_theta"] == shape.rope_theta
    assert config["head_dim"] == shape.head_dim
    read = dict(f.weights())
    for spec in specs:
        t = stored[spec.name]
        assert t.tensor_type.name == synthetic.stored_type(spec, qtype)
        in_file = dequantize(t.data, t.tensor_type).reshape(spec.shape)
        np.testing.assert_array_equal(in_file, expected_values(shape_name, spec, qtype))
        if len(spec.shape) == 3:  # a MoE layer's experts: one HF tensor each
            layer, part = spec.name.split(".")[1:3]
            proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                    "ffn_down_exps": "down_proj"}[part]
            for e in range(spec.shape[0]):
                got = read[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].numpy()
                np.testing.assert_array_equal(got, in_file[e], err_msg=f"{spec.name}[{e}]")
            continue
        got = read[hf_tensor_name(spec.name)].numpy()
        if shape.arch == "llama" and ".attn_q." in spec.name:
            got = llama_cpp_permute(got, shape.heads)
        elif shape.arch == "llama" and ".attn_k." in spec.name:
            got = llama_cpp_permute(got, shape.kv_heads)
        np.testing.assert_array_equal(got, in_file, err_msg=spec.name)
    _, loaded = load_model(path, dtype="float32")  # builds the model: every tensor fits
    assert loaded.num_layers == shape.layers and loaded.tie_word_embeddings == shape.tied


@pytest.mark.smollm
@pytest.mark.slow
def test_generates_with_smollm_tokenizer(tmp_path: Path, smollm_gguf: Path) -> None:
    """A tiny Qwen2-shaped file (biases, untied head) with SmolLM2's whole tokenizer runs
    through the engine and decodes text."""
    from localpaged import LLM, SamplingParams

    path = synthetic.synthetic_gguf("tiny-qwen2", "Q4_0", tmp_path, tokenizer=smollm_gguf, log=False)
    assert path.name == "tiny-qwen2.Q4_0.gguf"
    assert synthetic.synthetic_gguf("tiny-qwen2", "Q4_0", tmp_path, log=False) == path  # cached
    llm = LLM(str(path))
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text


@pytest.mark.parametrize("fmt", synthetic.QUANT_FORMATS)
def test_quantized_folders_load(tmp_path: Path, fmt: str) -> None:
    """The AWQ / GPTQ (act-order too) folders of a tiny Qwen2 shape load as 4-bit layers
    (act-order with its channel order) and answer."""
    from localpaged import LLM, SamplingParams
    from localpaged.model.loader import load_model

    folder = synthetic.write_quantized("tiny-qwen2", fmt, tmp_path / fmt, group_size=32,
                                       vocab=STAND_IN_VOCAB, log=False)
    model, config = load_model(folder, dtype="float32")
    assert config.quantization_config["quant_method"] == fmt.removesuffix("-actorder")
    proj = model.model.layers[1].mlp.down_proj
    assert type(proj).__name__ == "QuantLinear"
    assert (proj.perm is not None) == fmt.endswith("-actorder")
    out = LLM(str(folder), dtype="float32").generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
