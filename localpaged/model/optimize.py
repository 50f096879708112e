"""Make a loaded model fast for serving on its device, without changing what it computes
beyond rounding: fused projections everywhere; on the CPU in 16-bit, the matmul each batch
shape runs fastest on (see benchmarks/w4a16.py for the measurements behind the choices)."""

from __future__ import annotations

import os

import torch
from torch import nn

# Below this many rows (a decode step of a few requests) the int4 / int8 weight-only ops win:
# they read fewer bytes. From here on (prefill chunks, wide decode batches) a dense 16-bit
# matmul (AMX / AVX512-BF16 through oneDNN) is several times faster.
DENSE_MIN_ROWS = 16
# torch's int8 op for the lm_head wins up to a few rows only (measured cold, SmolLM2's
# 49152 x 576 head: 4.8 ms vs 11 ms at one row, even at eight rows, then slower). With the own
# kernel, the int8 head serves every batch (see Int8Linear).
INT8_HEAD_MAX_ROWS = 7
# Extra copies of 4-bit layers made for speed are kept only while they cost at most this much
# memory (small models, where the copy is cheap).
DENSE_COPY_LIMIT_GB = float(os.environ.get("LOCALPAGED_CPU_DENSE_GB", "1.0"))


def optimize_for_inference(model: nn.Module, device: torch.device) -> dict[str, int]:
    """Prepare `model` (a localpaged.model.llama model) for the engine. Returns what it did
    as counts, for logs and the engine's stats."""
    model.fuse_projections()
    done = {"dense_copies": 0, "dense_copy_bytes": 0, "int8_lm_head": 0, "int8_lm_head_bytes": 0,
            "single_row_copies": 0, "single_row_bytes": 0, "native_decode": 0}
    if device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return done
    from localpaged.quant.int8_linear import Int8Linear
    from localpaged.quant.linear import QuantLinear
    from localpaged.quant.q8_linear import Q8Linear
    from localpaged.quant.w6_linear import W6Linear

    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not any(isinstance(m, (QuantLinear, W6Linear, Q8Linear)) for m in model.modules()):
        return done  # a 16-bit checkpoint stays as it is: nothing to trade
    budget = DENSE_COPY_LIMIT_GB * 2**30
    from localpaged.kernels.decode_layer import CpuDecodePlan

    model.cpu_decode = CpuDecodePlan.build(model)
    done["native_decode"] = int(model.cpu_decode is not None)
    if model.dtype == torch.float32:
        return done  # float32 keeps the file's numbers: no int8 head, no 16-bit copies
    # Layers on the own kernel: torch's int4 op is a little faster for one row, so without the
    # native decode path (a lone chat's decode steps run the torch layers) its packing stays
    # beside it while that is cheap.
    own = [m for m in quantized if m.w4_packed is not None]
    torch_bytes = sum(m.cpu_packed.numel() + m.cpu_scale_zeros.numel() * m.cpu_scale_zeros.itemsize
                      for m in own if m.cpu_packed is not None)
    keep = model.cpu_decode is None and torch_bytes <= budget
    for m in own:
        m.keep_single_row_op(keep)
    if keep:
        kept = sum(m.cpu_packed is not None for m in own)
        done.update(single_row_copies=kept, single_row_bytes=torch_bytes if kept else 0)
    # Layers on torch's int4 op alone: a dense copy for wide batches, which that op is slow at.
    rest = [m for m in quantized if m.w4_packed is None]
    dense_bytes = sum(m.in_features * m.out_features * model.dtype.itemsize for m in rest)
    if rest and dense_bytes <= budget:
        for m in rest:
            m.keep_dense_copy(DENSE_MIN_ROWS)
        done.update(dense_copies=len(rest), dense_copy_bytes=dense_bytes)
    head = model.lm_head
    if type(head) is nn.Linear and head.bias is None:
        # The checkpoint's matrices are quantized already; its output layer in int8 per
        # channel is what llama.cpp runs too (GGUF files ship it as Q8_0 or Q6_K).
        model.lm_head = Int8Linear(head.weight, dense_min_rows=INT8_HEAD_MAX_ROWS + 1)
        int8 = model.lm_head
        extra = sum(t.numel() * t.element_size() for t in (int8.tiles, int8.q8_scales)
                    if t is not None)  # the own kernel's copy (and block scales) for batches
        done.update(int8_lm_head=1, int8_lm_head_bytes=head.weight.numel() + extra)
    return done


def describe(done: dict[str, int]) -> str | None:
    """One line saying what `optimize_for_inference` added to memory, or None."""
    parts = []
    if done["dense_copies"]:
        parts.append(f"bf16 copies of {done['dense_copies']} 4-bit layers for batches of "
                     f">= {DENSE_MIN_ROWS} rows (+{done['dense_copy_bytes'] / 2**20:.0f} MiB)")
    if done["single_row_copies"]:
        parts.append(f"torch's int4 packing of {done['single_row_copies']} 4-bit layers for "
                     f"one-row steps (+{done['single_row_bytes'] / 2**20:.0f} MiB)")
    if done["native_decode"]:
        parts.append("decode steps through the native layer kernel")
    if done["int8_lm_head"]:
        parts.append(f"an int8 lm_head for decode (+{done['int8_lm_head_bytes'] / 2**20:.0f} MiB)")
    return "; ".join(parts) or None
