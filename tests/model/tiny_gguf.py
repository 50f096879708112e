"""The tiny test models written as GGUF files as llama.cpp's converter lays them out: a small
real byte-level BPE vocabulary, the family's metadata, HF tensors under llama.cpp's names,
matrices in one GGML type. Each family's test names its tensors and adds its own keys."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from localpaged.model.config import ModelConfig

if TYPE_CHECKING:
    from gguf import GGUFWriter


def byte_level_bpe(size: int) -> tuple[list[str], list[str]]:
    """The tokens (`size` of them) and merges of a small byte-level BPE trained here, as a
    GGUF's tokenizer metadata holds them (the model's vocabulary size, a working tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Paris!"] * 8, trainer)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens += [f"<extra{i}>" for i in range(size - len(tokens))]
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in merges]


def gguf_writer(path: Path, arch: str, cfg: ModelConfig, *, head_dim_keys: bool = True,
                pre: str | None = "qwen2",
                vocabulary: tuple[list[str], list[str]] | None = None) -> GGUFWriter:
    """A writer of an `arch` GGUF with `cfg`'s trunk metadata (head_dim_keys: the key and value
    lengths, where head_dim is not hidden / heads) and a tokenizer (bos 1, eos 2)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    if head_dim_keys:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens, merges = vocabulary or byte_level_bpe(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def llama_cpp_name(hf: str, layer_names: dict[str, str], top_names: dict[str, str]) -> str:
    """llama.cpp's name of an HF tensor (`model.layers.<i>.<module>.<weight|bias>`)."""
    if hf in top_names:
        return top_names[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{layer_names['.'.join(rest[:-1])]}.{rest[-1]}"


def write_tensors(w: GGUFWriter, tensors: dict[str, np.ndarray], qtype: str,
                  keep_f32: Callable[[str], bool] = lambda name: False) -> None:
    """Add the tensors (matrices of 2 or more dimensions as `qtype` unless `keep_f32(name)`,
    the rest F32) and write the file."""
    import gguf
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[qtype]
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if value.ndim >= 2 and qtype != "F32" and not keep_f32(name):
            w.add_tensor(name, quantize(value, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rounded_copy(folder: Path, target: Path, qtype: str,
                 keep: Callable[[str], bool] = lambda name: False) -> Path:
    """The HF folder with each matrix (unless `keep(hf name)`) rounded through `qtype` and
    back: transformers' model of what a `qtype` GGUF of it holds."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    kind = gguf.GGMLQuantizationType[qtype]
    rounded = {k: dequantize(quantize(v.astype(np.float32), kind), kind).astype(np.float32)
               if v.ndim >= 2 and not keep(k) else v
               for k, v in load_file(folder / "model.safetensors").items()}
    target.mkdir()
    shutil.copy(folder / "config.json", target / "config.json")
    save_file(rounded, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
