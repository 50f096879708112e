"""On-disk 4-bit formats <-> codes / zero-points / scales, and <-> `Int4Weight`.

GPTQ v1 (AutoGPTQ / GPTQModel "gptq") and AWQ GEMM (AutoAWQ), as specified in
shared/QUANT_FORMATS.md; GGUF Q4_0 / Q4_1 blocks. Codes are `[K, N]` (input rows, output
columns), zero-points and scales `[G, N]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from localpaged.quant.layout import (
    Int4Weight,
    _to_int32,
    awq_to_internal,
    from_codes,
    from_packed,
    pack_nibbles,
    unpack_nibbles,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k holds column 8c + AWQ_ORDER[k]
GPTQ_V2_DELTA = 0x11111111  # gptqmodel's word-wise v1 <-> v2 zero conversion


@dataclass
class QuantSpec:
    """The parts of `quantization_config` a loader needs."""

    method: str  # "gptq" | "awq"
    bits: int = 4
    group_size: int = 128  # -1: one group over all inputs
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"  # "gptq" (v1, zeros - 1) | "gptq_v2" (zeros as is)
    word_wise_zeros: bool = False  # gptqmodel wrote the v1 zeros with a word-wise borrow
    modules_to_not_convert: list[str] = field(default_factory=list)
    lm_head: bool = False


def parse_quant_config(cfg: dict[str, Any]) -> QuantSpec:
    """Validate a `quantization_config` (or quantize_config.json) dict."""
    method = str(cfg.get("quant_method", cfg.get("method", ""))).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(
            f"quantization_config.quant_method={method or None!r}: supported are 'gptq', 'awq'"
        )
    bits = cfg.get("bits", cfg.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"quantization_config.bits={bits!r}: only 4-bit weights are supported")
    gs = cfg.get("group_size", cfg.get("q_group_size", 128))
    if not isinstance(gs, int) or not (gs == -1 or (gs > 0 and gs % 8 == 0)):
        raise ValueError(
            f"quantization_config.group_size={gs!r}: supported are -1 and positive "
            "multiples of 8 (32, 64, 128, ...)"
        )
    spec = QuantSpec(method=method, group_size=gs)
    not_convert = cfg.get("modules_to_not_convert") or []
    spec.modules_to_not_convert = [str(m) for m in not_convert]
    if method == "awq":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version={version!r}: only 'gemm' AWQ is supported")
        if cfg.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point=false: AWQ GEMM needs zero points")
        if gs == -1:
            raise ValueError("quantization_config.group_size=-1: AWQ needs a positive group size")
        spec.sym = False
        return spec
    fmt = str(cfg.get("checkpoint_format", cfg.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"quantization_config.checkpoint_format={fmt!r}: supported are 'gptq', 'gptq_v2'"
        )
    if cfg.get("is_marlin_format"):
        raise ValueError("quantization_config.is_marlin_format=true: only the plain GPTQ layout is supported")
    spec.checkpoint_format = fmt
    spec.desc_act = bool(cfg.get("desc_act", False))
    spec.sym = bool(cfg.get("sym", True))
    spec.lm_head = bool(cfg.get("lm_head", False))
    quantizer = (cfg.get("meta") or {}).get("quantizer") or []
    if isinstance(quantizer, str):
        quantizer = [quantizer]
    spec.word_wise_zeros = any("gptqmodel:" in str(q) for q in quantizer)
    return spec


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name!r}: expected shape {shape}, found {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"tensor {name!r}: expected dtype {dtypes[0]}, found {t.dtype}")


# ----------------------------------------------------------------------------------- GPTQ


def gptq_unpack(
    qweight: torch.Tensor, qzeros: torch.Tensor, *, v2: bool = False, word_wise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ `qweight [K/8, N]`, `qzeros [G, N/8]` -> (codes `[K, N]`, zero-points `[G, N]`).

    v1 stores `zero - 1`: decoded nibble-wise `(n + 1) & 15` (AutoGPTQ), or word-wise
    `(word + 0x11111111) mod 2^32` when GPTQModel wrote it (`word_wise`)."""
    return unpack_nibbles(qweight, 0), gptq_zeros(qzeros, v2=v2, word_wise=word_wise)


def gptq_zeros(qzeros: torch.Tensor, *, v2: bool = False, word_wise: bool = False
               ) -> torch.Tensor:
    """GPTQ `qzeros [G, N/8]` -> zero-points `[G, N]` (see `gptq_unpack`)."""
    if v2:
        return unpack_nibbles(qzeros, 1)
    if word_wise:
        words = (qzeros.to(torch.int64) + GPTQ_V2_DELTA) & 0xFFFFFFFF
        return unpack_nibbles(_to_int32(words), 1)
    return (unpack_nibbles(qzeros, 1) + 1) & 0xF


def gptq_pack(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes `[K, N]`, zero-points `[G, N]`) -> GPTQ v1 (`qweight`, `qzeros`).

    Stores `(zero - 1) & 15` per nibble: a zero-point of 0 becomes nibble 0xF, which every
    nibble-wise reader decodes back to 0 (no bleed into the neighbours, unlike AutoGPTQ)."""
    return pack_nibbles(codes, 0), pack_nibbles((zeros.to(torch.int64) - 1) & 0xF, 1)


def gptq_to_int4(
    prefix: str,
    tensors: dict[str, torch.Tensor],
    spec: QuantSpec,
    in_features: int,
    out_features: int,
) -> Int4Weight:
    """Check a GPTQ layer's tensors (`<prefix>.qweight`, ...) and convert them."""
    k, n = in_features, out_features
    gs = k if spec.group_size == -1 else spec.group_size
    groups = -(-k // gs)
    ints = (torch.int32,)
    floats = (torch.float16, torch.bfloat16, torch.float32)
    _check(f"{prefix}.qweight", tensors["qweight"], (k // 8, n), ints)
    _check(f"{prefix}.qzeros", tensors["qzeros"], (groups, n // 8), ints)
    _check(f"{prefix}.scales", tensors["scales"], (groups, n), floats)
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        _check(f"{prefix}.g_idx", g_idx, (k,), (torch.int32, torch.int64))
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"tensor '{prefix}.g_idx': values must lie in 0..{groups - 1}")
    zeros = gptq_zeros(tensors["qzeros"], v2=spec.checkpoint_format == "gptq_v2",
                       word_wise=spec.word_wise_zeros)
    scales = tensors["scales"]  # GPTQ's qweight is the internal layout already
    return from_packed(tensors["qweight"], scales, zeros.to(scales.dtype), gs, g_idx)


# ------------------------------------------------------------------------------------ AWQ


def awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM `qweight [K, N/8]`, `qzeros [G, N/8]` -> (codes `[K, N]`, zeros `[G, N]`)."""
    return unpack_nibbles(qweight, 1, AWQ_ORDER), unpack_nibbles(qzeros, 1, AWQ_ORDER)


def awq_pack(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes `[K, N]`, zeros `[G, N]`) -> AWQ GEMM (`qweight`, `qzeros`), interleaved."""
    return pack_nibbles(codes, 1, AWQ_ORDER), pack_nibbles(zeros, 1, AWQ_ORDER)


def awq_to_int4(
    prefix: str,
    tensors: dict[str, torch.Tensor],
    spec: QuantSpec,
    in_features: int,
    out_features: int,
) -> Int4Weight:
    """Check an AWQ GEMM layer's tensors and convert them."""
    k, n, gs = in_features, out_features, spec.group_size
    if k % gs:
        raise ValueError(f"{prefix}: in_features {k} is not a multiple of group_size {gs} (AWQ)")
    ints = (torch.int32,)
    floats = (torch.float16, torch.bfloat16, torch.float32)
    _check(f"{prefix}.qweight", tensors["qweight"], (k, n // 8), ints)
    _check(f"{prefix}.qzeros", tensors["qzeros"], (k // gs, n // 8), ints)
    _check(f"{prefix}.scales", tensors["scales"], (k // gs, n), floats)
    zeros = unpack_nibbles(tensors["qzeros"], 1, AWQ_ORDER)
    scales = tensors["scales"]
    return from_packed(awq_to_internal(tensors["qweight"]), scales, zeros.to(scales.dtype), gs)


# ----------------------------------------------------------------------------------- GGUF

GGUF_BLOCK = 32


def gguf_q4_to_int4(kind: str, data: np.ndarray | bytes, out_features: int, in_features: int) -> Int4Weight:
    """GGUF Q4_0 / Q4_1 / Q4_K bytes of a `[out, in]` weight -> `Int4Weight` (group size 32),
    the same values (see `localpaged.quant.ggml_int4`). Q4_0: `w = (q - 8) * d`; Q4_1:
    `w = q * d + m`, zero-point `-m / d`; a constant block (`d == 0`) gets codes 0, scale `m`,
    zero-point -1."""
    from localpaged.quant.ggml_int4 import int4_parts

    raw = np.frombuffer(bytes(data) if isinstance(data, bytes) else data.tobytes(), dtype=np.uint8)
    try:
        codes, scales, zeros = int4_parts(kind, raw, out_features, in_features)
    except ValueError as exc:
        raise ValueError(f"GGUF {kind} [{out_features}, {in_features}]: {exc}") from None
    return from_codes(torch.from_numpy(codes.T.astype(np.int32)),
                      torch.from_numpy(np.ascontiguousarray(scales.T)),
                      torch.from_numpy(np.ascontiguousarray(zeros.T)), GGUF_BLOCK)
