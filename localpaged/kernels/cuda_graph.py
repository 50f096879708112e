"""CUDA graphs for the decode forward: capture once per batch size, replay with padding.

Engine-agnostic: `fn(**inputs)` is any forward whose tensor inputs all have the batch as their
first dim (input_ids, positions, slot_mapping, block_tables, seq_lens, ...) and that returns one
tensor with the batch first. `capture()` records `fn` on static buffers for each size in
`batch_sizes`; a call with n rows copies its inputs into the buffers, pads rows n..size-1 with
`pad_values` (slot -1: the KV write skips it; seq_len 0: the decode kernel returns zeros) and
replays the graph of the next captured size. `fn` must not depend on tensor values on the host
(no `.item()`), and must build its AttentionMetadata with a fixed `max_seq_len` (the engine's
max model length), since the decode kernel's split count is baked into the graph.

Switch off with `enabled=False` or `LOCALPAGED_CUDA_GRAPHS=0`: calls then run `fn` eagerly.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def padded_batch_size(n: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= n, or None when n is larger than all of them."""
    sizes = sorted(batch_sizes)
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graphs_enabled(enabled: bool = True) -> bool:
    """`enabled` unless the environment switches graphs off (LOCALPAGED_CUDA_GRAPHS=0)."""
    return enabled and os.environ.get("LOCALPAGED_CUDA_GRAPHS", "1") != "0"


class CudaGraphRunner:
    """Replays `fn` from CUDA graphs captured per batch size; eager where none fits."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        pad_values: Mapping[str, float] | None = None,
        enabled: bool = True,
    ) -> None:
        self.fn = fn
        self.batch_sizes = sorted(batch_sizes)
        self.pad_values = {"slot_mapping": -1, **(pad_values or {})}
        self.enabled = graphs_enabled(enabled)
        self.buffers: dict[str, torch.Tensor] = {}
        self.graphs: dict[int, Any] = {}  # batch size -> torch.cuda.CUDAGraph
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self, example: Mapping[str, torch.Tensor]) -> None:
        """Capture every batch size up to example's batch (its tensors are the buffer shapes:
        batch first, trailing dims at their maximum, e.g. block_tables [B, max_blocks])."""
        if not self.enabled:
            return
        max_batch = next(iter(example.values())).shape[0]
        self.batch_sizes = [b for b in self.batch_sizes if b <= max_batch]
        self.buffers = {k: v.clone() for k, v in example.items()}
        pool = None
        for size in reversed(self.batch_sizes):  # largest first: later ones reuse its pool
            graph, self.outputs[size] = self._capture_one(
                {k: v[:size] for k, v in self.buffers.items()}, pool)
            pool = graph.pool()
            self.graphs[size] = graph

    def _capture_one(self, args: dict[str, torch.Tensor], pool: object) -> tuple[Any, torch.Tensor]:
        """Warm `fn` up on a side stream (Triton compiles outside the capture), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fn(**args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.fn(**args)
        torch.cuda.synchronize()
        return graph, out

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        """fn(**inputs), replayed from the graph of the next captured batch size if any. The
        result is a view of the graph's static output: use it before the next call."""
        n = next(iter(inputs.values())).shape[0]
        size = padded_batch_size(n, self.graphs) if self.graphs else None
        if size is None:
            return self.fn(**inputs)
        for name, buf in self.buffers.items():
            x = inputs[name]
            buf[:size].fill_(self.pad_values.get(name, 0))
            buf[(slice(0, n), *(slice(0, s) for s in x.shape[1:]))].copy_(x)
        self.graphs[size].replay()
        return self.outputs[size][:n]
