"""Read GGUF files (llama.cpp's format) into an HF-style config and HF-named tensors.

Every tensor type the common llama.cpp presets write is read (`localpaged.quant.ggml_types`):
`weights()` dequantizes all of them to float32; `int4_weights()` keeps Q4_0/Q4_1/Q4_K matrices
in 4 bits (`localpaged.quant.ggml_int4`) and dequantizes the others once. A type outside that
list is refused before any work, naming the tensor. Tokenizer, special tokens and chat
template come from the GGUF metadata.

The file is opened by `localpaged.model.gguf_reader` (memory-mapped; the vocabulary arrays
are read only when asked), and `tensors_for` hands 4-bit matrices over unpacked
(`GgmlInt4Weight`) so that `QuantLinear.load` repacks the file's blocks straight into the
CPU kernel's layout.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from localpaged.model.saved_tokenizer import (
    load_saved,
    open_saved,
    save_tokenizer,
    tokenizer_cache_dir,
)
from localpaged.quant import ggml_types
from localpaged.quant.ggml_int4 import INT4_TYPES, GgmlInt4Weight, int4_parts
from localpaged.quant.ggml_int8 import INT8_TYPES

if TYPE_CHECKING:
    from localpaged.model.gguf_reader import FastGGUFReader

# GGUF architecture -> (HF architectures entry, HF model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
# The ones llama.cpp's converter permutes q/k rows for (interleaved rotary -> half split).
_PERMUTED_ARCHS = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    "attn_qkv": "self_attn.qkv_proj",  # q, k and v in one matrix (phi3)
}
# A MoE layer's experts, one 3-D tensor [experts, rows, columns] per projection.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
# Gemma 3's four norms per layer: llama.cpp's names differ from the Llama family's meaning of
# ffn_norm. Its converter stores every norm weight as 1 + w (Gemma3RMSNorm's factor): the
# loader subtracts the 1 again (exact in float32: both lie in [0.5, 2]).
_ARCH_LAYER_NAMES = {
    "gemma3": {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# phi3's ffn_up holds gate and up.
_ARCH_LAYER_NAMES["phi3"] = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
_NORM_PLUS_ONE_ARCHS = {"gemma3"}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no HF weight (llama3 rope frequency factors and phi3's LongRoPE factors
# are rebuilt from config).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_BIG_FIELDS = {f"tokenizer.ggml.{k}" for k in ("tokens", "scores", "token_type", "merges")}

SUPPORTED_TYPES = ggml_types.SUPPORTED_TYPES


def kept_4bit(dtype: torch.dtype, float32_kernel: bool = False,
              int8_activations: bool = False) -> frozenset[str]:
    """The GGUF types whose matrices stay 4-bit for a model computing in `dtype`: Q4_0/Q4_1/
    Q4_K in 16-bit; in float32 where the CPU kernel takes float32 and holds the file's
    numbers exactly (Q4_0/Q4_1: float16 scales and offsets; Q4_K's d * sc needs more bits),
    or rounds the activations to int8 anyway (all three: the scales' rounding is far below
    that). Everything else is dequantized once at load."""
    if dtype != torch.float32 or (float32_kernel and int8_activations):
        return frozenset(INT4_TYPES)
    return frozenset({"Q4_0", "Q4_1"}) if float32_kernel else frozenset()


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF (LlamaForCausalLM-style) name of a GGUF tensor of a model of GGUF architecture
    `arch`, or None if it has none."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch or "", _LAYER_NAMES)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its `permute()` in convert_hf_to_gguf.py).

    llama.cpp stores each head's rows interleaved as pairs (x0, x_half, x1, x_half+1, ...) for
    its GPT-J-style rotary; HF's rotate_half wants the two halves apart."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    w = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs.weight` for Llama 3.x."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, out)
    return np.where(wavelen > original / low, factor, out)


def llama3_rope_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int, path: Path) -> dict:
    """HF's `rope_scaling` for a GGUF's `rope_freqs` tensor: the Llama 3.x parameters that
    reproduce it (the factors alone do not name them; the known ones are checked)."""
    factor = float(rope_freqs.max())
    for low, high, original in ((1.0, 4.0, 8192),):  # Llama 3.1, 3.2 and 3.3
        want = llama3_rope_factors(theta, head_dim, factor, low, high, original)
        if want.shape == rope_freqs.shape and np.allclose(want, rope_freqs, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"{path}: rope_freqs.weight does not match Llama 3 rope scaling; "
                     "this rope variant is not supported")


@dataclass
class RawTensor:
    """One GGUF tensor as stored: HF name, GGML type name, HF shape and its bytes or values."""

    name: str
    gguf_name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """An opened GGUF file, validated up front so that later reads cannot run off its end."""

    def __init__(self, path: str | Path) -> None:
        from localpaged.model.gguf_reader import FastGGUFReader, UnknownGGMLType

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            self.reader: FastGGUFReader = FastGGUFReader(self.path)
        except UnknownGGMLType as exc:  # a type newer than this package
            raise ValueError(
                f"{self.path}: {exc}; use another quantization of this model, e.g. Q4_K_M, "
                "Q5_K_M, Q6_K or Q8_0"
            ) from None
        except Exception as exc:  # the reader fails deep in numpy/struct on a damaged header
            raise ValueError(
                f"{self.path}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc}); "
                "download it again"
            ) from None
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise ValueError(
                    f"{self.path}: truncated GGUF file: tensor {t.name} needs bytes up to {end} "
                    f"but the file has {size}; download it again"
                )
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key in _BIG_FIELDS:
                continue  # the vocabulary arrays are read by the tokenizer converter
            try:
                self.metadata[key] = field.contents()
            except Exception as exc:
                raise ValueError(f"{self.path}: corrupt GGUF metadata field {key}: {exc}") from None

    @property
    def fingerprint(self) -> str:
        """Identity of the file's current content (see `_fingerprint`)."""
        return _fingerprint(self.path)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """The `<architecture>.<suffix>` metadata value."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def _int(self, suffix: str, default: int | None = None) -> int:
        value = self.arch_key(suffix, default)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.architecture}.{suffix}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self.path}: GGUF metadata {self.architecture}.{suffix} = "
                             f"{value!r} is not a number") from None
        if number <= 0:
            raise ValueError(f"{self.path}: GGUF metadata {self.architecture}.{suffix} = {number}")
        return number

    def hf_config(self) -> dict[str, Any]:
        """An HF config.json-style dict for this model."""
        try:
            return self._hf_config()
        except ValueError:
            raise
        except Exception as exc:  # odd metadata types in a damaged file
            raise ValueError(f"{self.path}: corrupt GGUF metadata ({type(exc).__name__}: {exc})") from None

    def _hf_config(self) -> dict[str, Any]:
        self.check_types()
        arch = self.architecture
        if arch not in _ARCHS:
            raise ValueError(
                f"{self.path}: GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(_ARCHS))})"
            )
        name = str(self.metadata.get("general.name", "")).lower()
        hf_arch, model_type = _ARCHS["mistral" if arch == "llama" and "mistral" in name else arch]
        names = {t.name for t in self.reader.tensors}
        if "token_embd.weight" not in names:
            raise ValueError(f"{self.path}: GGUF file has no token_embd.weight tensor")
        n_heads = self._int("attention.head_count")
        hidden = self._int("embedding_length")
        head_dim = self._int("attention.key_length", self.arch_key("rope.dimension_count")
                             or hidden // n_heads)
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        embd = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        vocab = self._int("vocab_size", len(tokens) if tokens else int(embd.shape[-1]))
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": self._int(
                "feed_forward_length", self.arch_key("expert_feed_forward_length")),
            "num_hidden_layers": self._int("block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": self._int("attention.head_count_kv", n_heads),
            "head_dim": head_dim,
            "max_position_embeddings": self._int("context_length", 2048),
            "rms_norm_eps": float(self.arch_key("attention.layer_norm_rms_epsilon") or 1e-6),
            "rope_theta": float(self.arch_key("rope.freq_base") or 10000.0),
            "vocab_size": vocab,
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "torch_dtype": "float32",
        }
        if arch == "qwen3moe":  # llama.cpp's graph: softmax, top k, weights renormalized
            layers = int(config["num_hidden_layers"])
            config.update(
                num_experts=self._int("expert_count"),
                num_experts_per_tok=self._int("expert_used_count"),
                moe_intermediate_size=self._int("expert_feed_forward_length"),
                norm_topk_prob=True,
                mlp_only_layers=[i for i in range(layers)
                                 if f"blk.{i}.ffn_gate_inp.weight" not in names])
        scaling = self.arch_key("rope.scaling.type")
        factor = self.arch_key("rope.scaling.factor")
        if scaling in ("linear", "yarn") and factor:
            config["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
        freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            config["rope_scaling"] = llama3_rope_scaling(
                np.asarray(freqs.data, dtype=np.float32), config["rope_theta"], head_dim, self.path)
        if arch == "gemma3":
            config.update(self._gemma3_config(config))
        if arch == "phi3":
            from localpaged.model.phi3 import GGUF_ROPE_FACTORS, gguf_rope_config

            factors = {t.name: np.asarray(t.data, dtype=np.float32) for t in self.reader.tensors
                       if t.name in GGUF_ROPE_FACTORS}
            config = gguf_rope_config(config, self.metadata, factors)
        for key in ("bos", "eos", "padding"):
            value = self.metadata.get(f"tokenizer.ggml.{key}_token_id")
            if value is not None:
                config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
        return config

    def _gemma3_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's own HF fields, as llama.cpp reads the file: local layers 5 of every 6
        when the file names a sliding window, their rope base 10000, queries scaled by
        head_dim ** -0.5 (by (hidden / heads) ** -0.5 for the 62-layer 27B)."""
        window = self.arch_key("attention.sliding_window")
        heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
        scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
        out: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar,
            "rope_local_base_freq": 10000.0,
            "sliding_window": int(window) if window else None,
            "sliding_window_pattern": 6,
        }
        softcap = self.arch_key("final_logit_softcapping")
        if softcap:
            out["final_logit_softcapping"] = float(softcap)
        return out

    def raw_tensors(self) -> Iterator[RawTensor]:
        """Every weight tensor as stored (quantized bytes stay bytes), with its HF name. Once
        the caller asks for the next one, the last one's pages of the file mapping leave this
        process's memory (`FastGGUFReader.release`): a load holds the file's bytes one tensor
        at a time beside the model's own copy, not the whole file."""
        for t in self.reader.tensors:
            if t.name in _SKIPPED:
                continue
            m = _BLOCK_RE.fullmatch(t.name)
            if m and m.group(2) in _EXPERT_NAMES and len(t.shape) == 3:
                yield from self._experts(t, int(m.group(1)), _EXPERT_NAMES[m.group(2)])
                self.reader.release(t.data)
                continue
            hf = hf_tensor_name(t.name, self.architecture)
            if hf is None:
                raise ValueError(f"{self.path}: unexpected tensor {t.name!r} in GGUF file")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            yield RawTensor(hf, t.name, t.tensor_type.name, shape, t.data)
            self.reader.release(t.data)

    @staticmethod
    def _experts(t: Any, layer: int, proj: str) -> Iterator[RawTensor]:
        """A 3-D expert tensor as one 2-D tensor per expert (each expert's rows are
        contiguous in the file, whole blocks: a view each)."""
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        for e in range(shape[0]):
            yield RawTensor(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight",
                            f"{t.name}[{e}]", t.tensor_type.name, shape[1:], t.data[e])

    def _rotary_heads(self, raw: RawTensor, config: dict[str, Any]) -> int | None:
        """The head count to undo llama.cpp's q/k permutation with, or None."""
        if self.architecture not in _PERMUTED_ARCHS:
            return None
        if ".attn_q." in raw.gguf_name:
            heads = int(config["num_attention_heads"])
        elif ".attn_k." in raw.gguf_name:
            heads = int(config["num_key_value_heads"])
        else:
            return None
        rows = raw.shape[0] if raw.shape else 0
        if heads < 1 or rows % heads or (rows // heads) % 2:
            raise ValueError(f"{self.path}: tensor {raw.gguf_name} has {rows} rows, which do not "
                             f"split into {heads} heads of an even size (corrupt metadata?)")
        return heads

    def check_types(self) -> None:
        """Refuse a file holding a tensor type localpaged cannot read, before any work."""
        for t in self.reader.tensors:
            name = t.tensor_type.name
            if name not in SUPPORTED_TYPES and t.name not in _SKIPPED:
                raise ValueError(
                    f"{self.path}: tensor {t.name} has GGML type {name}, which localpaged cannot "
                    f"read (it reads {', '.join(SUPPORTED_TYPES)}); use another quantization of "
                    "this model, e.g. Q4_K_M, Q5_K_M, Q6_K or Q8_0"
                )

    def _dense(self, raw: RawTensor, config: dict[str, Any]) -> torch.Tensor:
        try:
            values = ggml_types.dequantize(raw.type_name, raw.data, raw.shape)
        except Exception as exc:
            raise ValueError(
                f"{self.path}: cannot read tensor {raw.gguf_name} ({raw.type_name}): {exc}"
            ) from None
        heads = self._rotary_heads(raw, config)
        if heads:
            values = unpermute_rotary(values, heads)
        if self.architecture in _NORM_PLUS_ONE_ARCHS and raw.gguf_name.endswith("norm.weight"):
            values = values.astype(np.float32) - np.float32(1.0)
        if not values.flags.writeable:  # F32 data is a view of the read-only file mapping
            values = values.copy()
        return torch.from_numpy(values)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named float32 tensors, dequantized and with llama.cpp's q/k permutation undone."""
        config = self.hf_config()
        for raw in self.raw_tensors():
            yield raw.name, self._dense(raw, config)

    def int4_weights(self, types: frozenset[str] = INT4_TYPES, int8: bool = False,
                     parts: bool = False) -> Iterator[tuple[str, Any]]:
        """Like `weights()`, but matrices of `types` (default Q4_0/Q4_1/Q4_K) come as
        `localpaged.quant.layout.Int4Weight` (group size 32) and stay 4-bit (see
        `localpaged.quant.ggml_int4`), and with `int8` the matrices of the other block types
        come as int8 blocks (`localpaged.quant.ggml_int8.Int8Blocks`). Every other tensor is
        dequantized to float32 as in `weights()`, once, here. With `parts` the 4-bit matrices
        come unpacked, as `GgmlInt4Weight` (`QuantLinear.load` repacks those straight into
        the CPU kernel's layout). A 4-bit matrix of fewer rows than a kernel tile's 16 (or not
        a multiple: a small MoE router, say) comes dense."""
        config = self.hf_config()
        to_4bit = q4_parts if parts else q4_to_int4
        for raw in self.raw_tensors():
            if raw.type_name in types and len(raw.shape) == 2 and raw.shape[0] % 16 == 0:
                yield raw.name, to_4bit(raw, self._rotary_heads(raw, config))
            elif int8 and _int8_fits(raw):
                yield raw.name, q8_parts(raw, self._rotary_heads(raw, config))
            else:
                yield raw.name, self._dense(raw, config)

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    def tensors_for(self, dtype: torch.dtype, kept: frozenset[str] | None = None,
                    int8: bool = False) -> Iterator[tuple[str, Any]]:
        """The weights to build a model computing in `dtype` from: the matrices of the types
        `kept` 4-bit (default: Q4_0/Q4_1/Q4_K in 16-bit, none in float32), with `int8` those
        of the other block types as int8 blocks, the rest dense."""
        kept = kept_4bit(dtype) if kept is None else kept
        return self.int4_weights(kept, int8, parts=True) if kept or int8 else self.weights()

    def load_summary(self, dtype: torch.dtype, kept: frozenset[str] | None = None,
                     int8: bool = False) -> str:
        """What `tensors_for(dtype, kept, int8)` does with the matrices of each type, e.g.
        (SmolLM2-135M as Q4_K_M) "weights: Q4_K x 16 kept 4-bit (group 32); Q5_0 x 166,
        Q6_K x 14, Q8_0 x 15 -> bfloat16"."""
        from localpaged.quant import w6_linear

        types = kept_4bit(dtype) if kept is None else kept
        target = str(dtype).removeprefix("torch.")
        four_bit: dict[str, int] = {}
        six_bit: dict[str, int] = {}
        eight_bit: dict[str, int] = {}
        converted: dict[str, int] = {}
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if len(t.shape) not in (2, 3) or (kind, target) in (("F32", "float32"),
                                                                 ("BF16", "bfloat16")):
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            many, shape = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)  # experts
            # a 4-bit token embedding stays 4-bit where the CPU kernels are (`int8` says so)
            # and its rows fill their tiles
            if kind in types and shape[0] % 16 == 0 and (
                    t.name != "token_embd.weight" or int8):
                counts = four_bit
            elif int8 and w6_linear.wanted(kind, shape):  # type: ignore[arg-type]
                counts = four_bit if kind in w6_linear.CODE_BOOK_TYPES else six_bit
            elif int8 and kind in INT8_TYPES:
                counts = eight_bit
            else:
                counts = converted
            counts[kind] = counts.get(kind, 0) + many
        parts = []
        if four_bit:
            parts.append(", ".join(f"{k} x {n}" for k, n in sorted(four_bit.items()))
                         + " kept 4-bit (group 32)")
        if six_bit:
            parts.append(", ".join(f"{k} x {n}" for k, n in sorted(six_bit.items()))
                         + " kept 6-bit")
        if eight_bit:
            parts.append(", ".join(f"{k} x {n}" for k, n in sorted(eight_bit.items()))
                         + " as int8 blocks")
        if converted:
            parts.append(", ".join(f"{k} x {n}" for k, n in sorted(converted.items()))
                         + f" -> {target}")
        return "weights: " + ("; ".join(parts) or f"all {target}")

    @property
    def quantization(self) -> str:
        """The file's preset when it names one (e.g. "Q4_K_M"), else the most common weight
        type of the 2-D tensors (e.g. "Q4_1")."""
        from localpaged.model.ggml_type_ids import FILE_TYPES

        try:
            preset = FILE_TYPES.get(int(self.metadata.get("general.file_type", -1)), "GUESSED")
        except (TypeError, ValueError):
            preset = "GUESSED"
        if preset != "GUESSED":
            return "F32" if preset == "ALL_F32" else preset.removeprefix("MOSTLY_")
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            if len(t.shape) == 2:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return max(counts, key=lambda k: counts[k]) if counts else "F32"

    @property
    def parameter_count(self) -> int:
        return sum(int(t.n_elements) for t in self.reader.tensors if t.name not in _SKIPPED)


_OPEN: dict[str, GGUFFile] = {}
_OPEN_LOCK = threading.Lock()


def _fingerprint(path: Path) -> str:
    """Identity of a file's current content, cheaply: path, size, mtime and a hash of its
    first MiB (the header and metadata) and last 64 KiB."""
    st = path.stat()
    h = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > (1 << 20):
            f.seek(max(st.st_size - (1 << 16), 1 << 20))
            h.update(f.read())
    return h.hexdigest()


def open_gguf(path: str | Path) -> GGUFFile:
    """A parsed GGUFFile, reused while the file is unchanged (parsing the vocabulary of a
    real model takes seconds; the loader, the tokenizer and `show` all need it)."""
    p = Path(path).resolve()
    try:
        key = _fingerprint(p)
    except OSError:
        return GGUFFile(p)  # raises the clear FileNotFoundError
    with _OPEN_LOCK:  # the tokenizer's thread and the weights' open the same file at once
        cached = _OPEN.get(key)
        if cached is None:
            cached = GGUFFile(p)
            _OPEN.clear()  # keep one: a process loads one model at a time
            _OPEN[key] = cached
    return cached


def _decoded(raw: RawTensor, decode: Callable[[], Any]) -> Any:
    """`decode()`, its ValueError naming the tensor."""
    try:
        return decode()
    except ValueError as exc:
        raise ValueError(f"tensor {raw.gguf_name}: {exc}") from None


def _unpermuted(parts: tuple[np.ndarray, ...], rotary_heads: int | None) -> tuple[np.ndarray, ...]:
    """Each per-row array of `parts` with llama.cpp's q/k permutation undone (if heads given)."""
    if not rotary_heads:
        return tuple(parts)
    return tuple(unpermute_rotary(a, rotary_heads) for a in parts)


def _int8_fits(raw: RawTensor) -> bool:
    """A matrix of a type with an int8 form whose blocks the 8-bit kernel's tiles fit."""
    from localpaged.quant.q8_linear import fits_kernel

    return (raw.type_name in INT8_TYPES and len(raw.shape) == 2
            and fits_kernel((raw.shape[0], raw.shape[1]), INT8_TYPES[raw.type_name][0]))


def q_to_int8(raw: RawTensor, rotary_heads: int | None = None) -> Any:
    """A GGUF matrix of a type in `ggml_int8.INT8_TYPES` as `Int8Blocks` (the same values),
    with llama.cpp's q/k row permutation undone when `rotary_heads` is given."""
    from localpaged.quant.ggml_int8 import int8_blocks

    blocks = _decoded(raw, lambda: int8_blocks(raw.type_name, raw.data, *raw.shape))
    if rotary_heads:
        blocks = blocks.permute_rows(lambda a: unpermute_rotary(a, rotary_heads))
    return blocks


def q8_parts(raw: RawTensor, rotary_heads: int | None = None) -> Any:
    """`q_to_int8`, kept as the file's blocks where the C packer reads the type (Q8_0, Q5_0,
    Q6_K): packed straight into the kernel's tiles when installed."""
    from localpaged.quant import w6_linear
    from localpaged.quant.ggml_int8 import GgmlInt8Weight

    six = w6_linear.wanted(raw.type_name, raw.shape)  # type: ignore[arg-type]
    if not six and not GgmlInt8Weight.packable(raw.type_name):
        return q_to_int8(raw, rotary_heads)
    rows = _row_order(raw, rotary_heads)
    return _decoded(raw, lambda: GgmlInt8Weight(raw.type_name, raw.data, *raw.shape, rows))


def _row_order(raw: RawTensor, rotary_heads: int | None) -> np.ndarray | None:
    """The file's row of each output row with llama.cpp's q/k permutation undone (None: in
    order), for the packers that read the file's blocks row by row."""
    if not rotary_heads:
        return None
    return unpermute_rotary(np.arange(raw.shape[0])[:, None], rotary_heads)[:, 0]


def q4_parts(raw: RawTensor, rotary_heads: int | None = None) -> GgmlInt4Weight:
    """A GGUF Q4_0 / Q4_1 / Q4_K matrix as code pairs, scales and zero-points per row (the
    same values, group size 32), with llama.cpp's q/k row permutation undone when
    `rotary_heads` is given."""
    rows = _row_order(raw, rotary_heads)  # kept as the file's blocks: packed in C
    return _decoded(raw, lambda: GgmlInt4Weight.from_blocks(raw.type_name, raw.data,
                                                            *raw.shape, rows))


def q4_to_int4(raw: RawTensor, rotary_heads: int | None = None) -> Any:
    """A GGUF Q4_0 / Q4_1 / Q4_K matrix as an `Int4Weight` (the same values, group size 32),
    with llama.cpp's q/k row permutation undone when `rotary_heads` is given."""
    from localpaged.quant.layout import from_codes

    parts = _decoded(raw, lambda: int4_parts(raw.type_name, raw.data, *raw.shape))
    codes, scales, zeros = _unpermuted(parts, rotary_heads)
    return from_codes(torch.from_numpy(codes.T.astype(np.int32)),
                      torch.from_numpy(np.ascontiguousarray(scales.T)),
                      torch.from_numpy(np.ascontiguousarray(zeros.T)), 32)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """An HF-style config dict and an iterator of HF-named float32 weights from a GGUF file.

    Raises ValueError naming the file when it is truncated, corrupt or unsupported."""
    gguf_file = open_gguf(path)
    return gguf_file.hf_config(), gguf_file.weights()


TOKENIZER_CACHE_VERSION = 2  # 2: compact tokenizer.json


def _tokenizer_key(path: Path) -> str:
    ident = f"{_fingerprint(path.resolve())}|{TOKENIZER_CACHE_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _tokenizer_folder(gguf_file: GGUFFile) -> Path:
    """Where the file's converted tokenizer is kept (tokenizer.json there once converted)."""
    return tokenizer_cache_dir("gguf") / _tokenizer_key(gguf_file.path)


def hf_tokenizer_from_gguf(path: str | Path, *, cache: bool = True) -> Any:
    """A transformers fast tokenizer built from the GGUF metadata (vocab, merges, specials,
    chat template); the conversion is cached under `tokenizer_cache_dir("gguf")`."""
    from transformers import AutoTokenizer

    gguf_file = open_gguf(path)  # validates the file and names it in errors
    folder = _tokenizer_folder(gguf_file)
    if cache and (folder / "tokenizer.json").is_file():
        try:
            return load_saved(folder)
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)  # a damaged cache entry: convert again
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.path.parent), gguf_file=gguf_file.path.name)
    except Exception as exc:
        raise ValueError(f"{gguf_file.path}: cannot build a tokenizer from GGUF metadata: {exc}") from exc
    template = gguf_file.chat_template
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    if cache:
        save_tokenizer(tok, folder)
    return tok


def gguf_eos_token_ids(path: str | Path) -> list[int]:
    """The end-of-sequence token ids named in the GGUF metadata (eos, then eot/eom if any)."""
    meta = open_gguf(path).metadata
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def tokenizer_from_gguf(path: str | Path) -> Any:
    """`localpaged.model.tokenizer.Tokenizer` from the GGUF metadata. Once converted, it is
    usable at once from the cache (`SavedTokenizer`: transformers is imported beside)."""
    from localpaged.model.tokenizer import Tokenizer

    gguf_file = open_gguf(path)
    # None when not converted yet, or damaged: hf_tokenizer_from_gguf converts it (again)
    hf: Any = open_saved(_tokenizer_folder(gguf_file))
    if hf is None:
        hf = hf_tokenizer_from_gguf(path)
    eos = gguf_eos_token_ids(path)
    if gguf_file.architecture == "phi3":
        from localpaged.model.phi3 import gguf_turn_end_ids

        eos += gguf_turn_end_ids(hf)
    return Tokenizer(hf, eos_token_ids=eos)
