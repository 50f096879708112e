"""`localpaged quantize` end to end on a tiny Llama with a small trained tokenizer, and its
refusals (unsupported group size, too little calibration text)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from localpaged.model.loader import load_model
from localpaged.quant.commands import check_group_size, quantize


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from localpaged.quant.commands import default_calibration_text

    folder = tmp_path_factory.mktemp("tiny-tok")
    for f in tiny_llama.iterdir():
        shutil.copy(f, folder / f.name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([default_calibration_text()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


def _args(model: Path, method: str, gs: int, output: Path, calib: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(model=str(model), method=method, group_size=gs,
                              calib=str(calib) if calib else None, output=str(output))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_command(method: str, tiny_with_tokenizer: Path, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from localpaged.quant.commands import default_calibration_text

    out, calib = tmp_path / "q", tmp_path / "calib.txt"
    calib.write_text(default_calibration_text()[:6000])  # a few samples keep the test fast
    assert quantize(_args(tiny_with_tokenizer, method, 32, out, calib)) == 0
    err = capsys.readouterr().err
    assert "layer 2/2 quantized" in err
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == method and cfg["group_size"] == 32
    assert (out / "tokenizer.json").exists()
    model, _ = load_model(out, dtype="bf16")
    assert model.model.layers[0].mlp.down_proj.__class__.__name__ == "QuantLinear"
    assert model.dtype == torch.bfloat16


def test_refusals(tiny_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Too short to calibrate on.")
    assert quantize(_args(tiny_with_tokenizer, "gptq", 32, tmp_path / "a", short)) == 2
    assert "too little calibration data" in capsys.readouterr().err
    assert quantize(_args(tiny_with_tokenizer, "awq", 48, tmp_path / "b")) == 2
    assert "--group-size 48: supported for awq are 32, 64, 128" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"in_features 576, not a multiple of it \(AWQ\); try 32, 64"):
        check_group_size("awq", 128, {"mlp.gate_proj": 576})
