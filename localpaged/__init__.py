"""localpaged: a local chat app whose chats share one model through a paged-KV engine."""

from __future__ import annotations

import importlib
from typing import Any

from localpaged.gc_pause import pause_while_torch_imports

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

pause_while_torch_imports()  # a tenth of a second off every start that loads a model


def __getattr__(name: str) -> Any:
    # Lazy so that `import localpaged` (the CLI) does not pay for torch before it needs it.
    # (by string, so the import graph does not make every room depend on the engine)
    homes = {"LLM": "localpaged.engine.llm", "SamplingParams": "localpaged.engine.request"}
    if name in homes:
        return getattr(importlib.import_module(homes[name]), name)
    raise AttributeError(name)
