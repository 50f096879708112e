"""What the UIs and the API show about a loaded model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelInfo:
    """What the UIs and the API show about the loaded model (Ollama's /api/show and /api/tags,
    the status line). Unknown values stay empty."""

    name: str
    architecture: str = "llama"  # e.g. "llama", "qwen2", "mistral"
    family: str = "llama"
    format: str = "safetensors"  # "safetensors" | "gguf" | "awq" | "gptq"
    quantization: str = "F32"  # e.g. "F16", "BF16", "Q4_1", "AWQ-4bit-g128"
    parameter_count: int = 0
    context_length: int = 0
    chat_template: str | None = None
    size_bytes: int = 0
    digest: str = ""
    device: str = "cpu"
    dtype: str = "float32"
