"""A CPU model's weights moved into one block of memory backed by 2 MiB pages.

A decode step reads every weight once: 1 GB a token for a 1-2B model, in 4 KiB pages a
quarter of a million TLB entries, which the page walks behind the kernels' streams cost
(1.7B Q4_K_M on Sapphire Rapids, 2 cores: 21.5 tok/s with the weights as packed, 23.5 mapped
from the packed-weights file, whose page cache the kernel maps partly in 2 MiB folios, 25.4
in transparent huge pages). Linux gives anonymous memory huge pages where asked
(`madvise(MADV_HUGEPAGE)`, the default "madvise" mode of transparent_hugepage); elsewhere, or
where they are off, the weights stay where they are.

The move copies one tensor at a time and lets its source go right after (a packed tensor is
freed, a file-mapped one's pages dropped from the process), so the peak is the weights and one
tensor, not twice the weights.
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
TRIM_EVERY = 128 << 20  # bytes moved between returns of the freed sources to the system
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether anonymous memory can be asked for huge pages here (Linux, THP not "never")."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def _madvise(address: int, length: int, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice)  # advice only


def _drop_pages(storage: torch.UntypedStorage) -> None:
    """Drop the whole pages of a file-mapped storage from this process (they stay in the page
    cache; the storage is not read again)."""
    page = mmap.PAGESIZE
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _madvise(first, last - first, mmap.MADV_DONTNEED)


def move_weights(model: nn.Module, drop_sources: bool = False) -> int:
    """Move `model`'s large buffers and parameters (CPU) into one huge-page block, in place;
    `drop_sources`: they are file-mapped (the packed-weights cache), drop their pages after
    each copy. A storage held by several modules or tensors moves once. Returns the bytes
    moved (0: none)."""
    if not available():
        return 0
    # By storage: tensors viewing one storage (a tied weight, slices of one) move together,
    # as views of its one copy.
    holders: dict[int, list[tuple[dict, str, torch.Tensor]]] = {}
    for module in model.modules():
        for store in (module._buffers, module._parameters):
            for name, t in store.items():
                if t is not None and t.device.type == "cpu" and t.untyped_storage().nbytes() >= SMALLEST:
                    holders.setdefault(t.untyped_storage().data_ptr(), []).append((store, name, t))
    if not holders:
        return 0
    sizes = {key: -(-views[0][2].untyped_storage().nbytes() // 4096) * 4096
             for key, views in holders.items()}
    total = sum(sizes.values())
    # An anonymous mapping, each storage on a slice of it (a storage of its own: torch.save,
    # of the packed-weights cache, takes storages of one type each); the slices keep the
    # mapping alive while any tensor is.
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    start = (-address) % HUGE_PAGE  # from a 2 MiB boundary
    arena.madvise(mmap.MADV_HUGEPAGE, start, total)
    memory = memoryview(arena)
    at = trimmed = start
    for key in list(holders):
        views = holders.pop(key)
        source = views[0][2].untyped_storage()
        n = source.nbytes()
        copy = torch.frombuffer(memory[at:at + n], dtype=torch.uint8)
        copy.copy_(torch.empty(0, dtype=torch.uint8).set_(source))
        made: dict[int, torch.Tensor] = {}  # a tensor held twice stays one tensor
        for store, name, t in views:
            if id(t) not in made:
                moved = torch.empty(0, dtype=t.dtype).set_(copy.untyped_storage(),
                                                           t.storage_offset(), t.size(), t.stride())
                made[id(t)] = (nn.Parameter(moved, requires_grad=False)
                               if isinstance(t, nn.Parameter) else moved)
            store[name] = made[id(t)]
        if drop_sources:
            _drop_pages(source)
        del views, source, made  # a packed source is freed here, unless something else holds it
        at += sizes[key]
        if at - trimmed >= TRIM_EVERY:
            _return_freed_memory()
            trimmed = at
    _return_freed_memory()
    return total


def _return_freed_memory() -> None:
    """Give the heap's free memory back to the system (glibc keeps the freed sources of up to
    32 MiB each in its heap: 0.4 GiB of a 1.7B model's packing, resident for good)."""
    with contextlib.suppress(AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)
