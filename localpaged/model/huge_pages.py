"""A CPU model's weights moved into one block of memory backed by 2 MiB pages.

A decode step reads every weight once: 1 GB a token for a 1-2B model, in 4 KiB pages a
quarter of a million TLB entries, which the page walks behind the kernels' streams cost
(1.7B Q4_K_M on Sapphire Rapids, 2 cores: 21.5 tok/s with the weights as packed, 23.5 mapped
from the packed-weights file, whose page cache the kernel maps partly in 2 MiB folios, 25.4
in transparent huge pages). Linux gives anonymous memory huge pages where asked
(`madvise(MADV_HUGEPAGE)`, the default "madvise" mode of transparent_hugepage); elsewhere, or
where they are off, the weights stay where they are.

Only weights move: a model's derived tables (buffers registered non-persistent: the rotary
table, float32 for every position of the context, 32 MiB for Llama-3.2's 131072) are read a
row per position, where huge pages buy nothing, and moved they would be resident whole where
left in place (mapped from the packed-weights file) only the rows of positions used are (a
1B Q8_0 model's process at 1.39 GiB after the move, 1.36 without the table's).

The move copies one storage at a time and lets its source go right after (a packed tensor is
freed, a file-mapped one's pages dropped from the process), so the peak is the weights and a
step's worth, not twice the weights. The engine moves them while it is idle (`WeightMover`);
`LLM` at load.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
SMALLEST = 1 << 16  # tensors below this stay where they are (norms, biases)
STEP_BYTES = 32 << 20  # bytes a step of the engine's idle work moves
COPY_PIECE = 4 << 20  # a file-mapped source's pages are dropped after each piece this size
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether anonymous memory can be asked for huge pages here (Linux, THP not "never")."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with `nbytes` from a 2 MiB boundary on, asked for huge pages, and
    that boundary's offset in it (ordinary pages where the platform has no such advice)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    at = (-ctypes.addressof(ctypes.c_char.from_buffer(mapping))) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, at, nbytes)
    return mapping, at


def _madvise(address: int, length: int, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice)  # advice only


def _drop_pages(start: int, end: int) -> None:
    """Drop the whole pages within [start, end) of a file mapping from this process (they
    stay in the page cache; a later read maps them again)."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _madvise(first, last - first, mmap.MADV_DONTNEED)


class WeightMover:
    """Moves `model`'s large buffers and parameters (CPU) into one huge-page block, a piece
    at a time (`step`), in place: the engine moves them while it is idle, so that a load is
    not longer for it (first touches of fresh 2 MiB pages cost up to 1 s a GiB on a VM that
    hands free memory back to its host) and chats start at once. A storage held by several
    modules or tensors moves once; `drop_sources`: they are file-mapped (the packed-weights
    cache), their pages are dropped after each copy. Whatever points into the weights (the
    native decode plan) must be rebuilt after a step that moved something."""

    def __init__(self, model: nn.Module, drop_sources: bool = False) -> None:
        self.drop_sources = drop_sources
        # By storage: tensors viewing one storage (a tied weight, slices of one) move
        # together, as views of its one copy.
        self._holders: dict[int, list[tuple[dict, str, torch.Tensor]]] = {}
        for module in model.modules():
            derived = module._non_persistent_buffers_set
            for store in (module._buffers, module._parameters):
                for name, t in store.items():
                    if (t is not None and t.device.type == "cpu"
                            and not (store is module._buffers and name in derived)
                            and t.untyped_storage().nbytes() >= SMALLEST):
                        key = t.untyped_storage().data_ptr()
                        self._holders.setdefault(key, []).append((store, name, t))
        self._sizes = {key: -(-views[0][2].untyped_storage().nbytes() // 4096) * 4096
                       for key, views in self._holders.items()}
        self.total = sum(self._sizes.values())
        self._memory: memoryview | None = None
        self._at = 0

    @property
    def done(self) -> bool:
        return not self._holders

    def _arena(self) -> memoryview:
        # An anonymous mapping, each storage on a slice of it (a storage of its own:
        # torch.save, of the packed-weights cache, takes storages of one type each); the
        # slices keep the mapping alive while any tensor is.
        arena, self._at = huge_page_mapping(self.total)
        return memoryview(arena)

    def step(self, budget: int = STEP_BYTES) -> int:
        """Move storages until `budget` bytes moved (at least one); returns the bytes moved."""
        if self.done:
            return 0
        if self._memory is None:
            self._memory = self._arena()
        moved_bytes = 0
        while self._holders and moved_bytes < budget:
            key = next(iter(self._holders))
            views = self._holders.pop(key)
            source = views[0][2].untyped_storage()
            n = source.nbytes()
            copy = torch.frombuffer(self._memory[self._at:self._at + n], dtype=torch.uint8)
            whole = torch.empty(0, dtype=torch.uint8).set_(source)
            # A file-mapped source lets its pages go as each piece is copied: the peak is the
            # weights and a piece, not a whole storage more (a 1B model's embedding table,
            # 0.1 GiB, whose rows the first tokens had barely touched).
            piece = COPY_PIECE if self.drop_sources else max(n, 1)
            for at in range(0, n, piece):
                copy[at:at + piece].copy_(whole[at:at + piece])
                if self.drop_sources:
                    _drop_pages(source.data_ptr() + at, source.data_ptr() + min(n, at + piece))
            made: dict[int, torch.Tensor] = {}  # a tensor held twice stays one tensor
            for store, name, t in views:
                if store.get(name) is not t:  # replaced since: leave it
                    continue
                if id(t) not in made:
                    moved = torch.empty(0, dtype=t.dtype).set_(
                        copy.untyped_storage(), t.storage_offset(), t.size(), t.stride())
                    made[id(t)] = (nn.Parameter(moved, requires_grad=False)
                                   if isinstance(t, nn.Parameter) else moved)
                store[name] = made[id(t)]
            del views, source, whole, made  # a packed source is freed here, unless held elsewhere
            self._at += self._sizes.pop(key)
            moved_bytes += n
        _return_freed_memory()
        if self.done:
            self._memory = None  # the tensors keep the mapping
        return moved_bytes


def _return_freed_memory() -> None:
    """Give the heap's free memory back to the system (glibc keeps the freed sources of up to
    32 MiB each in its heap: 0.4 GiB of a 1.7B model's packing, resident for good)."""
    with contextlib.suppress(AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)
