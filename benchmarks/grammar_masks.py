"""Constrained decoding's cost: the two grammar libraries side by side, then the engine.

1. Per-token mask time of `xgrammar` and `llguidance` on the same JSON schema, walking the
   same token sequence, for the default model's vocabulary (SmolLM2, 49k) and a 151k one
   (Qwen's size: SmolLM2's tokens plus byte-level pairs of them, as a BPE vocabulary without
   merges), and each one's compile time.
2. The engine on the default model (its real Q4_1 GGUF, the defaults): the median decode-step
   time with 8 concurrent requests held to a schema against 8 free ones, same prompts.

    python benchmarks/grammar_masks.py [--gguf PATH] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                  "zip": {"type": "string", "maxLength": 10}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
TEXT = ('{"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], '
        '"address": {"city": "London", "zip": "W1"}}')


def default_gguf() -> Path:
    return Path.home() / ".cache" / "localpaged-tests" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizers_of(gguf: Path) -> dict[str, Any]:
    """The default model's HF tokenizer, and one with a 151k vocabulary built from it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    small = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    vocab = dict(small.get_vocab())
    tokens = sorted(vocab, key=vocab.get)
    i = 0
    while len(vocab) < 151_936:  # pairs of existing tokens until Qwen's size
        a, b = tokens[i % len(tokens)], tokens[(i // len(tokens) + 1) * 7919 % len(tokens)]
        vocab.setdefault(a + b, len(vocab))
        i += 1
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    big = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=small.eos_token)
    return {"49k (SmolLM2)": small, "151k (Qwen-sized)": big}


def per_token_xgrammar(tok: Any, ids: list[int]) -> tuple[float, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    t = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t)
        assert m.accept_token(token), "the walk left the grammar"
    return compile_s, statistics.median(times)


def per_token_llguidance(tok: Any, ids: list[int]) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok)
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for token in ids:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t)
        assert m.consume_token(token), m.get_error()
    return compile_s, statistics.median(times)


def engine_steps(gguf: Path, steps: int) -> dict[str, float]:
    """Median decode-step time, 8 constrained vs 8 free requests (the same prompts)."""
    from localpaged import LLM, SamplingParams
    from localpaged.engine.grammar import GrammarSpec

    llm = LLM(str(gguf))
    engine = llm.engine
    out = {}
    for label, grammar in (("free", None), ("constrained", GrammarSpec.json_schema(SCHEMA)),
                           ("free again", None)):
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=steps, ignore_eos=True,
                                grammar=grammar)
        for i in range(8):
            engine.add_request(f"Person number {i}, as JSON:", params)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            if len(outs) == 8 and all(len(o.new_token_ids) == 1 for o in outs):
                times.append(time.perf_counter() - t)  # decode steps of all 8
        out[label] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=default_gguf())
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from benchmarks.cpu_class import describe_cpu

    print(describe_cpu(), flush=True)
    print("\n## Mask per token (median over a schema-valid answer), compile\n")
    print("| vocabulary | xgrammar mask, us | xgrammar compile, ms | llguidance mask, us "
          "| llguidance compile, ms |")
    print("|---|---|---|---|---|")
    for name, tok in tokenizers_of(args.gguf).items():
        ids = tok.encode(TEXT, add_special_tokens=False)
        xc, xm = per_token_xgrammar(tok, ids)
        lc, lm = per_token_llguidance(tok, ids)
        print(f"| {name} | {xm * 1e6:.1f} | {xc * 1e3:.1f} | {lm * 1e6:.1f} | {lc * 1e3:.1f} |")
    print(f"\n## Engine, {args.gguf.name}, defaults: median decode step, 8 concurrent\n")
    res = engine_steps(args.gguf, args.steps)
    for label, ms in res.items():
        print(f"| {label} | {ms:.2f} ms |")
    base = (res["free"] + res["free again"]) / 2
    print(f"\nconstrained / free: {res['constrained'] / base:.3f}")


if __name__ == "__main__":
    main()
