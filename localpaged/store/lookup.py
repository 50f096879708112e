"""`resolve`: turn whatever the user typed (a catalog name, an `org/repo` id, a registered
name, a folder or a .gguf file) into files on disk the loaders can read."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localpaged.store import registry
from localpaged.store.catalog import load_catalog
from localpaged.store.paths import check_name, is_repo_id
from localpaged.store.progress import ProgressFn, PullProgress, reporter
from localpaged.store.pulling import dir_size, pull_model, unknown_model
from localpaged.store.registry import RegisteredModel

if TYPE_CHECKING:
    from localpaged.model.gguf_loader import GGUFFile
    from localpaged.model.info import ModelInfo


class ModelNotPulledError(FileNotFoundError):
    """A known model that is not on disk yet."""


@dataclass
class ResolvedModel:
    """A model on disk. `path` is the HF folder, or the .gguf file itself for GGUF models."""

    name: str
    path: Path
    format: str  # "safetensors" | "gguf" | "awq" | "gptq"
    gguf_file: Path | None = None
    chat_template_override: str | None = None
    context_length: int | None = None
    source: str = "local"
    digest: str = ""
    size_bytes: int = 0

    def gguf(self) -> GGUFFile:
        """The opened GGUF file (opened once; GGUF models only)."""
        from localpaged.model.gguf_loader import open_gguf

        if self.gguf_file is None:
            raise ValueError(f"{self.name} is not a GGUF model")
        return open_gguf(self.gguf_file)

    def hf_config(self) -> dict[str, Any]:
        """The model's HF config dict (read from config.json, or built from GGUF metadata)."""
        if self.gguf_file is not None:
            return self.gguf().hf_config()
        path = self.path / "config.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read the model config ({exc})") from None

    def chat_template(self) -> str | None:
        """The override, else the template shipped with the model."""
        if self.chat_template_override:
            return self.chat_template_override
        if self.gguf_file is not None:
            return self.gguf().chat_template
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        for name in ("tokenizer_config.json", "chat_template.json"):
            p = self.path / name
            if p.is_file():
                try:
                    template = json.loads(p.read_text(encoding="utf-8")).get("chat_template")
                except ValueError:
                    continue
                if isinstance(template, str):
                    return template
        return None

    def model_info(self) -> ModelInfo:
        """What the UIs and the API show about this model."""
        from localpaged.model.info import ModelInfo

        config = self.hf_config()
        arch = str(config.get("model_type", "llama"))
        info = ModelInfo(
            name=self.name,
            architecture=arch,
            family=arch,
            format=self.format,
            context_length=self.context_length or int(config.get("max_position_embeddings") or 0),
            chat_template=self.chat_template(),
            size_bytes=self.size_bytes or dir_size(self.path),
            digest=self.digest,
        )
        if self.gguf_file is not None:
            gguf = self.gguf()
            info.quantization = gguf.quantization
            info.parameter_count = gguf.parameter_count
        else:
            info.quantization = _hf_quantization(config)
            info.parameter_count = _safetensors_params(self.path)
        return info


def _hf_quantization(config: dict[str, Any]) -> str:
    q = config.get("quantization_config") or {}
    if q.get("quant_method"):
        return f"{str(q['quant_method']).upper()}-{q.get('bits', 4)}bit-g{q.get('group_size', 128)}"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper())


def _safetensors_params(folder: Path) -> int:
    """Number of stored elements in the folder's safetensors files (packed ints count once)."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 0 < n < 100_000_000 else {}
        except (OSError, ValueError):
            continue
        for key, t in header.items():
            if key != "__metadata__":
                count = 1
                for d in t.get("shape", []):
                    count *= int(d)
                total += count
    return total


def _from_registered(m: RegisteredModel) -> ResolvedModel:
    weights = m.weights_path
    if not weights.exists():
        raise ModelNotPulledError(
            f"{m.name} is registered but {weights} is missing; run `localpaged rm {m.name}` "
            f"then `localpaged pull {m.name}` (or import the file again)"
        )
    gguf = weights if m.gguf_file else None
    return ResolvedModel(
        name=m.name, path=weights, format=m.format, gguf_file=gguf,
        chat_template_override=m.chat_template, context_length=m.context_length,
        source=m.source, digest=m.digest, size_bytes=m.size_bytes,
    )


def describe(model: RegisteredModel) -> RegisteredModel:
    """Fill `family`, `quantization`, `parameter_count` (and the context length, if the
    catalog gave none) from the model's files; ValueError if they are not a usable model."""
    info = _from_registered(model).model_info()
    model.family, model.quantization = info.family, info.quantization
    model.parameter_count = info.parameter_count
    model.context_length = model.context_length or info.context_length or None
    return model


def _from_path(p: Path) -> ResolvedModel:
    p = p.expanduser().resolve()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p}: a model file must be a .gguf file (or give an HF model folder)")
        from localpaged.model.gguf_loader import open_gguf

        open_gguf(p)  # validate now: a clear error naming the file
        return ResolvedModel(p.stem, p, "gguf", gguf_file=p, size_bytes=p.stat().st_size)
    config = p / "config.json"
    if not config.is_file():
        raise ValueError(f"{p}: not a model folder (no config.json) and not a .gguf file")
    try:
        q = json.loads(config.read_text(encoding="utf-8")).get("quantization_config") or {}
    except ValueError as exc:
        raise ValueError(f"{config}: not valid JSON ({exc})") from None
    fmt = str(q.get("quant_method") or "safetensors").lower()
    if fmt not in ("safetensors", "awq", "gptq"):
        raise ValueError(f"{p}: quantization {fmt!r} is not supported (awq and gptq are)")
    return ResolvedModel(p.name, p, fmt)


def _looks_like_path(text: str) -> bool:
    return text.endswith(".gguf") or text.startswith((".", "/", "~")) or "\\" in text or (
        "/" in text and not is_repo_id(text)
    )


def resolve(
    name_or_path: str, *, pull: bool = False, progress: bool | ProgressFn = True
) -> ResolvedModel:
    """The model on disk for a catalog name, `org/repo` id, registered name, HF folder or .gguf.

    With `pull=True` a missing model is pulled first (saying so on stderr / to `progress`);
    otherwise ModelNotPulledError says to run `localpaged pull NAME`. Unknown names raise
    UnknownModelError listing the closest names; path tricks in names raise ValueError."""
    text = name_or_path
    candidate = Path(text).expanduser()
    pathlike = _looks_like_path(text)
    if candidate.exists() and (pathlike or (text not in load_catalog() and not registry.get(text))):
        return _from_path(candidate)
    if pathlike and ".." not in text and "\\" not in text and not candidate.is_absolute():
        raise FileNotFoundError(f"{text}: no such model file or folder")
    check_name(text)
    registered = registry.get(name_or_path)
    if registered is not None:
        return _from_registered(registered)
    if name_or_path not in load_catalog() and not is_repo_id(name_or_path):
        raise unknown_model(name_or_path)
    if not pull:
        raise ModelNotPulledError(
            f"model {name_or_path} is not pulled yet; run `localpaged pull {name_or_path}`"
        )
    report = reporter(progress)
    report(PullProgress(f"{name_or_path} is not pulled yet: pulling it now"))
    return _from_registered(pull_model(name_or_path, progress=report))


def import_gguf(file: str | Path, name: str) -> RegisteredModel:
    """Register a local .gguf file under `name` (the file stays where it is)."""
    from localpaged.model.gguf_loader import GGUFFile

    check_name(name)
    if name in load_catalog() or registry.get(name) is not None:
        raise ValueError(f"the name {name!r} is taken; choose another --name (or `localpaged rm` it)")
    path = Path(file).expanduser().resolve()
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file")
    gguf = GGUFFile(path)
    config = gguf.hf_config()  # refuses unsupported architectures now, not at load time
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    model = RegisteredModel(
        name=name, format="gguf", path=str(path), source="import",
        pulled_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        size_bytes=path.stat().st_size, gguf_file=path.name, digest=f"sha256:{sha.hexdigest()}",
        context_length=int(config["max_position_embeddings"]),
    )
    registry.add(describe(model))
    return model


def list_pulled() -> list[RegisteredModel]:
    """Every pulled or imported model (name, format, size_bytes, pulled_at, path...)."""
    return registry.all_models()


def remove(name: str) -> RegisteredModel:
    """Unregister `name` and delete its pulled files (an imported file is left in place)."""
    import shutil

    check_name(name)
    model = registry.remove(name)
    if model is None:
        raise unknown_model(name) if name not in load_catalog() else ModelNotPulledError(
            f"model {name} is not pulled; nothing to remove"
        )
    if model.source != "import":
        shutil.rmtree(model.full_path, ignore_errors=True)
    return model
