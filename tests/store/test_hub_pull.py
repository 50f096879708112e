"""Pulling from the hub, tested at the HTTP boundary: huggingface_hub talks to a local server
that serves a fake repo (real safetensors from a tiny Llama) and misbehaves on request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localpaged import store
from localpaged.store import registry

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "testorg/tiny-llama"


@pytest.fixture
def repo_files(tiny_llama: Path) -> dict[str, bytes]:
    files = {"config.json": (tiny_llama / "config.json").read_bytes(),
             "generation_config.json": (tiny_llama / "generation_config.json").read_bytes(),
             "model.safetensors": (tiny_llama / "model.safetensors").read_bytes()}
    # Files a safetensors pull must skip.
    files["pytorch_model.bin"] = b"\0" * 5000
    files["README.md"] = b"# tiny\n"
    files["onnx/model.onnx"] = b"onnx" * 100
    return files


@pytest.fixture
def hub(fake_hub, fake_repo, repo_files, store_home, monkeypatch):
    repo = fake_repo(REPO, COMMIT, repo_files, lfs={"model.safetensors", "pytorch_model.bin"})
    with fake_hub(repo) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        (store_home).mkdir(parents=True, exist_ok=True)
        (store_home / "models.toml").write_text(
            f'[models."tiny:test"]\nrepo = "{REPO}"\nrevision = "{COMMIT}"\nformat = "fp32"\n'
            'context_length = 512\ndescription = "test"\n'
        )
        yield server


def _nothing_registered(home: Path) -> None:
    assert registry.all_models() == []
    assert not any((home / "models").glob("*")) if (home / "models").exists() else True


def test_pull_downloads_only_needed_files_and_registers(hub, store_home, repo_files):
    events = []
    model = store.pull("tiny:test", progress=events.append)
    assert model.format == "safetensors" and model.source == f"hub:{REPO}@{COMMIT}"
    assert (model.family, model.context_length) == ("llama", 512) and model.parameter_count > 0
    folder = store_home / model.path
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).read_bytes() == repo_files[name]
    assert hub.gets("pytorch_model.bin") == [] and hub.gets("onnx/model.onnx") == []
    # progress events count bytes up to the total, like /api/pull
    sizes = sum(len(repo_files[n]) for n in ("config.json", "generation_config.json", "model.safetensors"))
    assert events[-1].status == "success"
    assert max(e.completed for e in events) == sizes and {e.total for e in events if e.total} == {sizes}
    # resolve hands the folder to the loaders, with ModelInfo filled from the files
    resolved = store.resolve("tiny:test")
    assert resolved.path == folder and resolved.format == "safetensors" and resolved.gguf_file is None
    info = resolved.model_info()
    assert info.architecture == "llama" and info.context_length == 512
    assert info.parameter_count > 0 and info.size_bytes == model.size_bytes
    assert not (store_home / "partial" / "tiny__test").exists()


def test_resume_after_dropped_connection(hub, store_home, repo_files, monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub resumes from the last whole read chunk (10 MB by default): use
    # 64 KB chunks so that this small file is several chunks long.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    size = len(repo_files["model.safetensors"])
    hub.faults.drop_after["model.safetensors"] = size // 2
    model = store.pull("tiny:test", progress=False)
    got = (store_home / model.path / "model.safetensors").read_bytes()
    assert got == repo_files["model.safetensors"]
    # the second request asked only for the rest, from a whole chunk the first one delivered
    first, second = hub.gets("model.safetensors")
    assert first is None and second is not None
    resumed_at = int(second.removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= size // 2 and resumed_at % (64 * 1024) == 0


def test_hash_mismatch_is_rejected_and_nothing_registered(hub, store_home):
    hub.faults.corrupt.add("model.safetensors")
    with pytest.raises(store.IntegrityError, match=r"model.safetensors.*sha256"):
        store.pull("tiny:test", progress=False)
    _nothing_registered(store_home)
    assert not list(store_home.rglob("model.safetensors"))
    with pytest.raises(store.ModelNotPulledError, match="localpaged pull tiny:test"):
        store.resolve("tiny:test")


def test_partial_download_not_registered_then_resumed(hub, store_home, repo_files):
    size = len(repo_files["model.safetensors"])
    hub.faults.drop_after["model.safetensors"] = size // 2
    hub.faults.fail_retries.add("model.safetensors")
    with pytest.raises(RuntimeError, match=r"could not pull tiny:test: tried hub .*run the pull again"):
        store.pull("tiny:test", progress=False)
    _nothing_registered(store_home)
    staging = store_home / "partial" / "tiny__test"
    # completed files are kept for the next try; no partial weights anywhere
    assert (staging / "config.json").is_file()
    assert not [p for p in store_home.rglob("model.safetensors*") if p.suffix != ".lock"]
    hub.faults.fail_retries.clear()
    model = store.pull("tiny:test", progress=False)
    assert (store_home / model.path / "model.safetensors").read_bytes() == repo_files["model.safetensors"]
    assert len(hub.gets("config.json")) == 1  # not downloaded twice
    assert not staging.exists()


def test_raw_repo_id_detects_awq(fake_hub, fake_repo, store_home, monkeypatch, repo_files):
    config = json.loads(repo_files["config.json"])
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    files = {"config.json": json.dumps(config).encode(),
             "model.safetensors": repo_files["model.safetensors"]}
    with fake_hub(fake_repo("someone/tiny-awq", COMMIT, files, lfs={"model.safetensors"})) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(store.ModelNotPulledError, match="localpaged pull someone/tiny-awq"):
            store.resolve("someone/tiny-awq")
        resolved = store.resolve("someone/tiny-awq", pull=True, progress=False)
    assert resolved.format == "awq" and resolved.name == "someone/tiny-awq"
    assert resolved.model_info().quantization == "AWQ-4bit-g128"
    assert (store_home / "models" / "someone--tiny-awq" / "config.json").is_file()


def test_gguf_entry_pulls_only_its_file(fake_hub, fake_repo, store_home, monkeypatch, tmp_path):
    from ggufmaker import write_tiny_gguf

    gguf_bytes = write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
    files = {"tiny-Q8_0.gguf": gguf_bytes, "tiny-F16.gguf": b"x" * 1000, "README.md": b"hi"}
    with fake_hub(fake_repo("org/tiny-gguf", COMMIT, files, lfs={"tiny-Q8_0.gguf"})) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        store_home.mkdir(parents=True)
        (store_home / "models.toml").write_text(
            '[models."tiny:gguf"]\nrepo = "org/tiny-gguf"\nformat = "gguf"\nfile = "tiny-Q8_0.gguf"\n')
        resolved = store.resolve("tiny:gguf", pull=True, progress=False)
        assert hub.gets("tiny-F16.gguf") == [] and hub.gets("README.md") == []
    assert resolved.format == "gguf" and resolved.path == resolved.gguf_file
    assert resolved.path.read_bytes() == gguf_bytes
    assert resolved.hf_config()["num_hidden_layers"] == 1


def test_unusable_files_are_not_registered(fake_hub, fake_repo, store_home, monkeypatch, repo_files):
    files = {"config.json": b"{ this is not json", "model.safetensors": repo_files["model.safetensors"]}
    with fake_hub(fake_repo("org/broken", COMMIT, files, lfs={"model.safetensors"})) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ValueError, match=r"org/broken.*config\.json"):
            store.pull("org/broken", progress=False)
    _nothing_registered(store_home)
    assert not (store_home / "models" / "org--broken").exists()


def test_concurrent_pulls_of_one_model_download_once(hub, store_home):
    """A second pull of the same name waits for the first and then finds it registered."""
    from concurrent.futures import ThreadPoolExecutor

    hub.faults.delay["model.safetensors"] = 1.0
    events: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: store.pull("tiny:test", progress=lambda e: events.append(e.status)),
                                range(2)))
    assert results[0] == results[1] and registry.all_models() == [results[0]]
    assert len(hub.gets("model.safetensors")) == 1
    assert "waiting for another pull of tiny:test to finish" in events
    assert "tiny:test is already pulled (hub:testorg/tiny-llama@" + COMMIT + ")" in events
