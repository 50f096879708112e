"""W4A16 benchmarks.

1. One 7B (Llama-2-7B) layer's linears at decode (M=1) and prefill (M=128) shapes: the CPU
   int4 path (`aten._weight_int4pack_mm_for_cpu`, bf16 activations) vs dense bf16 and fp32
   matmuls, plus the dequantize-then-matmul alternative.
2. Whole-model greedy decode tokens/s on SmolLM2-135M: our model with int4 (group 64) vs
   bf16 dense weights, batch 1.
3. With CUDA: the Triton W4A16 kernel vs torch fp16 matmul on the shapes of (1).

    python benchmarks/w4a16.py [--smollm DIR] [--skip-layers] [--skip-model] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from localpaged.quant.layout import from_codes
from localpaged.quant.linear import QuantLinear

SHAPES_7B = {"qkv/o (4096x4096)": (4096, 4096), "gate/up (4096->11008)": (4096, 11008),
             "down (11008->4096)": (11008, 4096)}


def timeit(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_int4(k: int, n: int, gs: int = 128, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // gs, n, generator=g) * 0.01).to(dtype)
    zeros = torch.full((k // gs, n), 8.0, dtype=dtype)
    return from_codes(codes, scales, zeros, gs)


def bench_layers(rows: tuple[int, ...]) -> None:
    print(f"\n## CPU: 7B linears, ms per call ({torch.get_num_threads()} threads)\n")
    print("| layer | M | int4 (bf16 act) | dense bf16 | dense fp32 | dequant+bf16 mm | int4 vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, (k, n) in SHAPES_7B.items():
        w = random_int4(k, n)
        layer = QuantLinear.from_int4(w, None, torch.bfloat16, "cpu")
        dense = w.dequantize(torch.bfloat16)
        dense32 = dense.float()
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            x32 = x.float()
            reps = 10 if m == 1 else 3
            t_int4 = timeit(lambda x=x, f=layer: f(x), reps)
            t_bf16 = timeit(lambda x=x, d=dense: x @ d.t(), reps)
            t_fp32 = timeit(lambda x=x32, d=dense32: x @ d.t(), reps)
            t_deq = timeit(lambda x=x, w=w: x @ w.dequantize(torch.bfloat16).t(), 2)
            print(f"| {name} | {m} | {t_int4 * 1e3:.2f} | {t_bf16 * 1e3:.2f} | {t_fp32 * 1e3:.2f} "
                  f"| {t_deq * 1e3:.1f} | {t_bf16 / t_int4:.2f}x |")


def rtn_checkpoint(src: Path, out: Path, gs: int = 64) -> Path:
    """A round-to-nearest int4 (AWQ GEMM format) SmolLM2: speed does not depend on quality."""
    from transformers import AutoModelForCausalLM

    from localpaged.quant.awq import awq_quantize
    from localpaged.quant.writer import save_quantized

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layers = {}
    for name, mod in model.model.layers.named_modules():
        if isinstance(mod, torch.nn.Linear):
            layers[f"model.layers.{name}"] = awq_quantize(mod.weight.data, gs)
    return save_quantized(model, layers, out, "awq", gs, source=src)


def decode_tok_s(folder: Path, dtype: str, steps: int = 64, prompt: int = 16) -> float:
    from localpaged.kernels import AttentionMetadata
    from localpaged.model.loader import load_model

    model, _ = load_model(folder, dtype=dtype)
    block = 16
    total = prompt + steps + 1
    caches = model.allocate_kv_caches(num_blocks=-(-total // block), block_size=block)
    table = torch.arange(-(-total // block), dtype=torch.int32).view(1, -1)

    def meta(start: int, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + n), block_tables=table,
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            max_query_len=n, max_seq_len=start + n)

    ids = torch.arange(10, 10 + prompt)
    h = model(ids, torch.arange(prompt), caches, meta(0, prompt))
    tok = model.compute_logits(h[-1:]).argmax(-1)
    t = time.perf_counter()
    for i in range(steps):
        pos = prompt + i
        h = model(tok, torch.tensor([pos]), caches, meta(pos, 1))
        tok = model.compute_logits(h).argmax(-1)
    return steps / (time.perf_counter() - t)


def bench_model(src: Path) -> None:
    print(f"\n## CPU: SmolLM2-135M greedy decode, batch 1 ({torch.get_num_threads()} threads)\n")
    with tempfile.TemporaryDirectory() as tmp:
        q = rtn_checkpoint(src, Path(tmp) / "int4")
        dense = decode_tok_s(src, "bf16")
        int4 = decode_tok_s(q, "bf16")
        dense32 = decode_tok_s(src, "float32")
    print("| weights | tokens/s |\n|---|---|")
    print(f"| dense fp32 | {dense32:.1f} |\n| dense bf16 | {dense:.1f} |\n| int4 g64 (bf16 act) | {int4:.1f} |")


def bench_cuda() -> None:
    from localpaged.quant.triton_w4a16 import w4a16_matmul

    print("\n## CUDA: Triton W4A16 vs torch fp16 matmul, ms per call\n")
    print("| layer | M | triton w4a16 | torch fp16 | speed-up |\n|---|---|---|---|---|")
    for name, (k, n) in SHAPES_7B.items():
        w = random_int4(k, n, dtype=torch.float16).to("cuda", torch.float16)
        dense = w.dequantize(torch.float16)
        for m in (1, 16, 128, 1024):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")

            def run_t(x=x, w=w):
                w4a16_matmul(x, w.qweight, w.scales, w.zeros, w.group_size)
                torch.cuda.synchronize()

            def run_d(x=x, d=dense):
                x @ d.t()
                torch.cuda.synchronize()

            tt, td = timeit(run_t, 50, 5), timeit(run_d, 50, 5)
            print(f"| {name} | {m} | {tt * 1e3:.3f} | {td * 1e3:.3f} | {td / tt:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm", type=Path,
                    default=Path.home() / ".cache" / "localpaged-tests" / "smollm2-135m-hf")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if not args.skip_layers:
        bench_layers(tuple(args.rows))
    if not args.skip_model and (args.smollm / "config.json").exists():
        bench_model(args.smollm)
    if torch.cuda.is_available():
        bench_cuda()


if __name__ == "__main__":
    main()
