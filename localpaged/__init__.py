"""localpaged: a local chat app whose chats share one model through a paged-KV engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from localpaged.engine.llm import LLM
    from localpaged.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import localpaged` (the CLI) does not pay for torch before it needs it.
    if name == "LLM":
        from localpaged.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from localpaged.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
