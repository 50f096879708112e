"""Loading GPTQ files the way other writers make them: AutoGPTQ's all-zero `.bias` tensors,
GPTQModel's word-wise zero-points, and bad files (missing / mis-shaped tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from localpaged.model.loader import load_model
from localpaged.quant.awq import awq_quantize
from localpaged.quant.layout import _to_int32
from localpaged.quant.writer import save_quantized

# The checkpoints' numbers reach the model exactly: held to float32 on the plain build.
pytestmark = pytest.mark.usefixtures("exact_float32")

PREFIX = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def gptq_dir(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama, round-to-nearest asym g32, written as a GPTQ v1 checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    layers = {f"model.layers.{n}": awq_quantize(m.weight.data, 32)
              for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    return save_quantized(model, layers, tmp_path_factory.mktemp("gptq"), "gptq", 32, sym=False)


def _variant(src: Path, dst: Path, edit, config_edit=None) -> Path:
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _weight(folder: Path) -> torch.Tensor:
    model, _ = load_model(folder, dtype="float32")  # fp32 layers keep the internal layout
    return model.get_submodule(PREFIX).int4_weight().dequantize()


def test_autogptq_zero_biases_are_accepted(gptq_dir: Path, tmp_path: Path) -> None:
    def add_biases(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.endswith(".qweight")]:
            t[name.replace(".qweight", ".bias")] = torch.zeros(t[name].shape[1], dtype=torch.float16)

    folder = _variant(gptq_dir, tmp_path / "bias", add_biases)
    torch.testing.assert_close(_weight(folder), _weight(gptq_dir), rtol=0, atol=0)

    def nonzero_bias(t: dict[str, torch.Tensor]) -> None:
        t[f"{PREFIX}.bias"] = torch.ones(64, dtype=torch.float16)

    bad = _variant(gptq_dir, tmp_path / "bad", nonzero_bias)
    with pytest.raises(ValueError, match=f"'{PREFIX}.bias' is non-zero"):
        load_model(bad)


def test_gptqmodel_word_wise_zeros(gptq_dir: Path, tmp_path: Path) -> None:
    """The same zero-points, written GPTQModel's way (pack(z) - 0x11111111 per word)."""
    def to_word_wise(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.endswith(".qzeros")]:
            nib = torch.stack([(t[name] >> (4 * j)) & 0xF for j in range(8)], -1).long()
            zeros = (nib + 1) & 0xF  # what the nibble-wise file means
            packed = (zeros << (4 * torch.arange(8))).sum(-1)
            t[name] = _to_int32((packed - 0x11111111) % 2**32)

    def mark(cfg: dict) -> None:
        cfg["meta"] = {"quantizer": ["gptqmodel:7.7.0"]}

    folder = _variant(gptq_dir, tmp_path / "gm", to_word_wise, mark)
    torch.testing.assert_close(_weight(folder), _weight(gptq_dir), rtol=0, atol=0)


def test_missing_and_misshaped_tensors(gptq_dir: Path, tmp_path: Path) -> None:
    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[f"{PREFIX}.qzeros"]

    with pytest.raises(ValueError, match=rf"'{PREFIX}.qzeros' is missing: expected shape \(4, 8\)"):
        load_model(_variant(gptq_dir, tmp_path / "drop", drop))

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[f"{PREFIX}.scales"] = t[f"{PREFIX}.scales"][:2]

    with pytest.raises(ValueError, match=rf"'{PREFIX}.scales': expected shape \(4, 64\), found \(2, 64\)"):
        load_model(_variant(gptq_dir, tmp_path / "shape", reshape))

    def bits(cfg: dict) -> None:
        cfg["bits"] = 3

    with pytest.raises(ValueError, match=r"quantization_config\.bits=3"):
        load_model(_variant(gptq_dir, tmp_path / "bits", lambda t: None, bits))


def test_missing_bias_of_a_biased_layer(tiny_qwen2: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    layers = {f"model.layers.{n}": awq_quantize(m.weight.data, 32)
              for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    src = save_quantized(model, layers, tmp_path / "q", "awq", 32)
    name = "model.layers.0.self_attn.q_proj.bias"
    load_model(src)  # complete: loads

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[name]

    with pytest.raises(ValueError, match=rf"'{name}' is missing: expected shape \(64,\)"):
        load_model(_variant(src, tmp_path / "nobias", drop))

