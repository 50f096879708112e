"""Find and load a model for the engine: catalog names, HF folders and .gguf files."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localpaged.engine.client import ModelInfo
from localpaged.engine.config import EngineArgs


def _resolve(name: str) -> tuple[Path, str, Any]:
    """(path, display name, store entry or None) for a catalog name or a local path."""
    path = Path(name).expanduser()
    if path.exists():
        return path, path.name if path.is_dir() else path.stem, None
    from localpaged import store

    resolved = store.resolve(name, pull=True)
    return Path(resolved.path), resolved.name, resolved


def _dtype_reason(asked: str, chosen: Any, device: str) -> str:
    """Why the model computes in `chosen`, for the load line."""
    if asked != "auto":
        return f"dtype={asked} asked for"
    if str(device).startswith("cuda"):
        return "auto: the checkpoint's dtype on CUDA"
    from localpaged.model.loader import cpu_compute_dtype

    want, why = cpu_compute_dtype()
    if chosen != want:
        return "auto: the checkpoint is float32"
    return f"auto: {why}"


def load_model_parts(args: EngineArgs) -> tuple[Any, Any, Any, ModelInfo]:
    """(model module, ModelConfig, Tokenizer, ModelInfo) for args.model."""
    from localpaged.model.loader import load_inference_model as load_model

    path, name, entry = _resolve(args.model)
    device = args.resolved_device()
    print(f"localpaged: loading {name} on {device} ...", file=sys.stderr, flush=True)
    build_tokenizer: Callable[[Path], Any] | None = None
    if path.suffix == ".gguf":
        from localpaged.model.gguf_loader import tokenizer_from_gguf

        build_tokenizer = tokenizer_from_gguf
    elif any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from localpaged.model.tokenizer import Tokenizer

        build_tokenizer = Tokenizer.from_pretrained
    tokenizer = None
    if build_tokenizer is not None:
        from concurrent.futures import ThreadPoolExecutor

        # Built beside the weights: importing transformers and reading the vocabulary is
        # mostly Python, the weights mostly C (which leaves the interpreter free meanwhile).
        with ThreadPoolExecutor(1, thread_name_prefix="localpaged-tokenizer") as pool:
            job = pool.submit(build_tokenizer, path)
            model, config = load_model(path, dtype=args.dtype, device=device)
            tokenizer = job.result()  # its error, if any, after the weights' own
    else:
        model, config = load_model(path, dtype=args.dtype, device=device)
    print(f"localpaged: computing in {str(model.dtype).removeprefix('torch.')} "
          f"({_dtype_reason(args.dtype, model.dtype, device)})", file=sys.stderr, flush=True)
    fmt = "safetensors"
    if path.suffix == ".gguf":
        from localpaged.model.gguf_loader import open_gguf
        from localpaged.model.loader import gguf_int8, gguf_kept_types

        fmt = "gguf"
        kept = gguf_kept_types(model.dtype, device)
        print(f"localpaged: {name}: {open_gguf(path).load_summary(model.dtype, kept, gguf_int8(model.dtype, device))}",
              file=sys.stderr, flush=True)
    elif tokenizer is None:  # weights only (e.g. a test model): prompts must be token ids
        print(f"localpaged: {path} has no tokenizer; prompts must be token ids",
              file=sys.stderr)
    if entry is not None and getattr(entry, "chat_template_override", None):
        tokenizer.chat_template = entry.chat_template_override
    n_params = sum(p.numel() for p in model.parameters())
    size = path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.glob("*.safetensors"))
    info = ModelInfo(
        name=name, architecture=config.architecture.removesuffix("ForCausalLM").lower(),
        family=config.architecture.removesuffix("ForCausalLM").lower(),
        format=getattr(entry, "format", fmt) if entry is not None else fmt,
        parameter_count=n_params, context_length=config.max_position_embeddings,
        chat_template=tokenizer.chat_template if tokenizer else None, size_bytes=size)
    return model, config, tokenizer, info


def weights_bytes(model: Any) -> int:
    """Bytes held by `model`'s parameters and buffers, each storage counted once."""
    from localpaged.model.packed_cache import tensor_bytes

    return tensor_bytes(model)


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_line(weights: int, kv: int, kv_tokens: int, resident: int | None,
                kv_dtype: str) -> str:
    """What the loaded engine holds: weights, KV cache (its element type, and how many tokens
    it takes), and the rest of the process's resident memory (torch, tokenizer, buffers).
    `resident` is given on the CPU, where the KV pool's pages are taken as they are written:
    at load it holds none of them."""
    gib = 2**30
    if resident is None:
        return (f"memory: weights {weights / gib:.2f} GiB, KV cache {kv / gib:.2f} GiB "
                f"({kv_dtype}, {kv_tokens} tokens)")
    return (f"memory: weights {weights / gib:.2f} GiB, KV cache up to {kv / gib:.2f} GiB "
            f"({kv_dtype}, {kv_tokens} tokens, taken as used), other "
            f"{max(0, resident - weights) / gib:.2f} GiB (process {resident / gib:.2f} GiB)")
