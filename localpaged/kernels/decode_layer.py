"""Decode steps of a 4-bit Llama-family model on the CPU through one C call per layer
(`cpu/decode_layer.c`): norms, 4-bit matmuls, rotary, KV write, paged attention and the MLP,
with no torch op in between. For a small model the some sixty torch ops of a layer cost more
than its matmuls; this path leaves the matmuls and little else.

`CpuDecodePlan.build(model)` returns a plan when every layer qualifies (bf16 or float32, fused
q/k/v and gate/up on the own 4-bit kernel, or int8 blocks: GGUF types without a 4-bit kernel,
or the 6-bit layout, or parts of such kinds joined side by side); the model runs
decode rows through `plan.run` (a decode-only step whole, the decode rows of a mixed step as a
sub-batch) and prompt chunks through its modules.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from localpaged.kernels import native
from localpaged.kernels.attention import AttentionMetadata
from localpaged.kernels.attention_cpu import MAX_HEAD_DIM, MAX_QUERY_HEADS_PER_KV_HEAD

DTYPES = (torch.bfloat16, torch.float32)  # the kernel's builds: the model's activations and KV


class _W4(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("sb", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("k", ctypes.c_int), ("n", ctypes.c_int), ("group_size", ctypes.c_int),
                ("codes8", ctypes.c_void_p), ("scales8", ctypes.c_void_p),
                ("offsets8", ctypes.c_void_p), ("block8", ctypes.c_int), ("half8", ctypes.c_int),
                ("quads", ctypes.c_int),
                ("high", ctypes.c_void_p), ("zero_point", ctypes.c_int),
                ("perm", ctypes.c_void_p), ("parts", ctypes.c_void_p), ("n_parts", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _W4), ("o", _W4), ("gate_up", _W4), ("down", _W4),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in (
        "batch", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size",
        "table_stride", "threads")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("slots", ctypes.c_void_p),
        ("tables", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
        ("kv_half", ctypes.c_int)]


def _int8_blocks(linear: Any, dtype: torch.dtype) -> _W4 | None:
    """The C view of a Q8Linear (int8 blocks), or None."""
    from localpaged.quant.q8_linear import Q8Linear

    if not isinstance(linear, Q8Linear):
        return None
    bias, offsets = linear.bias, linear.tile_offsets
    if bias is not None and bias.dtype != dtype:
        # The layer adds its bias in the model's dtype (a copy of a few KiB, kept by the layer).
        linear.plan_bias = bias.to(dtype).contiguous()
        bias = linear.plan_bias
    if bias is not None and not bias.is_contiguous():
        return None
    return _W4(None, None, bias.data_ptr() if bias is not None else None, linear.in_features,
               linear.out_features, 0, linear.tiles.data_ptr(), linear.tile_scales.data_ptr(),
               offsets.data_ptr() if offsets is not None else None, linear.block,
               int(linear.tile_scales.dtype == torch.float16))


def _six_bit(linear: Any, dtype: torch.dtype) -> _W4 | None:
    """The C view of a W6Linear (the 6-bit layout), or None."""
    from localpaged.quant.w6_linear import W6Linear

    if not isinstance(linear, W6Linear):
        return None
    bias = linear.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    high = linear.high.data_ptr() if linear.high is not None else None
    return _W4(linear.packed.data_ptr(), linear.sb.data_ptr(),
               bias.data_ptr() if bias is not None else None, linear.in_features,
               linear.out_features, linear.group_size, quads=1, high=high,
               zero_point=linear.zero_point)


def _w4(linear: Any, dtype: torch.dtype) -> _W4 | None:
    """The C view of a QuantLinear on the own kernel (or of int8 blocks, or 6-bit), or None
    if it is none of them."""
    from localpaged.quant.joined_linear import JoinedLinear

    if isinstance(linear, JoinedLinear):
        views = [_w4(part, dtype) for part in linear.parts]
        if any(v is None for v in views):
            return None
        linear.plan_parts = (_W4 * len(views))(*views)  # kept alive by the layer
        return _W4(k=linear.in_features, n=linear.out_features,
                   parts=ctypes.addressof(linear.plan_parts), n_parts=len(views))
    if getattr(linear, "w4_packed", None) is None:
        return _int8_blocks(linear, dtype) or _six_bit(linear, dtype)
    bias = linear.bias
    if bias is not None and bias.dtype != linear.dtype:
        return None
    from localpaged.quant import cpu_w4

    k = linear.in_features
    quads = cpu_w4.is_quads(linear.w4_packed)
    if quads and not cpu_w4.quads_wanted(dtype):
        return None
    perm = None
    if linear.perm is not None:  # act-order GPTQ: the kernel gathers x in the weight's order
        linear.perm_i32 = linear.perm.to(torch.int32).contiguous()  # kept alive by the layer
        perm = linear.perm_i32.data_ptr()
    return _W4(linear.w4_packed.data_ptr(), linear.w4_sb.data_ptr(),
               bias.data_ptr() if bias is not None else None, k, linear.out_features,
               k // linear.w4_sb.shape[1], quads=int(quads), perm=perm)


class _Experts:
    """A mixture of experts between the native layer's calls: its router in torch, then every
    chosen expert's MLP in one C call (`moe_rows`), or the torch module where an expert's
    matrices are not of the kernel's kinds."""

    def __init__(self, module: Any, gate_up: Any = None, down: Any = None, inter: int = 0):
        self.module, self.gate_up, self.down, self.inter = module, gate_up, down, inter

    @classmethod
    def of(cls, module: Any, dtype: torch.dtype) -> _Experts:
        gate_up = [_w4(e.gate_up_proj, dtype) if e.gate_up_proj is not None else None
                   for e in module.experts]
        down = [_w4(e.down_proj, dtype) for e in module.experts]
        if any(v is None for v in gate_up + down):
            return cls(module)
        n = len(module.experts)
        return cls(module, (_W4 * n)(*gate_up), (_W4 * n)(*down), gate_up[0].n // 2)

    def run(self, x: torch.Tensor, fn: Any) -> torch.Tensor:
        if self.gate_up is None:
            return self.module(x)
        weights, chosen = self.module.route(x)
        chosen, order = chosen.sort(dim=-1)  # each row's experts in increasing order
        weights = weights.gather(-1, order).float().contiguous()
        chosen = chosen.to(torch.int32).contiguous()
        out = torch.empty_like(x)
        if fn(self.gate_up, self.down, chosen.data_ptr(), weights.data_ptr(), chosen.shape[1],
              x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], self.inter,
              torch.get_num_threads()):
            raise MemoryError("the CPU experts kernel could not allocate its scratch memory")
        return out


class CpuDecodePlan:
    """The C structs of a model's layers, built once; `run` does a decode step's layers."""

    def __init__(self, model: Any, layers: list[_Layer],
                 experts: list[Any] | None = None) -> None:
        c = model.config
        # The layers side by side in one C array (each of `layers` a view into it), for
        # `decode_layers` to run them all in one call.
        self.array = (_Layer * len(layers))(*layers)
        self.layers = list(self.array)
        # per layer, its mixture of experts (run here between the C calls) or None
        self.experts = experts or [None] * len(layers)
        self.has_experts = any(e is not None for e in self.experts)
        self.model = model  # keeps the weights the structs point into alive
        self.shape = dict(hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, intermediate=c.intermediate_size)
        self.eps, self.scale = c.rms_norm_eps, c.head_dim**-0.5
        self.dtype = model.dtype
        suffix = "bf16" if model.dtype == torch.bfloat16 else "f32"
        self.fn = getattr(native.library(), f"decode_layer_{suffix}")
        self.all_fn = getattr(native.library(), f"decode_layers_{suffix}")
        self.moe_fn = getattr(native.library(), f"moe_rows_{suffix}")

    @classmethod
    def build(cls, model: Any) -> CpuDecodePlan | None:
        """A plan for `model` (a localpaged Llama model on the CPU), or None if any layer
        does not qualify or the kernel does not build here."""
        c = model.config
        if not getattr(model, "native_decode_supported", True):  # e.g. Gemma's norms and GeGLU
            return None
        if (model.dtype not in DTYPES or c.head_dim > MAX_HEAD_DIM or c.head_dim % 2
                or model.cos_sin.shape[-1] != c.head_dim  # partial rotary: not in the kernel
                or c.num_heads % c.num_kv_heads
                or c.num_heads // c.num_kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD
                or not native.available()):
            return None
        layers, experts = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = hasattr(mlp, "experts")  # its MLP runs in torch between the layer's calls
            if attn.qkv_proj is None or (not moe and getattr(mlp, "gate_up_proj", None) is None):
                return None  # q/k/v or gate/up apart
            views = [_w4(m, model.dtype) for m in (attn.qkv_proj, attn.o_proj)]
            views += [_W4(), _W4()] if moe else [_w4(m, model.dtype)
                                                 for m in (mlp.gate_up_proj, mlp.down_proj)]
            if any(v is None for v in views):
                return None
            experts.append(_Experts.of(mlp, model.dtype) if moe else None)
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3
                norms += [attn.q_norm.weight, attn.k_norm.weight]
            if any(w.dtype != model.dtype or not w.is_contiguous() for w in norms):
                return None
            head_norms = [w.data_ptr() for w in norms[2:]] or [None, None]
            layers.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), *views, None, None,
                                 *head_norms))
        return cls(model, layers, experts)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of the last layer for a decode-only step, or None when the
        caches are not in the form the kernel reads (contiguous, in the model's dtype or, under
        float32, float16)."""
        k0 = kv_caches[0][0]
        half = k0.dtype == torch.float16 and self.dtype == torch.float32
        if ((k0.dtype != self.dtype and not half) or not k0.is_contiguous()
                or hidden.device.type != "cpu"):
            return None
        x = hidden.to(self.dtype).contiguous().clone()
        residual = torch.empty_like(x)
        rows = cos_sin.index_select(0, positions).float().contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = _Step(batch=x.shape[0], block_size=k0.shape[1], table_stride=tables.shape[1],
                     threads=torch.get_num_threads(), eps=self.eps, scale=self.scale,
                     slots=slots.data_ptr(), tables=tables.data_ptr(), seq_lens=lens.data_ptr(),
                     cos_sin=rows.data_ptr(), kv_half=int(half), **self.shape)
        step_ref, x_ptr, r_ptr = ctypes.byref(step), x.data_ptr(), residual.data_ptr()
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        if not self.has_experts:
            if self.all_fn(step_ref, self.array, len(self.layers), x_ptr, r_ptr):
                raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
            return x, residual
        for i, layer in enumerate(self.layers):
            if self.fn(step_ref, ctypes.byref(layer), x_ptr, r_ptr, int(i == 0)):
                raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
            if (moe := self.experts[i]) is not None:  # x holds the experts' input
                x.copy_(moe.run(x, self.moe_fn))
        return x, residual
