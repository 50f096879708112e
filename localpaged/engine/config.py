"""Engine arguments (names follow vLLM's where they exist)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineArgs:
    """How to load the model and size the engine.

    kv_cache_gb: memory for KV blocks (default: on the CPU a quarter of the memory available
    after the weights, taken as used; on CUDA 40% of free memory);
    num_kv_blocks overrides it with an exact block count (tests use tiny pools).
    max_step_ms: the time a step carrying decodes may take, so that a long prompt being read
    does not stall the chats that are streaming (see engine/step_bound.py): None (default)
    about 2 x what the decodes alone cost, learned as the engine runs, and at least 100 ms;
    0 no bound.
    kv_cache_dtype: the KV cache's element type: "auto" (default) the model's, but float16 for a
    float32 model on the CPU (see `LlamaForCausalLM.kv_cache_dtype`), or "float32", "bfloat16",
    "float16" (tests pin a float32 model's cache to float32 to compare it exactly).
    """

    model: str
    dtype: str = "auto"
    device: str | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_gb: float | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_step_ms: float | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected one of "
                                 f"{', '.join(_DTYPES)}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid: expected >= 1")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb} is invalid: expected > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid: expected >= 2")
        if self.max_step_ms is not None and not self.max_step_ms >= 0:
            raise ValueError(f"max_step_ms={self.max_step_ms} is invalid: expected >= 0 "
                             "(0: no bound; unset: automatic)")

    def resolved_kv_cache_dtype(self, model: Any, device: torch.device) -> torch.dtype:
        """The KV cache's element type for `model` on `device` (see kv_cache_dtype)."""
        if self.kv_cache_dtype == "auto":
            return model.kv_cache_dtype(device)
        return getattr(torch, self.kv_cache_dtype)

    def resolved_device(self) -> str:
        if self.device:
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_kv_cache_gb(self) -> float:
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb
        if self.resolved_device().startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            return 0.4 * free / 2**30
        available = available_memory()
        if available is None:
            return CPU_KV_FALLBACK_GB
        return max(CPU_KV_MIN_GB, CPU_KV_SHARE * available / 2**30)


# The CPU's KV pool: this share of the memory available once the weights are in. Its pages
# are taken as they are written (see LlamaForCausalLM.allocate_kv_caches), so the share is
# what the cache may grow to (many chats, long prefix-cache history), not what it takes at
# start; a quarter leaves the rest of the machine to the user's other programs.
CPU_KV_SHARE = 0.25
CPU_KV_MIN_GB = 0.25
CPU_KV_FALLBACK_GB = 1.0  # where the available memory cannot be read


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux MemAvailable; else the free
    physical pages), or None where neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
