"""The `models.toml` catalog: the short names users type, and where each model comes from."""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from localpaged.store.paths import check_name, is_repo_id, user_catalog_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError as exc:
        raise ImportError("localpaged on Python 3.10 needs `pip install tomli`") from exc

# Catalog format -> the weight format the loaders see.
FORMATS = {"bf16": "safetensors", "fp16": "safetensors", "fp32": "safetensors",
           "safetensors": "safetensors", "awq": "awq", "gptq": "gptq", "gguf": "gguf"}


@dataclass(frozen=True)
class CatalogEntry:
    """One model users can name: its hub source (and an optional PyPI fallback)."""

    name: str
    repo: str
    revision: str = "main"
    format: str = "safetensors"
    file: str | None = None
    context_length: int | None = None
    chat_template: str | None = None
    description: str = ""
    size: str = ""
    pypi: str | None = None
    pypi_file: str | None = None

    @property
    def weight_format(self) -> str:
        """"safetensors", "awq", "gptq" or "gguf"."""
        return FORMATS[self.format]


def shipped_catalog_path() -> Path:
    """The catalog inside the installed package."""
    return Path(str(resources.files("localpaged") / "data" / "models.toml"))


def _parse(path: Path) -> dict[str, CatalogEntry]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ValueError(f"{path}: [models] must be a table of named entries")
    known = {f.name for f in fields(CatalogEntry)} - {"name"}
    out: dict[str, CatalogEntry] = {}
    for name, raw in models.items():
        where = f"{path}: entry {name!r}"
        try:
            check_name(name)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not isinstance(raw, dict) or "repo" not in raw:
            raise ValueError(f"{where}: needs at least `repo = \"org/name\"`")
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        entry = CatalogEntry(name=name, **_typed(raw, where))
        try:
            check_name(entry.repo)
        except ValueError as exc:
            raise ValueError(f"{where}: repo: {exc}") from None
        if not is_repo_id(entry.repo):
            raise ValueError(f"{where}: repo must be a hub id like \"org/name\", got {entry.repo!r}")
        if entry.pypi_file and (entry.pypi_file.startswith("/") or ".." in entry.pypi_file):
            raise ValueError(f"{where}: pypi_file must be a path inside the wheel")
        if entry.format not in FORMATS:
            raise ValueError(f"{where}: format {entry.format!r} is not one of {sorted(FORMATS)}")
        if entry.format == "gguf" and not entry.file:
            raise ValueError(f"{where}: format gguf needs `file = \"NAME.gguf\"`")
        out[name] = entry
    return out


def _typed(raw: dict[str, Any], where: str) -> dict[str, Any]:
    for key, value in raw.items():
        want = int if key == "context_length" else str
        if not isinstance(value, want) or isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be a {want.__name__}, got {value!r}")
    return raw


def load_catalog(user_path: Path | None = None) -> dict[str, CatalogEntry]:
    """The shipped catalog with the user's entries merged over it (same name: the user's wins)."""
    catalog = _parse(shipped_catalog_path())
    user = user_path or user_catalog_path()
    if user.is_file():
        catalog.update(_parse(user))
    return catalog


def closest_names(name: str, candidates: list[str], n: int = 3) -> list[str]:
    """The candidates most like `name`, best first (difflib), for "did you mean" errors."""
    lowered = {c.lower(): c for c in candidates}
    query = name.lower()
    hits = difflib.get_close_matches(query, list(lowered), n=2 * n, cutoff=0.5)

    def score(c: str) -> float:  # similarity, plus a bonus for a long shared beginning
        prefix = next((i for i, (a, b) in enumerate(zip(query, c)) if a != b), min(len(query), len(c)))
        return difflib.SequenceMatcher(None, query, c).ratio() + 0.5 * prefix / max(len(query), 1)

    hits = sorted(hits, key=score, reverse=True)[:n]
    if not hits:  # `smollm2` vs `smollm2:135m`: try the part before the tag
        stem = name.lower().split(":")[0]
        hits = [c for c in lowered if c.split(":")[0] == stem][:n]
    return [lowered[h] for h in hits]
