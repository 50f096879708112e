"""Download a model repo from the Hugging Face hub: only the files its format needs, each
checked against the size and hash the hub reports."""

from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from localpaged.store.progress import ByteCounter, ProgressFn

# What a safetensors / AWQ / GPTQ folder needs; everything else (pytorch .bin, onnx, gguf,
# images, READMEs) is skipped.
_HF_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja",
    "quantize_config.json", "quant_config.json",
)


# A hub that does not answer (a firewall dropping packets) is given up on after this long.
LISTING_TIMEOUT_S = float(os.environ.get("LOCALPAGED_HUB_TIMEOUT", "20"))


class SourceUnavailable(RuntimeError):
    """This source cannot serve the model right now (unreachable, offline, not found): the
    next source may be tried."""


class IntegrityError(ValueError):
    """A downloaded file does not match the size or hash the source reported."""


@dataclass
class RemoteFile:
    """A file of a hub repo, with what the hub says about it."""

    name: str
    size: int | None
    sha256: str | None  # for LFS files
    git_sha1: str | None  # the git blob id, for small files


def hub_endpoint() -> str | None:
    """`$HF_ENDPOINT` read now (huggingface_hub reads it only once, at import)."""
    value = os.environ.get("HF_ENDPOINT")
    return value.rstrip("/") if value else None


def select_files(files: list[RemoteFile], fmt: str, gguf_file: str | None) -> list[RemoteFile]:
    """The files a model of format `fmt` needs, from the repo listing."""
    if fmt == "gguf":
        chosen = [f for f in files if f.name == gguf_file]
        if not chosen:
            ggufs = sorted(f.name for f in files if f.name.endswith(".gguf"))
            raise ValueError(f"the repo has no file {gguf_file!r}; GGUF files there: {ggufs or 'none'}")
        return chosen
    chosen = [f for f in files if "/" not in f.name
              and any(fnmatch.fnmatch(f.name, p) for p in _HF_PATTERNS)]
    if not any(f.name.endswith(".safetensors") for f in chosen):
        ggufs = [f.name for f in files if f.name.endswith(".gguf")]
        hint = (f" It has GGUF files ({', '.join(ggufs[:3])}): add a catalog entry with "
                "format = \"gguf\" and file = \"NAME.gguf\".") if ggufs else ""
        raise ValueError(f"the repo has no .safetensors weights.{hint}")
    return chosen


def list_repo(repo: str, revision: str, endpoint: str | None) -> tuple[str, list[RemoteFile]]:
    """The commit `revision` points at and the repo's files with sizes and hashes."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi(endpoint=endpoint).model_info(
            repo, revision=revision, files_metadata=True, timeout=LISTING_TIMEOUT_S
        )
    except GatedRepoError as exc:
        raise SourceUnavailable(
            f"{repo} is gated: accept its license on the hub, then log in (`hf auth login`) "
            "or set HF_TOKEN"
        ) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise SourceUnavailable(f"{repo}@{revision} not found or not accessible ({type(exc).__name__})") from exc
    except OfflineModeIsEnabled as exc:
        raise SourceUnavailable("HF_HUB_OFFLINE is set") from exc
    except Exception as exc:
        if is_network_error(exc):
            raise SourceUnavailable(_short(exc)) from exc
        raise
    files = [
        RemoteFile(
            name=s.rfilename,
            size=s.lfs.size if s.lfs else s.size,
            sha256=s.lfs.sha256 if s.lfs else None,
            git_sha1=None if s.lfs else s.blob_id,
        )
        for s in info.siblings or []
    ]
    return info.sha or revision, files


def is_network_error(exc: BaseException) -> bool:
    """Whether `exc` says the network or the server failed (not the local disk)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    root = type(exc).__module__.split(".")[0]
    return root in ("httpx", "httpx2", "httpcore", "huggingface_hub", "requests", "urllib3")


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def file_digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, read once."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def verify(path: Path, remote: RemoteFile) -> str:
    """Check `path` against the hub's size and hash; returns its sha256. On a mismatch the
    file is deleted and IntegrityError raised."""
    size = path.stat().st_size
    sha256, git_sha1 = file_digests(path)
    problem = None
    if remote.size is not None and size != remote.size:
        problem = f"size {size} bytes, the hub says {remote.size}"
    elif remote.sha256 and sha256 != remote.sha256:
        problem = f"sha256 {sha256}, the hub says {remote.sha256}"
    elif remote.git_sha1 and git_sha1 != remote.git_sha1:
        problem = f"git blob id {git_sha1}, the hub says {remote.git_sha1}"
    if problem:
        path.unlink(missing_ok=True)
        raise IntegrityError(
            f"{remote.name}: downloaded file does not match ({problem}); it was deleted. "
            "Run the pull again; if it keeps failing, the mirror or proxy is serving bad data."
        )
    return sha256


def download_files(
    repo: str,
    commit: str,
    files: list[RemoteFile],
    dest: Path,
    report: ProgressFn,
    endpoint: str | None,
) -> dict[str, str]:
    """Download `files` of `repo` at `commit` into `dest` (resuming what an earlier run left
    there) and verify each one. Returns {file name: sha256}."""
    from huggingface_hub import hf_hub_download

    counter = ByteCounter(report, sum(f.size or 0 for f in files))
    digests: dict[str, str] = {}
    for remote in files:
        target = dest / remote.name
        if target.is_file() and target.stat().st_size == remote.size:
            counter.start(f"verifying {remote.name} (downloaded earlier)", remote.name)
            try:
                digests[remote.name] = verify(target, remote)
                counter.add(remote.size or 0)
                continue
            except IntegrityError:
                pass  # deleted: download it again below
        counter.start(f"downloading {remote.name}", remote.name)
        try:
            hf_hub_download(
                repo, remote.name, revision=commit, local_dir=dest, endpoint=endpoint,
                tqdm_class=counter.tqdm_class(),  # type: ignore[arg-type]
            )
        except Exception as exc:
            if "Consistency check failed" in str(exc):
                raise IntegrityError(f"{remote.name}: {_short(exc)}") from None
            if is_network_error(exc):
                raise SourceUnavailable(
                    f"download of {remote.name} broke off ({_short(exc)}); "
                    "files finished so far are kept, run the pull again to resume"
                ) from exc
            raise
        counter.start(f"verifying {remote.name}", remote.name)
        digests[remote.name] = verify(target, remote)
    return digests
