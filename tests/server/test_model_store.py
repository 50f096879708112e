"""/api/tags, /api/show and /api/pull over the real model store (in a temporary data dir)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

NAME = "imported-smollm:q4"


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, smollm_gguf: Path) -> Iterator[Path]:
    """A data dir holding one imported GGUF (the real SmolLM2 file, registered in place)."""
    from localpaged import store

    home = tmp_path_factory.mktemp("localpaged-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALPAGED_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")  # tests never download
        store.import_gguf(smollm_gguf, NAME)
        yield home


def test_tags_lists_loaded_and_pulled_models(store_home: Path, base_url: str,
                                             model_name: str) -> None:
    models = ollama.Client(host=base_url).list().models
    assert [m.model for m in models] == [model_name, NAME]
    raw = httpx.get(base_url + "/api/tags").json()["models"][1]
    assert raw["details"]["format"] == "gguf" and raw["size"] > 0
    assert raw["digest"].startswith("sha256:")


def test_show_a_pulled_model(store_home: Path, base_url: str) -> None:
    r = ollama.Client(host=base_url).show(NAME)
    assert r.details.format == "gguf" and r.modelinfo["general.context_length"] > 0


def test_pull_streams_progress_once_to_success(store_home: Path, base_url: str) -> None:
    with httpx.stream("POST", base_url + "/api/pull", json={"model": NAME}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and len(lines) >= 2
    assert [x["status"] for x in lines].count("success") == 1 and lines[-1]["status"] == "success"
    progress = list(ollama.Client(host=base_url).pull(NAME, stream=True))
    assert progress[-1].status == "success"


def test_pull_unknown_model(store_home: Path, base_url: str) -> None:
    r = httpx.post(base_url + "/api/pull", json={"model": "no-such-model:1b", "stream": False})
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]
    with httpx.stream("POST", base_url + "/api/pull", json={"model": "no-such-model:1b"}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "error" in lines[-1]
    with pytest.raises(ollama.ResponseError):
        for _ in ollama.Client(host=base_url).pull("no-such-model:1b", stream=True):
            pass
