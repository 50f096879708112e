"""`localpaged run`: stream one chat turn's answer to stdout (or print it as JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from localpaged.engine.config import EngineArgs
from localpaged.engine.engine import LLMEngine
from localpaged.engine.request import SamplingParams


def run(args: argparse.Namespace) -> int:
    """Answer args.prompt (or stdin) with the chat template applied."""
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("prompt is empty: pass it as an argument or on stdin")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    engine = LLMEngine.from_args(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb,
        kv_cache_dtype=args.kv_cache_dtype or "auto"))
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": prompt})
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    request = engine.add_request(ids, params)
    start = time.perf_counter()
    first = None
    text, tokens, reason = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = first or time.perf_counter()
            tokens.extend(out.new_token_ids)
            text.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                reason = out.finish_reason
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({
            "model": engine.info.name, "text": "".join(text), "token_ids": tokens,
            "finish_reason": reason,
            "usage": {"prompt_tokens": request.num_prompt_tokens,
                      "completion_tokens": len(tokens),
                      "total_tokens": request.num_prompt_tokens + len(tokens)},
            "ttft_s": round((first or time.perf_counter()) - start, 4),
            "elapsed_s": round(elapsed, 4)}))
    else:
        sys.stdout.write("\n")
    return 0
