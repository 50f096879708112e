"""Random-weight GGUF files of real model shapes, to measure localpaged at the sizes people run.

    python benchmarks/synthetic.py --shape smollm2:1.7b --type Q4_0 [--out DIR]
    python benchmarks/synthetic.py --list

The decoder trunk of each shape is the real model's (hidden size, layers, heads, KV heads,
intermediate size, q/k/v biases, tied or untied head, rope theta, context length). The
tokenizer is SmolLM2's for every shape: all `tokenizer.*` metadata of the default model's GGUF
(SmolLM2-135M-Instruct Q4_1, the test fixture) is copied, so the vocabulary is 49152 tokens
everywhere, and the token embedding and output head of the Llama-3.2 and Qwen2.5 shapes are
smaller than the real models' (128256 / 151936 / 152064 tokens): `--list` and every write
print the file's own parameter count. Llama 3.2's rope scaling (`rope_freqs`) is left out.
Random weights give noise tokens and real timings.

Matrices are normal(0, 0.02) from a numpy generator seeded by shape and tensor name (the same
numbers in every type of a shape), biases too; norms are F32 ones. F16, Q8_0, Q4_0 and Q4_1
are written by the `gguf` package (`gguf.quants.quantize`), one tensor at a time, so memory
stays at about one tensor. Other llama.cpp presets (Q4_K_M, Q5_K_M, Q6_K, ...) are made from
the shape's F16 file (written first, kept) by llama.cpp's `llama_model_quantize`, through
tests/llamacpp_peer.py (llama-cpp-python in this python or in PEERS_PYTHON).

Files are cached by name in the out dir (`smollm2-1.7b.Q4_0.gguf`); an existing file is reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFWriter

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path.home() / ".cache" / "localpaged-bench" / "synthetic"
VOCAB = 49152  # SmolLM2's tokenizer, used for every shape
INIT_STD = 0.02
GGUF_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1")  # written here; others go through llama.cpp
LLAMACPP_TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS",
                  "IQ4_NL")
CHUNK_ELEMENTS = 1 << 24  # rows generated and quantized per step: bounds the temporaries


@dataclass(frozen=True)
class Shape:
    """A decoder-only model's dimensions (Llama family, GGUF architecture names)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    rope_theta: float
    context: int
    rms_eps: float
    real_vocab: int
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: attn_q_norm / attn_k_norm per head
    head_size: int | None = None  # where it is not hidden / heads (Qwen3)
    experts: int = 0  # a mixture of experts in every layer (qwen3moe): how many,
    experts_used: int = 0  # the router's top k,
    expert_intermediate: int = 0  # and each expert's MLP width

    @property
    def active_parameters(self) -> int:
        """Parameters read per token (every expert counted only as used), at SmolLM2's
        vocabulary."""
        total = parameter_count(self)
        if not self.experts:
            return total
        per_expert = 3 * self.hidden * self.expert_intermediate
        return total - self.layers * (self.experts - self.experts_used) * per_expert

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "smollm2:1.7b": Shape("llama", 2048, 24, 32, 32, 8192, True, 130000.0, 8192, 1e-5, 49152),
    "llama3.2:1b": Shape("llama", 2048, 16, 32, 8, 8192, True, 500000.0, 131072, 1e-5, 128256),
    "llama3.2:3b": Shape("llama", 3072, 28, 24, 8, 8192, True, 500000.0, 131072, 1e-5, 128256),
    "qwen2.5:1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, True, 1000000.0, 32768, 1e-6, 151936,
                          qkv_bias=True),
    "qwen2.5:7b": Shape("qwen2", 3584, 28, 28, 4, 18944, False, 1000000.0, 32768, 1e-6, 152064,
                        qkv_bias=True),
    "qwen3:0.6b": Shape("qwen3", 1024, 28, 16, 8, 3072, True, 1000000.0, 40960, 1e-6, 151936,
                        qk_norm=True, head_size=128),
    "qwen3:1.7b": Shape("qwen3", 2048, 28, 16, 8, 6144, True, 1000000.0, 40960, 1e-6, 151936,
                        qk_norm=True, head_size=128),
    "qwen3:4b": Shape("qwen3", 2560, 36, 32, 8, 9728, True, 1000000.0, 40960, 1e-6, 151936,
                      qk_norm=True, head_size=128),
    # A Qwen3-MoE trunk (Qwen3-30B-A3B's layout: every layer 8 of many experts, head dim 128)
    # at ~2B parameters, ~0.5B of them read per token: the MoE benchmark's size.
    "qwen3moe:2b-a0.5b": Shape("qwen3moe", 1024, 24, 16, 8, 3072, True, 1000000.0, 40960, 1e-6,
                               151936, qk_norm=True, head_size=128, experts=48, experts_used=8,
                               expert_intermediate=512),
    # Tiny shapes for tests and smoke runs (seconds to write and load).
    "tiny": Shape("llama", 64, 2, 4, 2, 128, True, 10000.0, 2048, 1e-5, VOCAB),
    "tiny-qwen2": Shape("qwen2", 64, 2, 4, 2, 128, False, 10000.0, 2048, 1e-6, VOCAB,
                        qkv_bias=True),
    "tiny-qwen3": Shape("qwen3", 64, 2, 4, 2, 128, True, 1000000.0, 2048, 1e-6, VOCAB,
                        qk_norm=True, head_size=24),
    "tiny-qwen3moe": Shape("qwen3moe", 64, 2, 4, 2, 128, True, 1000000.0, 2048, 1e-6, VOCAB,
                           qk_norm=True, head_size=32, experts=4, experts_used=2,
                           expert_intermediate=64),
}


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor: its name, numpy shape (rows, cols) or (n,), and how it is filled."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix" | "bias" | "norm"


def tensor_specs(shape: Shape, vocab: int = VOCAB) -> list[TensorSpec]:
    """Every tensor of the model, in llama.cpp's order and names."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", (vocab, h), "matrix")]
    for i in range(shape.layers):
        b = f"blk.{i}."
        specs += [TensorSpec(b + "attn_norm.weight", (h,), "norm"),
                  TensorSpec(b + "attn_q.weight", (q, h), "matrix"),
                  TensorSpec(b + "attn_k.weight", (kv, h), "matrix"),
                  TensorSpec(b + "attn_v.weight", (kv, h), "matrix")]
        if shape.qkv_bias:
            specs += [TensorSpec(b + f"attn_{x}.bias", (n,), "bias")
                      for x, n in (("q", q), ("k", kv), ("v", kv))]
        if shape.qk_norm:
            specs += [TensorSpec(b + f"attn_{x}_norm.weight", (shape.head_dim,), "norm")
                      for x in ("k", "q")]
        specs += [TensorSpec(b + "attn_output.weight", (h, q), "matrix"),
                  TensorSpec(b + "ffn_norm.weight", (h,), "norm")]
        if shape.experts:  # the router (F32, as llama.cpp keeps it), the experts in 3-D
            e, f = shape.experts, shape.expert_intermediate
            specs += [TensorSpec(b + "ffn_gate_inp.weight", (e, h), "router"),
                      TensorSpec(b + "ffn_gate_exps.weight", (e, f, h), "matrix"),
                      TensorSpec(b + "ffn_up_exps.weight", (e, f, h), "matrix"),
                      TensorSpec(b + "ffn_down_exps.weight", (e, h, f), "matrix")]
        else:
            specs += [TensorSpec(b + "ffn_gate.weight", (shape.intermediate, h), "matrix"),
                      TensorSpec(b + "ffn_up.weight", (shape.intermediate, h), "matrix"),
                      TensorSpec(b + "ffn_down.weight", (h, shape.intermediate), "matrix")]
    specs.append(TensorSpec("output_norm.weight", (h,), "norm"))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", (vocab, h), "matrix"))
    return specs


def parameter_count(shape: Shape, vocab: int = VOCAB) -> int:
    return sum(int(np.prod(s.shape)) for s in tensor_specs(shape, vocab))


def _seed(shape_name: str, tensor: str) -> int:
    return zlib.crc32(f"{shape_name}/{tensor}".encode())


def float_chunks(shape_name: str, spec: TensorSpec) -> Iterator[np.ndarray]:
    """The tensor's float32 values, in blocks of rows (a norm or bias in one block)."""
    if spec.kind == "norm":
        yield np.ones(spec.shape, dtype=np.float32)
        return
    rng = np.random.default_rng(_seed(shape_name, spec.name))
    if spec.kind == "bias":
        yield rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(INIT_STD)
        return
    rows, cols = int(np.prod(spec.shape[:-1])), spec.shape[-1]  # experts: rows of all
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        block *= np.float32(INIT_STD)
        yield block


def float_values(shape_name: str, spec: TensorSpec) -> np.ndarray:
    """The whole tensor as float32 (for tests and small shapes)."""
    return np.concatenate(list(float_chunks(shape_name, spec))).reshape(spec.shape)


def stored_type(spec: TensorSpec, qtype: str) -> str:
    """The GGML type a tensor is written as: matrices in `qtype`; norms, biases and a MoE
    router F32."""
    return qtype if spec.kind == "matrix" else "F32"


def nbytes(spec: TensorSpec, type_name: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return int(np.prod(spec.shape)) // block * size


def encode(shape_name: str, spec: TensorSpec, type_name: str) -> np.ndarray:
    """The tensor's bytes as stored: float32/float16 values or quantized blocks (uint8 rows)."""
    import gguf
    from gguf.quants import quantize

    if type_name == "F32":
        return float_values(shape_name, spec)
    rows = int(np.prod(spec.shape[:-1]))
    if type_name == "F16":
        out = np.empty((rows, spec.shape[-1]), dtype=np.float16)
    else:
        out = np.empty((rows, nbytes(spec, type_name) // rows), dtype=np.uint8)
    kind = gguf.GGMLQuantizationType[type_name]
    row = 0
    for block in float_chunks(shape_name, spec):
        n = block.shape[0]
        out[row:row + n] = block if type_name == "F16" else quantize(block, kind)
        row += n
    return out.reshape(*spec.shape[:-1], out.shape[-1])


def file_name(shape_name: str, qtype: str) -> str:
    return f"{shape_name.replace(':', '-')}.{qtype}.gguf"


def default_tokenizer_source() -> Path:
    """The default model's GGUF (the test fixture, fetched once and cached)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest

    return conftest.smollm_gguf.__wrapped__()


def copy_tokenizer(writer: GGUFWriter, source: Path) -> None:
    """Every `tokenizer.*` key of `source` into the writer, values and types kept."""
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != VOCAB:
        raise ValueError(f"{source}: expected a tokenizer of {VOCAB} tokens (SmolLM2's)")


def stand_in_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    """A placeholder vocabulary (`<unk>`, `<s>`, `</s>`, then `t3`, `t4`, ...) of `vocab`
    tokens: for tests that need a small file that opens fast, not for text."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))  # unknown, control x2, normal
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _add_metadata(writer: GGUFWriter, shape_name: str, shape: Shape, qtype: str, vocab: int) -> None:
    import gguf

    writer.add_name(f"synthetic {shape_name} (random weights)")
    writer.add_description(f"random normal(0, {INIT_STD}) weights of {shape_name}'s shape, "
                           "written by localpaged benchmarks/synthetic.py")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"].value)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(shape_name: str, qtype: str, path: Path, tokenizer: Path | None,
               vocab: int = VOCAB, log: bool = True) -> Path:
    """Write `shape_name`'s random weights as a GGUF with its matrices in `qtype`
    (F16/Q8_0/Q4_0/Q4_1), one tensor in memory at a time. The tokenizer is `tokenizer`'s
    (a GGUF with SmolLM2's), or with None a stand-in of `vocab` tokens."""
    import gguf

    shape = SHAPES[shape_name]
    if tokenizer is not None and vocab != VOCAB:
        raise ValueError(f"SmolLM2's tokenizer has {VOCAB} tokens, not {vocab}")
    specs = tensor_specs(shape, vocab)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    _add_metadata(writer, shape_name, shape, qtype, vocab)
    if tokenizer is None:
        stand_in_tokenizer(writer, vocab)
    else:
        copy_tokenizer(writer, tokenizer)
    for spec in specs:
        t = stored_type(spec, qtype)
        raw = None if t in ("F32", "F16") else gguf.GGMLQuantizationType[t]
        dtype = np.float16 if t == "F16" else np.float32
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(dtype), nbytes(spec, t), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    start, done = time.perf_counter(), 0
    for spec in specs:
        data = encode(shape_name, spec, stored_type(spec, qtype))
        writer.write_tensor_data(data)
        done += data.nbytes
        if log and spec.name.endswith(("ffn_down.weight", "ffn_down_exps.weight")):
            layer = int(spec.name.split(".")[1]) + 1
            print(f"  layer {layer}/{shape.layers}: {done / 2**20:.0f} MiB, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    writer.close()
    return path


def _atomic(target: Path, make: Callable[[Path], object]) -> Path:
    """`make(tmp)` then rename tmp to `target` (a half-written file never looks cached)."""
    tmp = target.with_name(target.name + ".part")
    tmp.unlink(missing_ok=True)
    make(tmp)
    tmp.rename(target)
    return target


def synthetic_gguf(shape_name: str, qtype: str, out: Path = DEFAULT_OUT,
                   tokenizer: Path | None = None, log: bool = True) -> Path:
    """The cached file of `shape_name` in `qtype`, written (or quantized) when missing."""
    if shape_name not in SHAPES:
        raise SystemExit(f"unknown shape {shape_name!r}: one of {', '.join(SHAPES)}")
    if qtype not in GGUF_TYPES + LLAMACPP_TYPES:
        raise SystemExit(f"unknown type {qtype!r}: one of {', '.join(GGUF_TYPES + LLAMACPP_TYPES)}")
    out.mkdir(parents=True, exist_ok=True)
    target = out / file_name(shape_name, qtype)
    if target.exists():
        if log:
            print(f"cached: {target}")
        return target
    start = time.perf_counter()
    if qtype in GGUF_TYPES:
        source = tokenizer or default_tokenizer_source()
        if log:
            print(f"writing {target} ({shape_name}, {qtype}, "
                  f"{parameter_count(SHAPES[shape_name]) / 1e9:.3f} B parameters, "
                  f"{SHAPES[shape_name].active_parameters / 1e9:.3f} B a token)", flush=True)
        _atomic(target, lambda tmp: write_gguf(shape_name, qtype, tmp, source, log=log))
    else:
        f16 = synthetic_gguf(shape_name, "F16", out, tokenizer, log)
        _llamacpp_quantize(f16, target, qtype, log)
    if log:
        print(f"wrote {target}: {target.stat().st_size / 2**20:.0f} MiB in "
              f"{time.perf_counter() - start:.1f} s")
    return target


def _llamacpp_quantize(f16: Path, target: Path, qtype: str, log: bool) -> None:
    """llama.cpp's `llama_model_quantize` of the F16 file to the preset `qtype`."""
    import gguf

    sys.path.insert(0, str(ROOT / "tests"))
    from llamacpp_peer import find

    quantizer, why = find()
    if quantizer is None:
        raise SystemExit(f"{qtype} needs llama.cpp's quantizer: {why}")
    if log:
        print(f"quantizing {f16.name} -> {target.name} with llama.cpp ({quantizer})", flush=True)
    quantizer.quantize_model(f16, target, gguf.LlamaFileType[f"MOSTLY_{qtype}"].value)


def list_shapes(out: Path) -> None:
    print(f"vocabulary {VOCAB} (SmolLM2's tokenizer) for every shape; types: "
          f"{', '.join(GGUF_TYPES)} (gguf package), {', '.join(LLAMACPP_TYPES)} (llama.cpp)")
    print(f"{'shape':<19}{'arch':<9}{'hidden':>7}{'layers':>7}{'heads':>6}{'kv':>4}"
          f"{'inter':>7}{'tied':>6}{'bias':>6}{'real vocab':>11}{'params (this vocab)':>21}"
          f"{'read a token':>14}")
    for name, s in SHAPES.items():
        print(f"{name:<19}{s.arch:<9}{s.hidden:>7}{s.layers:>7}{s.heads:>6}{s.kv_heads:>4}"
              f"{s.intermediate:>7}{s.tied!s:>6}{s.qkv_bias!s:>6}{s.real_vocab:>11}"
              f"{parameter_count(s) / 1e9:>19.3f} B{s.active_parameters / 1e9:>12.3f} B")
    cached = sorted(out.glob("*.gguf")) if out.exists() else []
    print(f"\ncached in {out}:" + "".join(
        f"\n  {p.name}  {p.stat().st_size / 2**20:.0f} MiB" for p in cached) if cached
        else f"\nnothing cached in {out}")


QUANT_FORMATS = ("awq", "gptq", "gptq-actorder")  # HF folders, by localpaged's own writer
_HF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def write_quantized(shape_name: str, fmt: str, out: Path, tokenizer: Path | None = None,
                    group_size: int = 128, vocab: int = VOCAB, log: bool = True) -> Path:
    """`shape_name`'s trunk as an AWQ (GEMM) or GPTQ (v1; `gptq-actorder`: desc_act, the
    input channels in a random order) checkpoint folder, written by localpaged's own writer
    (`localpaged.quant.writer.layer_tensors`): random 4-bit codes, scales about the
    float16 weights' 0.02 spread, zero points 8 (GPTQ symmetric) or random (AWQ); embeddings
    and biases random float16, norms ones. `tokenizer`: an HF folder whose tokenizer files
    are copied (SmolLM2's: the vocabulary is 49152 tokens)."""
    import torch
    from safetensors.torch import save_file

    from localpaged.quant.gptq import QuantizedLayer
    from localpaged.quant.writer import TOKENIZER_FILES, layer_tensors, quantization_config

    shape = SHAPES[shape_name]
    if shape.arch not in _HF_ARCH or shape.experts:
        raise SystemExit(f"--format {fmt}: shapes of {', '.join(_HF_ARCH)} only")
    method, act_order = fmt.removesuffix("-actorder"), fmt.endswith("-actorder")
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(zlib.crc32(f"{shape_name}/{fmt}".encode()))
    tensors: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    for spec in tensor_specs(shape, vocab):
        if spec.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif spec.name == "output_norm.weight":
            name = "model.norm.weight"
        elif spec.name == "output.weight":
            name = "lm_head.weight"
        else:
            _, layer, part, kind = spec.name.split(".")
            name = f"model.layers.{layer}.{_HF_LAYER[part]}.{kind}"
        if spec.kind == "norm":
            tensors[name] = torch.ones(spec.shape, dtype=torch.float16)
        elif spec.kind == "bias" or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensors[name] = (torch.randn(spec.shape, generator=g) * INIT_STD).half()
        else:
            n, k = spec.shape
            groups = k // group_size
            g_idx = torch.arange(k) // group_size
            if act_order:  # channel perm[i] in group i // group_size
                g_idx = torch.empty(k, dtype=torch.long)
                g_idx[torch.randperm(k, generator=g)] = torch.arange(k) // group_size
            zeros = (torch.full((groups, n), 8) if method == "gptq" else
                     torch.randint(4, 12, (groups, n), generator=g))
            q = QuantizedLayer(codes=torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32),
                               scales=torch.full((groups, n), INIT_STD / 4).half(),
                               zeros=zeros.int(), g_idx=g_idx.int(), group_size=group_size)
            tensors.update(layer_tensors(name.removesuffix(".weight"), q, method, None))
        if log and spec.name.endswith("ffn_down.weight"):
            print(f"  layer {int(spec.name.split('.')[1]) + 1}/{shape.layers}, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_arch, model_type = _HF_ARCH[shape.arch]
    config = {"architectures": [hf_arch], "model_type": model_type, "hidden_size": shape.hidden,
              "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
              "head_dim": shape.head_dim, "max_position_embeddings": shape.context,
              "rms_norm_eps": shape.rms_eps, "rope_theta": shape.rope_theta,
              "vocab_size": vocab, "tie_word_embeddings": shape.tied, "hidden_act": "silu",
              "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
              "quantization_config": quantization_config(method, group_size,
                                                         sym=method == "gptq",
                                                         act_order=act_order)}
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for fname in TOKENIZER_FILES if tokenizer is not None else ():
        if (tokenizer / fname).exists():
            shutil.copy(tokenizer / fname, out / fname)
    return out


def default_tokenizer_folder() -> Path:
    """SmolLM2's tokenizer as an HF folder (the test fixture, made once and cached)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest

    return conftest.smollm_hf_dir.__wrapped__(default_tokenizer_source())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2:1.7b", choices=list(SHAPES))
    ap.add_argument("--type", default="Q4_0", choices=GGUF_TYPES + LLAMACPP_TYPES)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="a GGUF with SmolLM2's tokenizer (default: the test fixture)")
    ap.add_argument("--list", action="store_true", help="the shapes and the cached files")
    ap.add_argument("--format", choices=("gguf", *QUANT_FORMATS), default="gguf",
                    help="gguf (--type), or an AWQ / GPTQ folder by localpaged's writer")
    args = ap.parse_args()
    if args.list:
        list_shapes(args.out)
        return
    if args.format != "gguf":
        target = args.out / f"{args.shape.replace(':', '-')}-{args.format}"
        if not (target / "config.json").exists():
            print(f"writing {target}", flush=True)
            write_quantized(args.shape, args.format, target, default_tokenizer_folder())
        print(f"wrote {target}")
        return
    synthetic_gguf(args.shape, args.type, args.out, args.tokenizer_from)


if __name__ == "__main__":
    main()
