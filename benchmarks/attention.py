"""Paged decode attention (Triton, split-K) vs torch SDPA on contiguous K/V, same shapes.

Every request has the same context length so that SDPA can run on a plain [B, H, ctx, D]
tensor; the paged kernel reads the same keys and values through shuffled block tables.
Prints one row per shape: times, the paged kernel's KV read bandwidth and the max difference.

    python benchmarks/attention.py                 # on CUDA
    python benchmarks/attention.py --device cpu    # tiny shapes in the Triton interpreter
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (num_heads, num_kv_heads, head_dim): Llama-3-8B-like and SmolLM2-135M-like attention.
GPU_MODELS = [(32, 8, 128), (9, 3, 64)]
GPU_BATCHES = [1, 8, 32, 64]
GPU_CONTEXTS = [512, 2048, 8192]


def bench_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call (triton's do_bench on CUDA, a short loop on CPU)."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t) / 3 * 1e3


def run_shape(batch: int, ctx: int, hq: int, hkv: int, d: int, block_size: int,
              dtype: torch.dtype, device: str) -> dict[str, float]:
    """Time both implementations on one shape; returns the table row's numbers."""
    from localpaged.kernels.attention import AttentionMetadata
    from localpaged.kernels.attention_decode import paged_decode_attention

    nb = -(-ctx // block_size)
    num_blocks = batch * nb + 1
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device)[: batch * nb].view(batch, nb)
    tables = tables.to(torch.int32)
    query = torch.randn(batch, hq, d, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
        block_tables=tables, seq_lens=seq_lens,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=ctx)
    scale = d**-0.5
    # The same K/V, contiguous: [B, Hkv, ctx, D].
    k = k_cache[tables.long()].view(batch, nb * block_size, hkv, d)[:, :ctx]
    v = v_cache[tables.long()].view(batch, nb * block_size, hkv, d)[:, :ctx]
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    q4 = query.view(batch, hq, 1, d)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=hq != hkv)

    def paged() -> torch.Tensor:
        return paged_decode_attention(query, k_cache, v_cache, meta, scale)

    diff = (paged().float() - sdpa().view(batch, hq, d).float()).abs().max().item()
    t_paged, t_sdpa = bench_ms(paged, device), bench_ms(sdpa, device)
    kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
    return dict(paged=t_paged, sdpa=t_sdpa, gbps=kv_bytes / t_paged / 1e6, diff=diff)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        models, batches, contexts = [(4, 2, 64)], [2], [40]
    else:
        models, batches, contexts = GPU_MODELS, GPU_BATCHES, GPU_CONTEXTS
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    print(f"paged decode attention vs SDPA (contiguous K/V) on {name}, {args.dtype}, "
          f"block size {args.block_size}")
    print(f"{'Hq/Hkv/D':>10} {'batch':>5} {'ctx':>6} {'paged ms':>9} {'sdpa ms':>9} "
          f"{'speedup':>7} {'KV GB/s':>8} {'max diff':>9}")
    for hq, hkv, d in models:
        for batch in batches:
            for ctx in contexts:
                r = run_shape(batch, ctx, hq, hkv, d, args.block_size, dtype, args.device)
                print(f"{f'{hq}/{hkv}/{d}':>10} {batch:>5} {ctx:>6} {r['paged']:>9.3f} "
                      f"{r['sdpa']:>9.3f} {r['sdpa'] / r['paged']:>6.2f}x {r['gbps']:>8.1f} "
                      f"{r['diff']:>9.2e}")


if __name__ == "__main__":
    main()
