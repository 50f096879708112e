"""How far each CPU kernel variant's log-probabilities are from float32, on the default model.

For every variant this CPU can execute (`LOCALPAGED_CPU_ISA`), in its own process, with torch's
own kernels held to the same class (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, so an AMX
machine computes what an AVX2 one would): SmolLM2-135M-Instruct Q4_1 in bf16, optimized for
serving as the engine does, runs the SmolLM2 chat prompt as one 28-token prefill; the
log-probabilities of each row are compared with the same GGUF run in float32 (its 4-bit
weights dequantized exactly). Printed per variant: the largest gap of the log-probability of
float32's top token (wide: the prefill's batched head; narrow: one row at a time, as decode
steps do), top-1 agreement, the same for torch's own ops (`LOCALPAGED_CPU_KERNELS=off`), and
for the kernels in float32 (the compute dtype of CPUs without native bf16).

    python benchmarks/kernel_accuracy.py [--gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHAT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 1780,
        314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # SmolLM2 chat prompt


def _worker(gguf: str, mode: str) -> dict:
    import torch

    from localpaged.kernels import AttentionMetadata
    from localpaged.model.loader import load_model
    from localpaged.model.optimize import optimize_for_inference

    def logprobs(model, rows_at_a_time: bool) -> torch.Tensor:
        n = len(CHAT)
        blocks = -(-n // 16)
        caches = model.allocate_kv_caches(num_blocks=blocks, block_size=16)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(blocks).view(1, -1).int(),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n,
            max_seq_len=n)
        hidden = model(torch.tensor(CHAT), torch.arange(n), caches, meta)
        if rows_at_a_time:
            logits = torch.cat([model.compute_logits(h[None]) for h in hidden])
        else:
            logits = model.compute_logits(hidden)
        return torch.log_softmax(logits.float(), -1)

    with torch.inference_mode():
        if mode == "reference":  # float32, the weights dequantized, torch's ops only
            model, _ = load_model(gguf, dtype="float32")
            return {"wide": logprobs(model, False).tolist()}
        model, _ = load_model(gguf, dtype=mode)
        optimize_for_inference(model, torch.device("cpu"))
        return {"wide": logprobs(model, False).tolist(), "narrow": logprobs(model, True).tolist(),
                "dtype": str(model.dtype)}


def _run(gguf: str, mode: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", mode, "--gguf", gguf],
                         env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gap(ref, got) -> tuple[float, float]:
    import torch

    ref, got = torch.tensor(ref), torch.tensor(got)
    top = ref.argmax(-1)
    gap = (got.gather(1, top[:, None]) - ref.gather(1, top[:, None])).abs().max().item()
    return gap, (got.argmax(-1) == top).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="the model (default: the test suite's cached SmolLM2 Q4_1)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    gguf = args.gguf or str(Path(os.environ.get(
        "LOCALPAGED_TEST_CACHE", Path.home() / ".cache" / "localpaged-tests"))
        / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if args.worker:
        print(json.dumps(_worker(gguf, args.worker)))
        return
    from cpu_class import describe_cpu, torch_env

    from localpaged.kernels import cpu_isa

    print(describe_cpu())
    ref = _run(gguf, "reference", {"LOCALPAGED_CPU_KERNELS": "off"})["wide"]
    print(f"\nlog-prob gap of float32's top token, max over the {len(CHAT)} rows of the chat "
          "prompt (and top-1 agreement)\n")
    print("| variant | bf16 kernels: prefill head | bf16 kernels: one-row head | "
          "bf16, torch ops only | float32 kernels |")
    print("|---|---|---|---|---|")
    for isa in cpu_isa.supported():
        env = {cpu_isa.ENV: isa, **torch_env(isa)}
        fast = _run(gguf, "bfloat16", env)
        plain = _run(gguf, "bfloat16", {**env, "LOCALPAGED_CPU_KERNELS": "off"})
        f32 = _run(gguf, "float32", env)
        cells = [_gap(ref, fast["wide"]), _gap(ref, fast["narrow"]), _gap(ref, plain["narrow"]),
                 _gap(ref, f32["narrow"])]
        print(f"| {isa} | " + " | ".join(f"{g:.3f} ({a:.0%})" for g, a in cells) + " |")


if __name__ == "__main__":
    main()
