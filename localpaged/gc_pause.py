"""Python's cyclic garbage collector paused where a start-up makes many long-lived objects.

Importing torch makes ~250k objects the collector tracks, and a model load thousands more;
each full collection on the way walks all of them (0.01-0.08 s each, three or four of them
between a fresh process and its first token: a sixth of a 1B model's time to it on a 2-core
machine). None of it is garbage worth looking for: modules live as long as the process, a
model as long as it is loaded.

- `collector_paused()`: no collections inside (a model load); afterwards the collector runs
  as before, so an unloaded model's cycles are collected as usual.
- `pause_while_torch_imports()`: the first `import torch` after it runs with the collector
  paused, and what exists then (modules, torch's own objects) is frozen out of every later
  collection (`gc.freeze`). The few thousand cycles torch's import leaves unreachable (~1 MB)
  stay, once.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any


@contextlib.contextmanager
def collector_paused(*, freeze: bool = False) -> Iterator[None]:
    """No cyclic collections inside the block (reference counting still frees objects); with
    `freeze`, what exists at its end is then frozen out of later collections."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:  # before enabling: every object made meanwhile is in the youngest
            gc.freeze()  # generation, and the next allocation would walk them all
        if was_enabled:
            gc.enable()


class _PausedLoader:
    """Runs the wrapped loader's `exec_module` with the collector paused, then freezes."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # torch sees its own loader, as without this
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        with collector_paused(freeze=True):
            self.loader.exec_module(module)


class _TorchFinder:
    """A meta path finder that answers only for `torch` (imported once: no other call
    follows), with the path finder's spec under a `_PausedLoader`. It stays in `sys.meta_path`
    (removing it while the import system walks that list would skip the next finder)."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PausedLoader(spec.loader)
        return spec


def pause_while_torch_imports() -> None:
    """Make the first `import torch` (if torch is not imported yet) run with the collector
    paused, and freeze what exists once it is done."""
    if "torch" not in sys.modules and _TorchFinder not in sys.meta_path:
        sys.meta_path.insert(0, _TorchFinder)
