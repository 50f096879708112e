"""Packed weights kept on disk between loads, so a GGUF model's second load maps its kernel
layout instead of repacking it.

Loading a GGUF on the CPU repacks every matrix into the kernels' tile layout and joins
q/k/v and gate/up (seconds for a 1-2B model, most of the time to the first token). The
result depends only on the file, the compute dtype, the kernel build (`cpu_isa`) and this
package's code, so after the first load it is written once to the cache folder, and later
loads memory-map it (`torch.load(mmap=True)`): the pages come from the page cache as the
kernels first read them, as llama.cpp maps its file.

- Key: the file's fingerprint, the dtype, the kernel variant, the package's own source
  (Python and C) and the `LOCALPAGED_*` settings; anything else is a new entry.
- Size: at most `LOCALPAGED_PACKED_CACHE_GB` (default 16) in all, least recently used
  entries removed first; `0` turns the cache off. Nothing is written when the disk would
  keep less than 2 GiB free.
- A damaged or unreadable entry is removed and the model is packed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ENV_GB = "LOCALPAGED_PACKED_CACHE_GB"
ENV_DIR = "LOCALPAGED_PACKED_CACHE_DIR"
DEFAULT_GB = 16.0
KEEP_FREE_BYTES = 2 * 2**30
FORMAT_VERSION = 1
PACKAGE = Path(__file__).resolve().parents[1]
# Settings that say where things are, not what a load computes: left out of the key.
_NOT_IN_KEY = {"LOCALPAGED_HOME", ENV_DIR, ENV_GB, "LOCALPAGED_KERNEL_CACHE",
               "LOCALPAGED_TEST_CACHE", "LOCALPAGED_API_KEY"}
_code_hash: str | None = None
_writers: list[threading.Thread] = []


def limit_bytes() -> int:
    """The cache's size limit in bytes; 0 when it is off."""
    try:
        gb = float(os.environ.get(ENV_GB, DEFAULT_GB))
    except ValueError:
        gb = DEFAULT_GB
    return max(0, int(gb * 2**30))


def cache_dir() -> Path:
    """Where packed weights are kept (`LOCALPAGED_PACKED_CACHE_DIR` overrides)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("localpaged")) / "packed-weights"


def code_hash() -> str:
    """A hash of this package's Python and C source files (names, sizes, modification
    times: no reading of their text): a new version packs afresh."""
    global _code_hash
    if _code_hash is None:
        h = hashlib.sha256()
        files = []
        for folder, subfolders, names in os.walk(PACKAGE):
            subfolders[:] = [d for d in subfolders if d != "__pycache__"]
            files += [os.path.join(folder, n) for n in names if n.endswith((".py", ".c", ".h"))]
        for f in sorted(files):
            st = os.stat(f)
            h.update(f"{Path(f).relative_to(PACKAGE)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        _code_hash = h.hexdigest()
    return _code_hash


def entry_key(fingerprint: str, dtype: torch.dtype) -> str:
    """The cache key of a file (its fingerprint) loaded for `dtype` by this build."""
    from localpaged.kernels import cpu_isa, native

    settings = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith("LOCALPAGED_") and k not in _NOT_IN_KEY)
    ident = "|".join([str(FORMAT_VERSION), fingerprint, str(dtype), cpu_isa.chosen(),
                      str(native.available()), torch.__version__, code_hash(), repr(settings)])
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def entry_path(stem: str, key: str) -> Path:
    """`<file stem>-<code version>-<key>.pt`: a new version of the package drops the older
    versions' entries of the same file when it writes its own (see `save`)."""
    return cache_dir() / f"{stem}-{code_hash()[:8]}-{key}.pt"


def load(stem: str, key: str) -> Any | None:
    """The model saved under `key`, its tensors mapped from the file; None when there is
    none (or it cannot be read: then it is removed)."""
    if not limit_bytes():
        return None
    path = entry_path(stem, key)
    if not path.is_file():
        return None
    try:
        model = torch.load(path, mmap=True, weights_only=False)
    except Exception as exc:  # damaged, truncated, or from an incompatible build
        print(f"localpaged: the packed weights in {path} cannot be read ({exc}); packing "
              "again", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):
        now = time.time_ns()  # most recently used (the clock's own ns: the file system's
        os.utime(path, ns=(now, now))  # "now" may be a tick behind the last write)
    return model


def save_in_background(model: Any, stem: str, key: str, size: int) -> threading.Thread | None:
    """`save` on a thread of its own (writing a model's packed weights takes seconds; the
    writes leave the interpreter free), of a copy of the module tree made now, so that what
    the engine changes on `model` afterwards (its decode plan, an int8 output layer) is not
    in the file. The thread is not a daemon, whatever thread starts it (a thread started by
    a daemon, as the chat engine's loading thread is, is one by default: the interpreter's
    exit then stopped it mid-write, unwinding torch's C++ frames: abort, the file never
    written): a process that ends sooner waits for it.
    Returns the thread, or None when nothing is to be written."""
    if not limit_bytes() or size > limit_bytes():
        return None
    snapshot = module_tree_copy(model)
    thread = threading.Thread(target=save, args=(snapshot, stem, key, size),
                              name="localpaged-packed-cache", daemon=False)
    thread.start()
    _writers.append(thread)
    return thread


def writing() -> bool:
    """Whether a background write of this process is still going (its snapshot holds the
    packed tensors it writes)."""
    return any(thread.is_alive() for thread in _writers)


def wait_for_writes() -> None:
    """Wait until every background write of this process has ended."""
    while _writers:
        _writers.pop().join()


def module_tree_copy(module: torch.nn.Module,
                     memo: dict[int, torch.nn.Module] | None = None) -> torch.nn.Module:
    """A copy of `module` and its submodules (each one's attributes copied, shallowly; a
    submodule found twice copied once) that shares their tensors: replacing a submodule or
    an attribute of the original afterwards leaves the copy as it was."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    copy = object.__new__(type(module))
    memo[id(module)] = copy
    attrs = dict(module.__dict__)
    attrs["_parameters"] = dict(module._parameters)
    attrs["_buffers"] = dict(module._buffers)
    attrs["_modules"] = {name: None if child is None else module_tree_copy(child, memo)
                         for name, child in module._modules.items()}
    object.__setattr__(copy, "__dict__", attrs)
    return copy


def save(model: Any, stem: str, key: str, size: int) -> Path | None:
    """Write `model` (`size` bytes of tensors) under `key`, making room within the limit.
    Returns the path, or None when it was not written (off, too big, disk full: said on
    stderr, the load goes on)."""
    limit = limit_bytes()
    if not limit or size > limit:
        return None
    folder = cache_dir()
    path = entry_path(stem, key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"{stem}-*.pt"):  # this file packed by an older version
            if not old.name.startswith(f"{stem}-{code_hash()[:8]}-"):
                old.unlink(missing_ok=True)
        _evict(folder, limit - size)
        if shutil.disk_usage(folder).free < size + KEEP_FREE_BYTES:
            print(f"localpaged: not keeping packed weights for the next load: under "
                  f"{(size + KEEP_FREE_BYTES) / 2**30:.1f} GiB free in {folder}", file=sys.stderr)
            return None
        torch.save(model, tmp)
        os.replace(tmp, path)
        return path
    except Exception as exc:  # a full disk, no permission, an object that will not pickle
        print(f"localpaged: not keeping packed weights for the next load ({exc})",
              file=sys.stderr)
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def tensor_bytes(model: Any) -> int:
    """Bytes held by `model`'s parameters and buffers, each storage counted once (a tied
    embedding and output layer share theirs)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def entries() -> list[Path]:
    """The cache's entries, least recently used first."""
    folder = cache_dir()
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("*.pt") if p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _evict(folder: Path, budget: int) -> None:
    """Remove least recently used entries until the rest take at most `budget` bytes (and
    what a process that was killed while writing left behind)."""
    for tmp in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > 3600:
                tmp.unlink()
    kept = entries()
    total = sum(p.stat().st_size for p in kept)
    for p in kept:
        if total <= budget:
            break
        total -= p.stat().st_size
        p.unlink(missing_ok=True)
